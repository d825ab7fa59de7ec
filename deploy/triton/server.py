"""Run a real Triton Inference Server on a CPU-only machine, started and stopped by PID.

NVIDIA publishes no CPU-only server image, but the PyTriton wheel (``nvidia-pytriton``, kept in
its own virtualenv ``.venv-triton`` because it pins ``numpy<2``) bundles a complete
``tritonserver`` 2.51 binary, the Python backend (``libtriton_python.so``) and one Python
backend stub per Python version. We launch that binary directly, the way PyTriton does, minus
PyTriton's own proxy model:

- ``LD_LIBRARY_PATH`` gets the wheel's ``nvidia_pytriton.libs`` (libcudart, libtritonserver,
  ...) and the project interpreter's ``LIBDIR`` so the stub embeds *our* ``libpython3.11``;
- a backend directory under ``var/triton/runtime`` links the Python backend and the stub built
  for the project's Python version (the stub must match the interpreter it embeds);
- the stub's embedded interpreter finds ``python3`` on ``PATH`` and, through the
  ``pyvenv.cfg`` next to it, its site-packages. That directory is a tiny "stub environment"
  holding NumPy 1.x (linked from ``.venv-triton``) and a ``.pth`` that appends the project's
  ``.venv`` site-packages (torch, transformers, mlflow, our packages). NumPy 1.x first is not
  optional: the stub's pybind11 reads NumPy 2 arrays with the wrong layout, so a ``BYTES``
  input arrives as garbage and the stub aborts (``unpack_from requires a buffer of at least
  84215049 bytes``);
- no GPU: GPU metrics and the pinned-memory pool are switched off; CUDA-missing warnings in
  the log are expected;
- HTTP, gRPC and metrics bind to 127.0.0.1; the Python backend's shared-memory regions get a
  per-service prefix so parallel servers never share them, and are removed after stop;
- the admin APIs are restricted: loading/unloading models (a load may carry a ``model.py``
  override, i.e. code that runs in the server), shared-memory registration, tracing and
  logging settings (both write files) answer only requests carrying the header
  ``docmarkup-admin-key`` (gRPC: ``triton-grpc-protocol-docmarkup-admin-key``) with the key
  kept in ``var/services/<name>/admin.key`` (0600).
  Inference, health, metadata and statistics stay open on loopback (docs/security.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import sysconfig
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import requests
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from components.services.process import (
    LOOPBACK,
    PROJECT_ROOT,
    VAR_DIR,
    ManagedService,
    ServiceError,
    free_port,
    load_or_create_secret,
    port_open,
)
from deploy.triton.repository import MODEL_NAMES, materialize_repository

TRITON_VENV = Path(os.environ.get("DOCMARKUP_TRITON_VENV", PROJECT_ROOT / ".venv-triton"))
TRITON_VAR = VAR_DIR / "triton"
DEFAULT_SERVICE_NAME = "triton"
DEFAULT_MODEL_URI = "models:/docmarkup@champion"
# Loading torch + the model in the stub takes ~10-30 s on a busy 2-core machine.
STARTUP_TIMEOUT_S = 300.0
# How long the server waits for in-flight requests when asked to stop.
EXIT_TIMEOUT_S = 10
SHM_DEFAULT_BYTES = 8 * 1024 * 1024
SHM_GROWTH_BYTES = 8 * 1024 * 1024
ADMIN_HEADER = "docmarkup-admin-key"
# Triton API groups that change the server or write files; each needs the admin header.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")


@dataclass(frozen=True)
class TritonPorts:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> TritonPorts:
        """Three ports nothing listens on now (for tests and side-by-side servers)."""
        ports: set[int] = set()
        while len(ports) < 3:
            ports.add(free_port())
        http, grpc, metrics = sorted(ports)
        return cls(http=http, grpc=grpc, metrics=metrics)

    def as_tuple(self) -> tuple[int, int, int]:
        return self.http, self.grpc, self.metrics


@dataclass(frozen=True)
class TritonDistribution:
    """The server binary, libraries, Python backend and stubs shipped in the PyTriton wheel."""

    site_packages: Path

    @property
    def root(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver"

    @property
    def server_binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.site_packages / "nvidia_pytriton.libs"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    @property
    def caches(self) -> Path:
        return self.root / "caches"

    def stub(self, python_version: str) -> Path:
        stub = self.root / "python_backend_stubs" / python_version / "triton_python_backend_stub"
        if not stub.exists():
            available = sorted(p.name for p in (self.root / "python_backend_stubs").iterdir())
            raise ServiceError(f"the PyTriton wheel has no Python backend stub for Python {python_version} (it has {available})")
        return stub

    def numpy_entries(self) -> list[Path]:
        """NumPy 1.x as installed next to PyTriton (package, bundled libs, dist-info)."""
        entries = [self.site_packages / "numpy", self.site_packages / "numpy.libs"]
        entries += sorted(self.site_packages.glob("numpy-*.dist-info"))
        if not entries[0].is_dir() or len(entries) < 3:
            raise ServiceError(f"no NumPy found in {self.site_packages}; reinstall with ./run setup")
        major = entries[2].name.removeprefix("numpy-").split(".")[0]
        if major != "1":
            raise ServiceError(f"{entries[2].name} in {self.site_packages}: the Triton Python backend stub needs NumPy 1.x")
        return [entry for entry in entries if entry.exists()]

    @classmethod
    def locate(cls, venv: Path = TRITON_VENV) -> TritonDistribution:
        candidates = sorted(venv.glob("lib/python3*/site-packages/pytriton/tritonserver/bin/tritonserver"))
        if not candidates:
            raise ServiceError(
                f"no tritonserver binary under {venv} (expected the nvidia-pytriton wheel there); run ./run setup"
            )
        return cls(site_packages=candidates[0].parents[3])


@dataclass(frozen=True)
class TritonRuntime:
    """What the server needs on disk and in its environment to run our Python models."""

    backend_directory: Path
    stub_environment: Path
    library_path: tuple[Path, ...]
    cache_directory: Path


def _link(target: Path, link: Path) -> None:
    """(Re)point ``link`` at ``target`` atomically, so concurrent preparers never see a gap."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    temporary = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    temporary.symlink_to(target)
    os.replace(temporary, link)


