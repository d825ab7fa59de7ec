"""A local Label Studio server for the human correction loop, started and stopped by PID.

Label Studio 1.23.2 lives in its own virtualenv (``.venv-labelstudio``) because its Django
pins clash with the main environment. We launch ``label-studio start`` non-interactively:

- bound to 127.0.0.1 only, on a port we choose; Label Studio silently moves to the next
  port when its port is taken, so a port held by someone else is refused up front instead;
- SQLite and media under ``var/services/<name>/data`` (migrations run on the first start only);
- one pre-created admin user whose **legacy API token** is fixed at creation time. In 1.23
  legacy tokens are off by default (JWT personal tokens replaced them); they are switched on
  per organisation when the organisation is created, which is why both the
  ``--enable-legacy-api-token`` flag and ``LABEL_STUDIO_ENABLE_LEGACY_API_TOKEN`` are passed;
- no browser, no prompt, no Sentry, no usage analytics, no PyPI version check, feature flags
  from the bundled file (nothing leaves the machine, nothing blocks start-up on the network).

Credentials are generated once per service name and kept in ``credentials.json`` next to the
PID file, because the token is written into the database only when the user is first created:
reusing a data folder with different credentials would lock us out.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from components.services.process import (
    LOOPBACK,
    PROJECT_ROOT,
    VAR_DIR,
    ManagedService,
    ServiceError,
    free_port,
    open_private,
    port_open,
    private_dir,
)

LABEL_STUDIO_VENV = Path(os.environ.get("DOCMARKUP_LABEL_STUDIO_VENV", PROJECT_ROOT / ".venv-labelstudio"))
DEFAULT_PORT = 8089
DEFAULT_SERVICE_NAME = "labelstudio"
TEST_SERVICE_NAME = "labelstudio-test"
DEFAULT_EMAIL = "curator@docmarkup.local"
# First start applies the migrations to a fresh SQLite file: ~40-45 s on a busy 2-core machine.
STARTUP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LabelStudioConnection:
    """Where a running Label Studio answers and the legacy API token to talk to it."""

    url: str
    api_key: str

    def client(self, timeout: float = 120.0):
        """A ``label_studio_sdk.LabelStudio`` client for this server."""
        from label_studio_sdk import LabelStudio  # deferred: only talking to Label Studio needs the SDK

        return LabelStudio(base_url=self.url, api_key=self.api_key, timeout=timeout)


@dataclass(frozen=True)
class LabelStudioCredentials:
    email: str
    password: str
    api_key: str


def _state_dir(name: str) -> Path:
    return VAR_DIR / "services" / name


def default_data_dir(name: str = DEFAULT_SERVICE_NAME) -> Path:
    return _state_dir(name) / "data"


def load_or_create_credentials(name: str = DEFAULT_SERVICE_NAME) -> LabelStudioCredentials:
    """The admin user's credentials for this service, generated (randomly) on first use."""
    path = _state_dir(name) / "credentials.json"
    if path.exists():
        try:
            return LabelStudioCredentials(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise ServiceError(f"{path} is not valid credentials JSON ({exc}); delete it together with the data folder") from exc
    credentials = LabelStudioCredentials(
        email=DEFAULT_EMAIL, password=secrets.token_urlsafe(16), api_key=secrets.token_hex(20)
    )
    private_dir(path.parent)
    with open_private(path, "w") as handle:
        json.dump(asdict(credentials), handle, indent=2)
    return credentials


def _health_check(url: str) -> bool:
    try:
        response = requests.get(f"{url}/health", timeout=2.0)
        return response.status_code == 200 and response.json().get("status") == "UP"
    except (requests.RequestException, ValueError):
        return False


def label_studio_service(
    port: int = DEFAULT_PORT,
    *,
    name: str = DEFAULT_SERVICE_NAME,
    data_dir: str | os.PathLike | None = None,
    credentials: LabelStudioCredentials | None = None,
) -> ManagedService:
    """The :class:`ManagedService` that runs Label Studio on ``127.0.0.1:port``."""
    binary = LABEL_STUDIO_VENV / "bin" / "label-studio"
    data = Path(data_dir) if data_dir is not None else default_data_dir(name)
    creds = credentials or load_or_create_credentials(name)
    url = f"http://{LOOPBACK}:{port}"
    env = {
        # Where everything lives; explicit so stray HOST/PORT/DJANGO_DB variables cannot leak in
        # (Label Studio also reads un-prefixed names as a fallback).
        "LABEL_STUDIO_BASE_DATA_DIR": str(data),
        "LABEL_STUDIO_DJANGO_DB": "sqlite",
        "LABEL_STUDIO_HOST": url,
        "LABEL_STUDIO_ALLOWED_HOSTS": f"{LOOPBACK},localhost",
        "LABEL_STUDIO_DEBUG": "false",
        "LOG_LEVEL": "WARNING",
        # Non-interactive user + legacy token.
        "LABEL_STUDIO_ENABLE_LEGACY_API_TOKEN": "true",
        "LABEL_STUDIO_DISABLE_SIGNUP_WITHOUT_LINK": "true",
        # Nothing phones home, nothing waits on the network.
        "SENTRY_DSN": "",
        "FRONTEND_SENTRY_DSN": "",
        "COLLECT_ANALYTICS": "false",
        "LATEST_VERSION_CHECK": "false",
        "FEATURE_FLAGS_OFFLINE": "true",
        "PYTHONUNBUFFERED": "1",
        # The admin user, through the environment: never on a command line (``ps``) or in a log.
        "LABEL_STUDIO_USERNAME": creds.email,
        "LABEL_STUDIO_PASSWORD": creds.password,
        "LABEL_STUDIO_USER_TOKEN": creds.api_key,
    }
    command = [
        str(binary), "start",
        "--no-browser",
        "--internal-host", LOOPBACK,
        "--port", str(port),
        "--data-dir", str(data),
        "--database", str(data / "label_studio.sqlite3"),
        "--enable-legacy-api-token",
        "--log-level", "WARNING",
    ]
    return ManagedService(
        name=name, command=command, health=lambda: _health_check(url), env=env,
        cwd=_state_dir(name), startup_timeout_s=STARTUP_TIMEOUT_S, secrets=(creds.password, creds.api_key), url=url,
    )


def start_label_studio(
    port: int = DEFAULT_PORT,
    *,
    name: str = DEFAULT_SERVICE_NAME,
    data_dir: str | os.PathLike | None = None,
) -> LabelStudioConnection:
    """Start (or reuse) the Label Studio server and check its API token works."""
    binary = LABEL_STUDIO_VENV / "bin" / "label-studio"
    if not binary.exists():
        raise ServiceError(
            f"Label Studio is not installed at {binary}; create it with `./run setup` "
            f"(or `python3.11 -m venv {LABEL_STUDIO_VENV} && {LABEL_STUDIO_VENV}/bin/pip install label-studio==1.23.2`)"
        )
    url = f"http://{LOOPBACK}:{port}"
    # Only the PID file matters for this probe; the real command line is built below.
    already_running = ManagedService(name=name, command=["label-studio"], health=lambda: False).running()
    reused = already_running and _health_check(url)
    if not reused and port_open(port):
        raise ServiceError(
            f"port {port} is already taken by another process, so Label Studio cannot listen on {url} "
            "(it would silently move to another port); choose a free port"
        )
    credentials = load_or_create_credentials(name)
    service = label_studio_service(port, name=name, data_dir=data_dir, credentials=credentials)
    _state_dir(name).mkdir(parents=True, exist_ok=True)
    service.start()
    response = requests.get(
        f"{url}/api/current-user/whoami", headers={"Authorization": f"Token {credentials.api_key}"}, timeout=10
    )
    if response.status_code != 200:
        raise ServiceError(
            f"Label Studio at {url} rejected the stored API token (HTTP {response.status_code}: "
            f"{response.text[:200]}); the data folder was created with other credentials. "
            f"Stop the server and remove {default_data_dir(name) if data_dir is None else data_dir} to start afresh."
        )
    return LabelStudioConnection(url=url, api_key=credentials.api_key)


def stop_label_studio(name: str = DEFAULT_SERVICE_NAME) -> bool:
    """Stop the named Label Studio server by its recorded PID (False if it was not running)."""
    # The command line does not matter for stopping: the PID file identifies the process group.
    service = ManagedService(name=name, command=["label-studio"], health=lambda: False)
    return service.stop()


@contextlib.contextmanager
def running_label_studio(
    name: str = TEST_SERVICE_NAME, data_dir: str | os.PathLike | None = None
) -> Iterator[LabelStudioConnection]:
    """A Label Studio on a free port for the duration of a ``with`` block (the test fixture).

    The data folder persists under ``var/services/<name>/data`` unless given, so only the
    first run on a machine pays for the migrations; callers use unique project titles.
    """
    connection = start_label_studio(free_port(), name=name, data_dir=data_dir)
    try:
        yield connection
    finally:
        stop_label_studio(name)
