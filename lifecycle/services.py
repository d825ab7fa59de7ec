"""Start, stop and inspect the project's local services, all on 127.0.0.1 and stopped by PID.

    ./run services start labelstudio|triton|mlflow|prefect [...] [--port N]
    ./run services stop name [...] | --all
    ./run services status [name ...]

Starting a service that already runs says so and succeeds; a port another process holds fails
with the port named. ``--port`` moves one service off its default port (Prefect: 4200, the
pipeline config's ``execution.prefect_port``).
"""

from __future__ import annotations

import argparse
import sys

from components.services.labelstudio import label_studio_service, start_label_studio, stop_label_studio
from components.services.process import LOOPBACK, ManagedService, ServiceError
from components.services.tracking import mlflow_service, prefect_service

SERVICES = ("labelstudio", "triton", "mlflow", "prefect")
PORTS = {"labelstudio": 8089, "triton": 8000, "mlflow": 5000, "prefect": 4200}


def _service(name: str) -> ManagedService:
    if name == "labelstudio":
        return label_studio_service(PORTS[name])
    if name == "triton":
        # deferred: the Triton launcher takes seconds to import; only the triton service needs it
        from deploy.triton.server import DEFAULT_SERVICE_NAME

        return ManagedService(DEFAULT_SERVICE_NAME, command=[], health=lambda: False)
    if name == "mlflow":
        return mlflow_service(PORTS[name])
    return prefect_service(PORTS[name])


def start(name: str) -> str:
    pid = _service(name).pid()
    if pid is not None:
        return f"{name} is already running (pid {pid})"
    if name == "labelstudio":
        connection = start_label_studio(PORTS[name])
        return f"Label Studio {connection.url} (API token and login in var/services/labelstudio/credentials.json)"
    if name == "triton":
        # deferred: the Triton launcher and MLflow take seconds to import; only the triton service needs them
        from components.registry.mlflow_registry import default_tracking_uri
        from deploy.triton.server import TritonPorts, start_triton

        server = start_triton(ports=TritonPorts(PORTS["triton"], PORTS["triton"] + 1, PORTS["triton"] + 2), tracking_uri=default_tracking_uri())
        return f"Triton http {server.http_url} grpc {server.grpc_url} metrics {server.metrics_url} (models:/docmarkup@champion)"
    _service(name).start()
    return f"{name} http://{LOOPBACK}:{PORTS[name]}"


def stop(name: str) -> bool:
    if name == "triton":
        # deferred: the Triton launcher takes seconds to import; only the triton service needs it
        from deploy.triton.server import DEFAULT_SERVICE_NAME, TRITON_VAR, TritonPorts, triton_server

        repository = TRITON_VAR / DEFAULT_SERVICE_NAME / "model_repository"
        if not repository.is_dir():
            return False
        return triton_server(repository, ports=TritonPorts(PORTS["triton"], PORTS["triton"] + 1, PORTS["triton"] + 2)).stop()
    if name == "labelstudio":
        return stop_label_studio()
    return _service(name).stop()


def status_line(name: str) -> str:
    """``mlflow: running, pid 123, http://127.0.0.1:5055``: where it listens, as recorded at its start."""
    service = _service(name)
    pid = service.pid()
    if pid is None:
        return f"{name}: not running"
    return f"{name}: running, pid {pid}, {service.recorded_url() or 'address not recorded (started before this version)'}"


def running_url(name: str) -> str | None:
    """Where the named service listens now (its recorded URL), or None when it is not running."""
    return _service(name).recorded_url()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("names", nargs="*", choices=[[], *SERVICES], default=[])
    parser.add_argument("--all", action="store_true", help="every service (stop/status)")
    parser.add_argument("--port", type=int, help="the port of the one service named (default: " +
                        ", ".join(f"{name} {port}" for name, port in PORTS.items()) + ")")
    args = parser.parse_args(argv)
    if args.port is not None:
        if len(args.names) != 1:
            parser.error("--port needs exactly one service name")
        PORTS[args.names[0]] = args.port
    names = list(SERVICES) if args.all or (args.action == "status" and not args.names) else args.names
    if args.all and args.action == "start":
        parser.error("start takes service names, not --all")
    if not names:
        parser.error(f"name the services to {args.action} ({', '.join(SERVICES)}){' or --all' if args.action == 'stop' else ''}")
    status = 0
    for name in names:
        try:
            if args.action == "start":
                print(start(name))
            elif args.action == "stop":
                print(f"{name}: {'stopped' if stop(name) else 'was not running'}")
            else:
                print(status_line(name))
        except ServiceError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