def prepare_runtime(
    distribution: TritonDistribution | None = None, runtime_dir: Path | None = None
) -> TritonRuntime:
    """Lay out the backend directory and the stub environment for the running project interpreter.

    Must be called from the project's virtualenv: the stub environment reuses *this*
    interpreter's base installation and site-packages.
    """
    distribution = distribution or TritonDistribution.locate()
    runtime_dir = runtime_dir or TRITON_VAR / "runtime"
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"

    backend_dir = runtime_dir / "backends"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _link(distribution.python_backend / name, backend_dir / "python" / name)
    _link(distribution.stub(python_version), backend_dir / "python" / "triton_python_backend_stub")

    stub_env = runtime_dir / "stub-env"
    base_python = Path(sys.base_prefix) / "bin" / f"python{python_version}"
    if not base_python.exists():
        raise ServiceError(f"base interpreter {base_python} of {sys.prefix} not found")
    _link(base_python, stub_env / "bin" / "python3")
    (stub_env / "pyvenv.cfg").write_text(
        f"home = {base_python.parent}\ninclude-system-site-packages = false\nversion = {sys.version.split()[0]}\n"
    )
    stub_site = stub_env / "lib" / f"python{python_version}" / "site-packages"
    for entry in distribution.numpy_entries():
        _link(entry, stub_site / entry.name)
    project_site = sysconfig.get_paths()["purelib"]
    # Lines starting with "import" in a .pth run at start-up: addsitedir also runs the project
    # venv's own .pth files (the editable install of components/, models/, deploy/).
    (stub_site / "docmarkup_project.pth").write_text(f"import site; site.addsitedir({project_site!r})\n")

    library_path = [distribution.libs]
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME") or ""
    if libdir and soname.endswith(".so.1.0") and (Path(libdir) / soname).exists():
        library_path.append(Path(libdir))
    return TritonRuntime(
        backend_directory=backend_dir,
        stub_environment=stub_env,
        library_path=tuple(library_path),
        cache_directory=distribution.caches,
    )


