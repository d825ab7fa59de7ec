"""Dataset versions with DVC: one tracked ``data/`` folder, a local remote, cheap version lookups.

``data/`` holds every dataset the curation loop produces (raw pages, pre-annotations,
corrections, hard examples, splits). :meth:`DataVersioner.commit` runs ``dvc add data``, which
writes ``data.dvc`` at the repository root with the md5 of the whole folder, and pushes the
content to the default remote (``var/dvc-remote`` unless configured). That md5 *is* the data
version: every flow records :meth:`DataVersioner.current_version` (it only reads ``data.dvc``
and asks git for HEAD, a few milliseconds) in its MLflow run, and :meth:`checkout` restores any
recorded version byte for byte, from the cache or, if needed, from the remote.

Versions are also listed in ``.dvc/data-versions.jsonl`` (md5, size, message, time), so a
version can be restored without git, e.g. in a ``--no-scm`` repository. Uses DVC's Python API
(``dvc.repo.Repo``); analytics are off (``DVC_NO_ANALYTICS=1`` and ``core.analytics false``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

from components.data.page_store import DERIVED_PATTERNS
from components.data.pages import atomic_write_text

os.environ.setdefault("DVC_NO_ANALYTICS", "1")

logger = logging.getLogger(__name__)

REMOTE_NAME = "local"
VERSIONS_LOG = Path(".dvc") / "data-versions.jsonl"


class DataVersionError(RuntimeError):
    """A DVC operation failed; the message says which and what to do."""


@dataclass(frozen=True)
class DataVersion:
    """One version of the tracked data folder, as recorded in ``<data>.dvc``."""

    md5: str  # DVC's directory hash, "<md5>.dir"
    files: int
    size: int  # bytes
    path: str  # the tracked folder, relative to the repository root
    git_revision: str | None = None  # HEAD of the enclosing git repository, if any
    dvc_file_committed: bool | None = None  # is this .dvc file, as it is now, the one in HEAD?

    @property
    def short(self) -> str:
        return self.md5.removesuffix(".dir")[:12]

    def as_tags(self, prefix: str = "data.") -> dict[str, str]:
        """Flat string tags/params for an MLflow run."""
        tags = {f"{prefix}md5": self.md5, f"{prefix}files": str(self.files), f"{prefix}size": str(self.size),
                f"{prefix}path": self.path}
        if self.git_revision:
            tags[f"{prefix}git_revision"] = self.git_revision
        if self.dvc_file_committed is not None:
            tags[f"{prefix}dvc_file_committed"] = str(self.dvc_file_committed).lower()
        return tags

    def to_json(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def _quiet_dvc() -> Iterator[None]:
    """DVC logs git hints ("To track the changes with git, run ...") at INFO; keep warnings only."""
    dvc_logger = logging.getLogger("dvc")
    level = dvc_logger.level
    dvc_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        dvc_logger.setLevel(level)


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)


class DataVersioner:
    """Version ``<repo_root>/<data_dir>`` with DVC and a local default remote."""

    def __init__(self, repo_root: str | os.PathLike, data_dir: str = "data", remote_dir: str | os.PathLike | None = None,
                 remote_name: str = REMOTE_NAME):
        self.root = Path(repo_root).resolve()
        if Path(data_dir).is_absolute() or ".." in Path(data_dir).parts:
            raise ValueError(f"data_dir must be a folder inside the repository, relative to it; got {data_dir!r}")
        self.data_dir = Path(data_dir)
        self.remote_dir = Path(remote_dir).resolve() if remote_dir else self.root / "var" / "dvc-remote"
        self.remote_name = remote_name

    # -- paths ------------------------------------------------------------------------------
    @property
    def data_path(self) -> Path:
        return self.root / self.data_dir

    @property
    def dvc_file(self) -> Path:
        return self.root / f"{self.data_dir}.dvc"

    @property
    def versions_log(self) -> Path:
        return self.root / VERSIONS_LOG

    # -- git --------------------------------------------------------------------------------
    def _git_toplevel(self) -> Path | None:
        try:
            result = _git(self.root, "rev-parse", "--show-toplevel")
        except FileNotFoundError:
            return None
        return Path(result.stdout.strip()).resolve() if result.returncode == 0 else None

    def git_revision(self) -> str | None:
        try:
            result = _git(self.root, "rev-parse", "--verify", "--quiet", "HEAD")
        except FileNotFoundError:
            return None
        if result.returncode != 0:
            return None
        return result.stdout.strip() or None

    def _dvc_file_committed(self) -> bool | None:
        if self.git_revision() is None:
            return None
        relative = self.dvc_file.relative_to(self._git_toplevel() or self.root)
        result = _git(self.root, "status", "--porcelain", "--", str(relative))
        return result.returncode == 0 and not result.stdout.strip()

    # -- DVC --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _repo(self):
        # deferred: DVC takes seconds to import; only versioning needs it
        from dvc.exceptions import DvcException, NotDvcRepoError
        from dvc.repo import Repo

        try:
            with _quiet_dvc(), Repo(str(self.root)) as repo:
                yield repo
        except NotDvcRepoError as exc:
            raise DataVersionError(f"{self.root} is not a DVC repository; call ensure_initialized() first") from exc
        except DvcException as exc:
            raise DataVersionError(f"DVC failed in {self.root}: {exc}") from exc

    def ensure_initialized(self) -> None:
        """``dvc init`` (``--no-scm`` outside git, ``--subdir`` below a git root) and a default local remote.

        Idempotent. In a git repository DVC stages its own files (``.dvc/``, ``.dvcignore``).
        """
        # deferred: DVC takes seconds to import; only versioning needs it
        from dvc.exceptions import DvcException
        from dvc.repo import Repo

        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.root / ".dvc").is_dir():
            toplevel = self._git_toplevel()
            try:
                with _quiet_dvc():
                    Repo.init(str(self.root), no_scm=toplevel is None, subdir=toplevel is not None and toplevel != self.root).close()
            except DvcException as exc:
                raise DataVersionError(f"dvc init failed in {self.root}: {exc}") from exc
        with self._repo() as repo, repo.config.edit() as config:
            config["core"]["analytics"] = False
            # Relative to .dvc/ (DVC resolves it from the config file) when inside the repository,
            # so a committed .dvc/config works in any clone, wherever it lives.
            # (DVC reads a relative value against the current directory and stores it relative to .dvc/.)
            inside = self.remote_dir.is_relative_to(self.root)
            url = os.path.relpath(self.remote_dir) if inside else str(self.remote_dir)
            config["remote"].setdefault(self.remote_name, {})["url"] = url
            config["core"]["remote"] = self.remote_name
        self.remote_dir.mkdir(parents=True, exist_ok=True)
        self._ignore_derived_files()

    def _ignore_derived_files(self) -> None:
        """Keep the page stores' derived files (id index, lock, trash) out of every version."""

        path = self.root / ".dvcignore"
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        missing = [pattern for pattern in DERIVED_PATTERNS if pattern not in text.splitlines()]
        if missing:
            prefix = "" if not text or text.endswith("\n") else "\n"
            atomic_write_text(path, text + prefix + "# page-store files derived from the shards\n" + "\n".join(missing) + "\n")

    def current_version(self) -> DataVersion | None:
        """The version ``<data>.dvc`` records (None before the first commit). Reads files only."""
        if not self.dvc_file.exists():
            return None
        try:
            record = yaml.safe_load(self.dvc_file.read_text(encoding="utf-8"))
            out = record["outs"][0]
            return DataVersion(md5=out["md5"], files=int(out.get("nfiles", 0)), size=int(out.get("size", 0)),
                               path=str(out.get("path", self.data_dir)), git_revision=self.git_revision(),
                               dvc_file_committed=self._dvc_file_committed())
        except (yaml.YAMLError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise DataVersionError(f"{self.dvc_file} is not a readable DVC file: {exc}") from exc

    def is_dirty(self) -> bool:
        """Does the data folder differ from the recorded version (uncommitted changes)?"""
        if not self.dvc_file.exists():
            return self.data_path.exists() and any(self.data_path.iterdir())
        with self._repo() as repo:
            # workspace_status, not status: a missing cache ("not in cache") would mask real edits.
            outs = [out for stage in repo.stage.collect(str(self.dvc_file)) for out in stage.outs]
            return any(status in ("modified", "new") for out in outs for status in out.workspace_status().values())

    def commit(self, message: str = "", push: bool = True) -> DataVersion:
        """``dvc add <data>`` + ``dvc push``; returns the (possibly unchanged) version."""
        if not self.data_path.is_dir():
            raise DataVersionError(f"nothing to version: {self.data_path} does not exist")
        self.ensure_initialized()
        before = self.current_version()
        with self._repo() as repo:
            try:
                repo.add(str(self.data_path))
            except Exception as exc:
                hint = ""
                if "already tracked by SCM" in str(exc):
                    hint = f" (git tracks {self.data_dir}/: `git rm -r --cached {self.data_dir}` hands it over to DVC)"
                raise DataVersionError(f"dvc add {self.data_dir} failed: {exc}{hint}") from exc
            if push:
                repo.push(targets=[str(self.dvc_file)], remote=self.remote_name)
        version = self.current_version()
        assert version is not None
        if before is None or before.md5 != version.md5 or not self._logged(version.md5):
            self._log(version, message)
        return version

    def push(self) -> int:
        """Upload the current version's objects to the remote; returns how many were sent."""
        with self._repo() as repo:
            return int(repo.push(targets=[str(self.dvc_file)], remote=self.remote_name) or 0)

    def pull(self, *, force: bool = False) -> DataVersion:
        """Restore the version ``<data>.dvc`` records, fetching from the remote what the cache lacks.

        Like :meth:`checkout`, refuses to overwrite uncommitted changes unless ``force``.
        """
        version = self.current_version()
        if version is None:
            raise DataVersionError(f"no {self.dvc_file.name}: nothing has been committed yet")
        return self.checkout(version, force=force)

    def checkout(self, version: DataVersion | str, *, force: bool = False) -> DataVersion:
        """Restore the data folder to ``version`` (a DataVersion or its md5) exactly.

        Refuses when the folder has uncommitted changes (they would be lost) unless ``force``.
        Objects missing from the cache are fetched from the remote.
        """
        md5 = version.md5 if isinstance(version, DataVersion) else str(version)
        if not md5.endswith(".dir"):
            md5 += ".dir"
        entry = self._lookup(md5)
        current = self.current_version()
        if not force and self.is_dirty():
            raise DataVersionError(
                f"{self.data_path} has changes not committed to DVC; commit() them or pass force=True to discard them"
            )
        previous_dvc_file = self.dvc_file.read_text(encoding="utf-8") if self.dvc_file.exists() else None
        if current is None or current.md5 != md5:
            files = entry.get("files") if entry else (version.files if isinstance(version, DataVersion) else None)
            size = entry.get("size") if entry else (version.size if isinstance(version, DataVersion) else None)
            self._write_dvc_file(md5, files, size)
        try:
            with self._repo() as repo:
                # Make sure every object is in the cache *before* touching the workspace: a checkout
                # of a version whose objects are missing would delete the files that are there.
                if self._missing_from_cache(repo):
                    logger.info("version %s is not fully in the cache; fetching from %s", md5, self.remote_dir)
                    with contextlib.suppress(Exception):  # judged by the check below
                        repo.fetch(targets=[str(self.dvc_file)], remote=self.remote_name)
                    if self._missing_from_cache(repo):
                        raise DataVersionError(f"cannot restore version {md5}: not in the cache nor in remote {self.remote_dir}")
                repo.checkout(targets=[str(self.dvc_file)], force=True)
        except Exception:
            if previous_dvc_file is not None:  # keep pointing at the data that is really there
                atomic_write_text(self.dvc_file, previous_dvc_file)
            raise
        restored = self.current_version()
        assert restored is not None
        return restored

    def versions(self) -> list[dict]:
        """Committed versions, oldest first (from ``.dvc/data-versions.jsonl``)."""
        if not self.versions_log.exists():
            return []
        return [json.loads(line) for line in self.versions_log.read_text(encoding="utf-8").splitlines() if line.strip()]

    # -- helpers ----------------------------------------------------------------------------
    def _missing_from_cache(self, repo) -> bool:
        outs = [out for stage in repo.stage.collect(str(self.dvc_file)) for out in stage.outs]
        return any(out.changed_cache() for out in outs)

    def _lookup(self, md5: str) -> dict | None:
        for entry in reversed(self.versions()):
            if entry["md5"] == md5:
                return entry
        return None

    def _logged(self, md5: str) -> bool:
        return self._lookup(md5) is not None

    def _log(self, version: DataVersion, message: str) -> None:
        entry = {"md5": version.md5, "files": version.files, "size": version.size, "path": version.path,
                 "message": message, "committed_at": datetime.now(UTC).isoformat(timespec="seconds"),
                 "git_revision": version.git_revision}
        self.versions_log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.versions_log, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def _write_dvc_file(self, md5: str, files: int | None, size: int | None) -> None:
        out: dict = {"md5": md5}
        if size is not None:
            out["size"] = int(size)
        if files is not None:
            out["nfiles"] = int(files)
        out.update({"hash": "md5", "path": self.data_dir.name})  # relative to the .dvc file's folder
        atomic_write_text(self.dvc_file, yaml.safe_dump({"outs": [out]}, sort_keys=False))

