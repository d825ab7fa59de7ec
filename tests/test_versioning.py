"""DVC data versions in throwaway repositories (never the project's own): commit, restore, remote."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from components.data.page_store import PageDataset
from components.data.synthetic import generate_dataset
from components.data.versioning import DataVersioner, DataVersionError

GIT = ["git", "-c", "user.email=test@example.com", "-c", "user.name=test", "-c", "commit.gpgsign=false"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    """The versioned bytes (a page store's derived id index and lock are rebuilt, not versioned)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith((".id-index.sqlite", ".lock"))}


@pytest.fixture
def git_repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run([*GIT, "init", "-q"], cwd=root, check=True)
    subprocess.run([*GIT, "commit", "-q", "--allow-empty", "-m", "init"], cwd=root, check=True)
    return root


def test_commit_change_and_restore_exact_bytes(git_repo, tmp_path):
    versioner = DataVersioner(git_repo, remote_dir=tmp_path / "remote")
    assert versioner.root != Path(__file__).resolve().parents[1]  # never the project repository
    versioner.ensure_initialized()
    versioner.ensure_initialized()  # idempotent
    assert versioner.current_version() is None

    data = git_repo / "data"
    generate_dataset(data / "raw", 3, seed=0)
    v1 = versioner.commit("three raw pages")
    assert (git_repo / "data.dvc").exists() and v1.md5.endswith(".dir") and v1.files == 5  # 3 images + shard + index
    assert v1.git_revision is not None and len(v1.git_revision) == 40 and v1.dvc_file_committed is False
    assert v1.size == sum(len(b) for b in _snapshot(data).values())
    snapshot_v1 = _snapshot(data)

    same = versioner.commit("nothing changed")
    assert same.md5 == v1.md5 and len(versioner.versions()) == 1

    raw = PageDataset(data / "raw")
    changed = raw.pages()[0]
    changed.meta["consistency"] = 0.5
    raw.upsert([changed])
    generate_dataset(data / "hard", 1, seed=9)
    assert versioner.is_dirty()
    v2 = versioner.commit("corrections and hard examples")
    assert v2.md5 != v1.md5 and v2.files == 9 and not versioner.is_dirty()
    snapshot_v2 = _snapshot(data)
    assert [v["message"] for v in versioner.versions()] == ["three raw pages", "corrections and hard examples"]
    assert versioner.current_version().md5 == v2.md5

    restored = versioner.checkout(v1)
    assert restored.md5 == v1.md5 and _snapshot(data) == snapshot_v1  # the added folder is gone too
    versioner.checkout(v2.md5.removesuffix(".dir"))  # by md5 string, with or without ".dir"
    assert _snapshot(data) == snapshot_v2
    with pytest.raises(DataVersionError, match="not in the cache nor in remote"):
        versioner.checkout("0123456789abcdef0123456789abcdef")
    assert versioner.current_version().md5 == v2.md5 and _snapshot(data) == snapshot_v2
    assert v2.as_tags()["data.md5"] == v2.md5 and v2.as_tags()["data.files"] == "9"


def test_checkout_refuses_to_drop_uncommitted_changes(git_repo, tmp_path):
    versioner = DataVersioner(git_repo, remote_dir=tmp_path / "remote")
    data = git_repo / "data"
    data.mkdir()
    (data / "a.txt").write_text("v1")
    v1 = versioner.commit("v1")  # initializes on first use
    (data / "a.txt").write_text("v2")
    v2 = versioner.commit("v2")
    (data / "a.txt").write_text("an annotation nobody committed")
    with pytest.raises(DataVersionError, match="not committed to DVC"):
        versioner.checkout(v1)
    assert (data / "a.txt").read_text() == "an annotation nobody committed"
    versioner.checkout(v1, force=True)
    assert (data / "a.txt").read_text() == "v1"
    assert versioner.current_version().md5 == v1.md5 != v2.md5


def test_push_and_pull_through_the_local_remote(git_repo, tmp_path):
    remote = tmp_path / "remote"
    versioner = DataVersioner(git_repo, remote_dir=remote)
    data = git_repo / "data"
    generate_dataset(data / "raw", 2, seed=3)
    v1 = versioner.commit("v1")
    snapshot_v1 = _snapshot(data)
    (data / "raw" / "extra.txt").write_text("more")
    v2 = versioner.commit("v2")
    snapshot_v2 = _snapshot(data)
    assert any(remote.rglob("*.dir"))  # pushed

    # Lose the cache and the workspace: the remote alone restores both versions.
    shutil.rmtree(git_repo / ".dvc" / "cache")
    shutil.rmtree(data)
    assert versioner.pull().md5 == v2.md5 and _snapshot(data) == snapshot_v2
    shutil.rmtree(git_repo / ".dvc" / "cache")
    versioner.checkout(v1)
    assert _snapshot(data) == snapshot_v1


def test_works_without_git_and_reports_missing_data(tmp_path):
    root = tmp_path / "plain"
    versioner = DataVersioner(root, remote_dir=tmp_path / "remote")
    with pytest.raises(DataVersionError, match="does not exist"):
        versioner.commit("nothing yet")
    versioner.ensure_initialized()
    assert "no_scm" in (root / ".dvc" / "config").read_text()
    (root / "data").mkdir()
    (root / "data" / "x.bin").write_bytes(os.urandom(64))
    version = versioner.commit("first")
    assert version.git_revision is None and version.dvc_file_committed is None and version.files == 1
    with pytest.raises(ValueError, match="inside the repository"):
        DataVersioner(root, data_dir="../elsewhere")


def test_default_remote_is_stored_relative_to_the_repository(git_repo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # DVC reads relative paths against the working directory
    generate_dataset(git_repo / "data", 2, seed=1)
    DataVersioner(git_repo).commit("v1")
    config = (git_repo / ".dvc" / "config").read_text()
    assert "url = ../var/dvc-remote" in config  # works in any clone, wherever it lives
    assert any((git_repo / "var" / "dvc-remote").rglob("*")), "push must land inside the repository"