def admin_key(name: str) -> str:
    """The key of the named server's restricted APIs (random, 0600 file, made on first use)."""
    return load_or_create_secret(VAR_DIR / "services" / name / "admin.key")


def probe_key_file(name: str) -> Path:
    """The 0600 file of the named server's probe key (made on first use): requests carrying the key
    are the platform's own (deploy checks, smoke tests) and leave no trace in production records."""
    path = VAR_DIR / "services" / name / "probe.key"
    load_or_create_secret(path)
    return path


def probe_key(name: str) -> str:
    return load_or_create_secret(probe_key_file(name))


def shm_prefix(name: str) -> str:
    """Per-service prefix of the Python backend's shared-memory regions (service names are unique)."""
    return f"docmarkup-{name}-"


def triton_command(
    model_repository: Path,
    ports: TritonPorts,
    *,
    distribution: TritonDistribution,
    runtime: TritonRuntime,
    shm_region_prefix: str,
    admin_key: str,
    log_verbose: int = 0,
) -> list[str]:
    """The tritonserver command line (all endpoints on 127.0.0.1, CPU only, models loaded at start,
    admin APIs behind ``admin_key``)."""
    restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={admin_key}"
    return [
        str(distribution.server_binary),
        f"--model-repository={model_repository}",
        f"--backend-directory={runtime.backend_directory}",
        f"--cache-directory={runtime.cache_directory}",
        # explicit + "*" loads every model now and still allows reloading one later through the
        # repository API (e.g. after the champion alias moved).
        "--model-control-mode=explicit",
        "--load-model=*",
        f"--http-restricted-api={restricted}",
        f"--grpc-restricted-protocol={restricted}",
        "--strict-readiness=true",
        "--exit-on-error=true",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        f"--http-address={LOOPBACK}",
        f"--http-port={ports.http}",
        f"--grpc-address={LOOPBACK}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-address={LOOPBACK}",
        f"--metrics-port={ports.metrics}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--allow-cpu-metrics=true",
        "--metrics-interval-ms=1000",
        "--pinned-memory-pool-byte-size=0",
        f"--backend-config=python,shm-region-prefix-name={shm_region_prefix}",
        f"--backend-config=python,shm-default-byte-size={SHM_DEFAULT_BYTES}",
        f"--backend-config=python,shm-growth-byte-size={SHM_GROWTH_BYTES}",
        f"--log-verbose={log_verbose}",
    ]


