"""Start, health-check and stop local services (Label Studio, Triton, MLflow) by PID.

Every service the project needs is launched by this module, bound to 127.0.0.1, with its
PID, log and state under ``var/services/<name>/``. Stopping signals the service's whole
process group (services spawn workers), first politely, then for good.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

PROJECT_ROOT = Path(__file__).resolve().parents[2]
VAR_DIR = Path(os.environ.get("DOCMARKUP_VAR", PROJECT_ROOT / "var"))
LOOPBACK = "127.0.0.1"


class ServiceError(RuntimeError):
    """A service could not be started, did not become healthy, or is not running."""


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

    @property
    def state_dir(self) -> Path:
        return VAR_DIR / "services" / self.name

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "pid"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "service.log"

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
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_file, "ab") as log:
            log.write(f"\n--- start {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.command)}\n".encode())
            log.flush()
            process = subprocess.Popen(
                list(self.command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.cwd, env=env, start_new_session=True,
            )
        self.pid_file.write_text(str(process.pid))
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited with code {process.returncode} during start-up; last log lines:\n{self.tail_log()}"
                )
            if self.health():
                return process.pid
            time.sleep(0.5)
        self.stop()
        raise ServiceError(f"{self.name} was not healthy after {self.startup_timeout_s:.0f}s; last log lines:\n{self.tail_log()}")

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
