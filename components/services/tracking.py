"""Local servers for people to look at: the MLflow UI/tracking server and the Prefect server.

MLflow is optional (flows write SQLite directly). Prefect: the life-cycle command
(``./run demo``, ``python -m flows.retrain``) runs its flows against the project's Prefect server,
starting it if needed, so every run shows in its UI and no flow leaves a temporary API server
behind when it is killed (Prefect's temporary server is a child process a SIGKILL orphans).
"""

from __future__ import annotations

import sys
from pathlib import Path

from components.services.process import LOOPBACK, VAR_DIR, ManagedService, http_ok

VENV_BIN = Path(sys.executable).parent


def mlflow_service(port: int = 5000) -> ManagedService:
    """``mlflow server`` over the same SQLite store and artifact folder the flows write to."""
    folder = VAR_DIR / "mlflow"
    folder.mkdir(parents=True, exist_ok=True)
    url = f"http://{LOOPBACK}:{port}"
    command = [
        str(VENV_BIN / "mlflow"), "server", "--host", LOOPBACK, "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
        "--default-artifact-root", (folder / "artifacts").resolve().as_uri(),
    ]
    return ManagedService("mlflow", command, health=lambda: http_ok(f"{url}/health"),
                          env={"MLFLOW_ENABLE_TELEMETRY": "false"}, startup_timeout_s=90, ports=(port,), url=url)


PREFECT_PORT = 4200


def prefect_api_url(port: int = PREFECT_PORT) -> str:
    return f"http://{LOOPBACK}:{port}/api"


def ensure_prefect_server(port: int = PREFECT_PORT) -> str:
    """Start the project's Prefect server unless it runs; returns its API URL."""
    prefect_service(port).start()
    return prefect_api_url(port)


def prefect_service(port: int = PREFECT_PORT) -> ManagedService:
    """A Prefect API + UI server, needed for scheduled deployments to run."""
    home = VAR_DIR / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    url = f"http://{LOOPBACK}:{port}"
    command = [str(VENV_BIN / "prefect"), "server", "start", "--host", LOOPBACK, "--port", str(port)]
    env = {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "true"}
    return ManagedService("prefect", command, health=lambda: http_ok(f"{url}/api/health"), env=env, startup_timeout_s=120,
                          ports=(port,), url=url)