def triton_environment(runtime: TritonRuntime, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment additions for the server and, through it, the Python backend stubs."""
    library_path = [str(p) for p in runtime.library_path]
    if os.environ.get("LD_LIBRARY_PATH"):
        library_path.append(os.environ["LD_LIBRARY_PATH"])
    env = {
        "LD_LIBRARY_PATH": ":".join(library_path),
        "PATH": f"{runtime.stub_environment / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MLFLOW_ENABLE_TELEMETRY": "false",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "DOCMARKUP_VAR": str(VAR_DIR),
    }
    env.update(extra or {})
    return env


def ready(ports: TritonPorts, timeout: float = 2.0) -> bool:
    """True when the server answers and every model in the repository is loaded."""
    try:
        return requests.get(f"http://{LOOPBACK}:{ports.http}/v2/health/ready", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


@dataclass
class TritonServer:
    """A tritonserver process serving one model repository."""

    name: str
    ports: TritonPorts
    model_repository: Path
    service: ManagedService
    shm_region_prefix: str
    startup_seconds: float | None = field(default=None, init=False)
    deploy_mode: str | None = field(default=None, init=False)  # "started" or "reloaded", set by the deploy

    @property
    def http_url(self) -> str:
        return f"{LOOPBACK}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{LOOPBACK}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.metrics}/metrics"

    @property
    def probe_key(self) -> str:
        """What the platform's own requests carry in ``PROBE`` (see :func:`probe_key_file`)."""
        return probe_key(self.name)

    def admin_headers(self, protocol: str = "http") -> dict[str, str]:
        """Headers that open the restricted (model control, shared memory, trace, logging) APIs;
        Triton's gRPC frontend expects the header name prefixed with ``triton-grpc-protocol-``."""
        header = ADMIN_HEADER if protocol == "http" else f"triton-grpc-protocol-{ADMIN_HEADER}"
        return {header: admin_key(self.name)}

    def ready(self) -> bool:
        return ready(self.ports)

    def start(self) -> TritonServer:
        if not self.service.running():
            busy = [port for port in self.ports.as_tuple() if port_open(port)]
            if busy:
                raise ServiceError(f"ports {busy} on {LOOPBACK} are already in use; pick other ports for {self.name}")
        started = time.monotonic()
        try:
            self.service.start()
        except ServiceError as exc:
            failures = load_failures(self.service.log_file)
            remove_shared_memory(self.shm_region_prefix)
            if failures:
                raise ServiceError(f"{self.name} could not load its models:\n" + "\n".join(failures)) from exc
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def stop(self) -> bool:
        """Ask the server to unload its models (our ``finalize`` runs), then stop the group by PID."""
        pid = self.service.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + EXIT_TIMEOUT_S + 10
            while time.monotonic() < deadline and self.service.pid() is not None:
                time.sleep(0.2)
        stopped = self.service.stop()
        remove_shared_memory(self.shm_region_prefix)
        return stopped or pid is not None

    def reload_models(self, models: tuple[str, ...] | None = None, timeout_s: float = 300.0) -> None:
        """Reload models in place (new weights are loaded before the old ones go), e.g. after the
        champion alias moved: ``models:/...@champion`` is resolved again at load time."""

        client = httpclient.InferenceServerClient(self.http_url, network_timeout=timeout_s)
        try:
            for model in models or MODEL_NAMES:
                client.load_model(model, headers=self.admin_headers())
        except InferenceServerException as exc:
            raise ServiceError(f"reloading {models or MODEL_NAMES} failed: {exc.message()}\n{self.tail_log(20)}") from exc
        finally:
            client.close()

    def metrics_text(self, timeout: float = 5.0) -> str:
        response = requests.get(self.metrics_url, timeout=timeout)
        response.raise_for_status()
        return response.text

    def tail_log(self, lines: int = 40) -> str:
        return self.service.tail_log(lines)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


_LOAD_FAILURE = re.compile(r'failed to load \'(?P<model>[^\']+)\' version (?P<version>\d+): (?P<reason>.*?)(?:\\n|"$)')


def load_failures(log_file: Path) -> list[str]:
    """``model vN: reason`` for every model that failed to load in the server's latest start."""
    try:
        text = log_file.read_text(errors="replace")
    except FileNotFoundError:
        return []
    latest = text.rsplit("\n--- start ", 1)[-1]
    return [f"{m['model']} v{m['version']}: {m['reason']}" for m in _LOAD_FAILURE.finditer(latest)]


def remove_shared_memory(prefix: str, shm_dir: Path = Path("/dev/shm")) -> list[Path]:
    """Remove Python-backend shared-memory regions a stopped (or crashed) server left behind."""
    if not prefix.startswith("docmarkup-"):
        raise ValueError(f"refusing to remove shared memory with foreign prefix {prefix!r}")
    removed = []
    for region in shm_dir.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            region.unlink()
            removed.append(region)
    return removed


def triton_server(
    model_repository: str | os.PathLike,
    *,
    ports: TritonPorts | None = None,
    name: str = DEFAULT_SERVICE_NAME,
    env: Mapping[str, str] | None = None,
    log_verbose: int = 0,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> TritonServer:
    """A (not yet started) :class:`TritonServer` for an existing model repository."""
    ports = ports or TritonPorts()
    distribution = TritonDistribution.locate()
    runtime = prepare_runtime(distribution)
    repository = Path(model_repository).resolve()
    if not repository.is_dir():
        raise ServiceError(f"model repository {repository} does not exist")
    prefix = shm_prefix(name)
    key = admin_key(name)
    service = ManagedService(
        name=name,
        command=triton_command(
            repository, ports, distribution=distribution, runtime=runtime, shm_region_prefix=prefix, admin_key=key,
            log_verbose=log_verbose,
        ),
        secrets=(key,),
        health=lambda: ready(ports),
        env=triton_environment(runtime, env),
        cwd=PROJECT_ROOT,
        startup_timeout_s=startup_timeout_s,
        url=f"http {LOOPBACK}:{ports.http}  grpc {LOOPBACK}:{ports.grpc}  metrics http://{LOOPBACK}:{ports.metrics}/metrics",
    )
    return TritonServer(name=name, ports=ports, model_repository=repository, service=service, shm_region_prefix=prefix)


def start_triton(
    model_uri: str = DEFAULT_MODEL_URI,
    *,
    ports: TritonPorts | None = None,
    name: str = DEFAULT_SERVICE_NAME,
    tracking_uri: str | None = None,
    repository_dir: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    **repository_options,
) -> TritonServer:
    """Write a model repository serving ``model_uri`` (MLflow URI or local folder) and start Triton on it.

    ``tracking_uri`` (default: ``MLFLOW_TRACKING_URI``) is where ``models:/`` URIs resolve.
    Extra keyword arguments go to :func:`deploy.triton.repository.materialize_repository`.
    """

    running = ManagedService(name=name, command=[], health=lambda: False).pid()
    if running is not None:
        raise ServiceError(f"{name} is already running (pid {running}); stop it first or pick another name")
    repository = materialize_repository(
        model_uri,
        Path(repository_dir) if repository_dir else TRITON_VAR / name / "model_repository",
        tracking_uri=tracking_uri,
        **({"probe_key_file": probe_key_file(name)} | repository_options),
    )
    server_env = dict(env or {})
    tracking = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if tracking:
        server_env["MLFLOW_TRACKING_URI"] = tracking
    server = triton_server(repository, ports=ports, name=name, env=server_env, startup_timeout_s=startup_timeout_s)
    return server.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start, stop or inspect the docmarkup Triton server (CPU, 127.0.0.1).")
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--model-uri", default=DEFAULT_MODEL_URI, help="models:/name@alias, models:/name/version or a folder")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    parser.add_argument("--name", default=DEFAULT_SERVICE_NAME)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="concurrent requests decoded together per model (0: no batching)")
    parser.add_argument("--max-queue-size", type=int, default=32,
                        help="requests that may wait per model before the next is refused (0: unbounded)")
    args = parser.parse_args(argv)
    ports = TritonPorts(args.http_port, args.grpc_port, args.metrics_port)
    repository = TRITON_VAR / args.name / "model_repository"
    if args.action == "start":
        server = start_triton(args.model_uri, ports=ports, name=args.name, tracking_uri=args.tracking_uri,
                              max_batch_size=args.max_batch_size, max_queue_size=args.max_queue_size)
        print(f"triton ready in {server.startup_seconds:.1f}s: http {server.http_url}, grpc {server.grpc_url}, "
              f"metrics {server.metrics_url} (pid {server.service.pid()})")
        return 0
    repository.mkdir(parents=True, exist_ok=True)
    server = triton_server(repository, ports=ports, name=args.name)
    if args.action == "stop":
        print("stopped" if server.stop() else "not running")
        return 0
    pid = server.service.pid()
    print(f"{args.name}: {'running pid ' + str(pid) if pid else 'not running'}; ready={server.ready()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
