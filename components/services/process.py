"""Start, health-check and stop local services (Label Studio, Triton, MLflow) by PID.

Every service the project needs is launched by this module, bound to 127.0.0.1, with its
PID, log and state under ``var/services/<name>/``. Stopping signals the service's whole
process group (services spawn workers), first politely, then for good.

Secrets (passwords, API tokens, admin keys) live in 0600 files under the state folder and reach
a service through its environment wherever it reads them there (Label Studio); a secret a service
only takes as an argument (Triton's admin key) is redacted from the logged command line. A
service's log, PID file and state folder are private to the user (0600 / 0700).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

from components.progress import waiting_line

STARTUP_NOTE_S = 10.0  # a line every this many seconds while a service starts

PROJECT_ROOT = Path(__file__).resolve().parents[2]
VAR_DIR = Path(os.environ.get("DOCMARKUP_VAR", PROJECT_ROOT / "var"))
LOOPBACK = "127.0.0.1"


class ServiceError(RuntimeError):
    """A service could not be started, did not become healthy, or is not running."""


REDACTED = "<redacted>"


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and make it readable by its owner only."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def open_private(path: Path, mode: str = "ab"):
    """Open a file that only its owner may read (created 0600; an existing one is tightened)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode)


def load_or_create_secret(path: Path, nbytes: int = 32) -> str:
    """A random hex secret kept in a 0600 file, generated on first use."""
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        value = ""
    if value:
        return value
    private_dir(path.parent)
    value = secrets.token_hex(nbytes)
    with open_private(path, "w") as handle:
        handle.write(value + "\n")
    return value


def redact(text: str, hidden: Sequence[str]) -> str:
    """``text`` with every non-empty secret in ``hidden`` replaced by a marker."""
    for secret in hidden:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def port_open(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        return requests.get(url, timeout=timeout).status_code < 500
    except requests.RequestException:
        return False


@dataclass
class ManagedService:
    """One local service process: how to launch it and how to tell it is ready."""

    name: str
    command: Sequence[str]
    health: Callable[[], bool]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    startup_timeout_s: float = 120.0
    secrets: Sequence[str] = ()  # values never written to the log (redacted from the command line)
    ports: Sequence[int] = ()  # where it listens: each must be free before it starts
    url: str = ""  # where people and clients reach it; recorded at start, so status shows the port really used

    @property
    def state_dir(self) -> Path:
        return VAR_DIR / "services" / self.name

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "pid"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "service.log"

    @property
    def url_file(self) -> Path:
        return self.state_dir / "url"

    def recorded_url(self) -> str | None:
        """Where the running service listens, as recorded when it started (None: not running or unknown)."""
        if not self.running():
            return None
        try:
            return self.url_file.read_text().strip() or None
        except FileNotFoundError:
            return None

    def pid(self) -> int | None:
        """The PID recorded for this service, if that process is still alive."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        # A zombie child still answers kill(0); reap it so it does not count as running.
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return None
        return pid

    def running(self) -> bool:
        return self.pid() is not None

    def start(self) -> int:
        """Launch the service (or reuse the running one) and wait until it is healthy."""
        pid = self.pid()
        if pid is not None and self.health():
            return pid
        if pid is not None:
            self.stop()
        busy = [port for port in self.ports if port_open(port)]
        if busy:  # another server holds it: starting would "succeed" against the wrong process or die later
            raise ServiceError(f"{self.name} cannot start: port {', '.join(map(str, busy))} on {LOOPBACK} is already "
                               "in use by another process; stop it or configure another port")
        private_dir(self.state_dir)
        self._scrub_log()
        env = {**os.environ, **self.env}
        with open_private(self.log_file) as log:
            logged = redact(" ".join(self.command), self.secrets)
            log.write(f"\n--- start {time.strftime('%Y-%m-%d %H:%M:%S')}: {logged}\n".encode())
            log.flush()
            process = subprocess.Popen(
                list(self.command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.cwd, env=env, start_new_session=True,
            )
        with open_private(self.pid_file, "w") as handle:
            handle.write(str(process.pid))
        began = time.monotonic()
        deadline = began + self.startup_timeout_s
        next_note = began + STARTUP_NOTE_S
        while time.monotonic() < deadline:
            if time.monotonic() >= next_note:  # a start-up of half a minute is not a silent one
                print(waiting_line(self.name, time.monotonic() - began, self.startup_timeout_s), flush=True)
                next_note += STARTUP_NOTE_S
            if process.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited with code {process.returncode} during start-up; last log lines:\n{self.tail_log()}"
                )
            if self.health():
                if self.url:
                    with open_private(self.url_file, "w") as handle:
                        handle.write(self.url + "\n")
                return process.pid
            time.sleep(0.5)
        self.stop()
        raise ServiceError(f"{self.name} was not healthy after {self.startup_timeout_s:.0f}s; last log lines:\n{self.tail_log()}")

    def _scrub_log(self) -> None:
        """Redact secrets that an older version of this project wrote into the existing log."""
        if not self.secrets or not self.log_file.exists():
            return
        text = self.log_file.read_text(errors="replace")
        cleaned = redact(text, self.secrets)
        if cleaned != text:
            with open_private(self.log_file, "w") as handle:
                handle.write(cleaned)

    def stop(self, grace_s: float = 15.0) -> bool:
        """Stop the service's process group by PID. Returns False if it was not running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and self.pid() is not None:
                time.sleep(0.2)
            if self.pid() is None:
                break
        self.pid_file.unlink(missing_ok=True)
        return True

    def tail_log(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"
