"""Optional local servers for people to look at: the MLflow UI/tracking server and a Prefect server.

Flows do not need either (MLflow writes SQLite directly; Prefect starts a temporary API per
run), but browsing runs and serving scheduled deployments do.
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
                          env={"MLFLOW_ENABLE_TELEMETRY": "false"}, startup_timeout_s=90)


def prefect_service(port: int = 4200) -> ManagedService:
    """A Prefect API + UI server, needed for scheduled deployments to run."""
    home = VAR_DIR / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    url = f"http://{LOOPBACK}:{port}"
    command = [str(VENV_BIN / "prefect"), "server", "start", "--host", LOOPBACK, "--port", str(port)]
    env = {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "true"}
    return ManagedService("prefect", command, health=lambda: http_ok(f"{url}/api/health"), env=env, startup_timeout_s=120)
