"""Resolve what a deployment serves: an MLflow registry alias/version, a run artifact, or a folder.

The server is pointed at ``models:/docmarkup@champion``; promoting another version moves the
alias, and reloading the Triton model picks it up. Aliases are resolved to a concrete version
first, so the served version is known (and reported), and each version is downloaded once into
``var/triton/model_cache/<store>/<name>/v<version>`` (``<store>`` tells tracking servers apart),
even when both Triton models load at the same time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from components.services.process import VAR_DIR

DEFAULT_CACHE = VAR_DIR / "triton" / "model_cache"
# The project's registry store when nothing else is said (as components.registry.mlflow_registry).
DEFAULT_STORE = VAR_DIR / "mlflow" / "mlflow.db"
_REGISTRY_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))/?$")
_COMPLETE = ".complete"


class ModelSourceError(RuntimeError):
    """The model URI cannot be resolved or its artifacts hold no model folder."""


@dataclass(frozen=True)
class ResolvedModel:
    """A local model folder and where it came from."""

    path: Path
    uri: str
    registered_name: str | None = None
    version: str | None = None
    alias: str | None = None
    run_id: str | None = None

    def describe(self) -> dict[str, str | None]:
        return {"uri": self.uri, "registered_name": self.registered_name, "version": self.version,
                "alias": self.alias, "run_id": self.run_id, "path": str(self.path)}


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_STORE}"


def find_model_folder(root: Path) -> Path:
    """The folder holding ``config.json``: ``root`` itself or its shallowest sub-folder that has one."""
    if (root / "config.json").exists():
        return root
    candidates = sorted(root.rglob("config.json"), key=lambda p: (len(p.parts), str(p)))
    if not candidates:
        raise ModelSourceError(f"no model folder (config.json) in the artifacts downloaded to {root}")
    return candidates[0].parent


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_once(artifact_uri: str, destination: Path, tracking_uri: str) -> Path:
    """Download ``artifact_uri`` into ``destination`` unless a complete copy is already there."""
    # deferred: MLflow takes seconds to import; only a tracked run or a registry source needs it
    from mlflow.artifacts import download_artifacts

    with _exclusive(destination.with_name(destination.name + ".lock")):
        if (destination / _COMPLETE).exists():
            return destination
        shutil.rmtree(destination, ignore_errors=True)
        destination.mkdir(parents=True)
        download_artifacts(artifact_uri=artifact_uri, dst_path=str(destination), tracking_uri=tracking_uri)
        (destination / _COMPLETE).write_text(artifact_uri)
    return destination


def expected_model(model_uri: str, tracking_uri: str | None = None) -> dict[str, str | None]:
    """What a server pointed at ``model_uri`` must report serving, resolved now without downloading:
    ``{"registered_name", "version"}`` for a registry URI (the alias's current version), else
    ``{"uri"}`` for a run artifact or folder."""
    uri = model_uri.strip()
    registry = _REGISTRY_URI.match(uri)
    if registry is None:
        return {"uri": uri}
    # deferred: MLflow takes seconds to import; only a tracked run or a registry source needs it
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    tracking = tracking_uri or default_tracking_uri()
    client = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
    name, alias = registry.group("name"), registry.group("alias")
    try:
        version = client.get_model_version_by_alias(name, alias).version if alias else registry.group("version")
    except MlflowException as exc:
        raise ModelSourceError(f"cannot resolve {uri} against MLflow at {tracking}: {exc.message}") from exc
    return {"registered_name": name, "version": str(version)}


def resolve_model(model_uri: str, tracking_uri: str | None = None, cache_dir: Path | None = None) -> ResolvedModel:
    """A local folder for ``model_uri`` (``models:/name@alias``, ``models:/name/N``, ``runs:/...``, or a path)."""
    uri = model_uri.strip()
    if not uri:
        raise ModelSourceError("empty model_uri")
    cache = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    registry = _REGISTRY_URI.match(uri)
    if registry is None and not uri.startswith("runs:/"):
        folder = Path(uri.removeprefix("file://")).expanduser()
        if not folder.is_dir():
            raise ModelSourceError(f"model folder {folder} does not exist (and {uri!r} is no MLflow models:/ or runs:/ URI)")
        return ResolvedModel(path=find_model_folder(folder), uri=uri)

    tracking = tracking_uri or default_tracking_uri()
    if tracking.startswith("sqlite:///") and not Path(tracking.removeprefix("sqlite:///")).exists():
        # MLflow would silently create an empty store (and two models loading at once race on it).
        raise ModelSourceError(f"MLflow store {tracking} does not exist; cannot resolve {uri}")
    cache = cache / hashlib.sha256(tracking.encode()).hexdigest()[:12]
    # One resolver at a time per store: both Triton models load concurrently.
    with _exclusive(cache / "resolve.lock"):
        return _resolve_registered(uri, registry, tracking, cache)


def _resolve_registered(uri: str, registry: re.Match[str] | None, tracking: str, cache: Path) -> ResolvedModel:
    # deferred: MLflow takes seconds to import; only a tracked run or a registry source needs it
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
    try:
        if registry is None:  # runs:/<run_id>/<path>
            run_id = uri.removeprefix("runs:/").split("/", 1)[0]
            local = _download_once(uri, cache / "runs" / re.sub(r"[^\w.-]", "_", uri.removeprefix("runs:/")), tracking)
            return ResolvedModel(path=find_model_folder(local), uri=uri, run_id=run_id)
        name, alias = registry.group("name"), registry.group("alias")
        version = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(
            name, registry.group("version")
        )
        download_uri = client.get_model_version_download_uri(name, version.version)
        local = _download_once(download_uri, cache / name / f"v{version.version}", tracking)
    except MlflowException as exc:
        raise ModelSourceError(f"cannot resolve {uri} against MLflow at {tracking}: {exc.message}") from exc
    return ResolvedModel(
        path=find_model_folder(local), uri=uri, registered_name=name, version=str(version.version),
        alias=alias, run_id=version.run_id,
    )
