"""Crash-safe storage for curation steps: append-only journals and dataset subsets.

A long step (pre-annotating or mining thousands of pages) appends one record per finished page
and fsyncs it before moving on, so a crash loses at most the page in flight. The dataset
manifest is then updated from the journal in one atomic rewrite (see
:func:`components.data.pages.atomic_write_text`); a resumed run first folds whatever the
journal holds, then skips those pages. A crash mid-append leaves a torn last line: it is
unfinished work, so it is cut off instead of poisoning the file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from components.data.page_store import PageDataset
from components.data.pages import Page

logger = logging.getLogger(__name__)


class Journal:
    """One JSON object per line; ``append`` returns only once the record is on disk."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def exists(self) -> bool:
        return self.path.exists()

    def repair(self) -> int:
        """Cut a torn trailing record (a crash mid-write). Returns the bytes removed."""
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        with open(self.path, "r+b") as handle:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
        logger.warning("journal %s: dropped a torn last record (%d bytes) left by an interrupted run",
                       self.path, len(data) - keep)
        return len(data) - keep

    def records(self) -> Iterator[dict]:
        """Every complete record in write order; unreadable lines are skipped with a warning."""
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, 1):
                if not line.endswith("\n"):
                    return  # torn tail of an interrupted append: not a finished record
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    logger.warning("journal %s:%d is not valid JSON (%s); skipped", self.path, line_no, exc)
                    continue
                if isinstance(record, dict):
                    yield record

    def latest_done(self) -> dict[str, dict]:
        """Per page id, its last record with status ``done`` (later runs supersede earlier ones)."""
        return {record["page_id"]: record for record in self.records() if record.get("status") == "done"}

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())


def link_or_copy(source: Path, target: Path) -> None:
    """Put ``source`` at ``target`` (hard link when possible, else a copy), atomically; keep an existing target."""
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copy2(source, tmp)
    os.replace(tmp, target)


def write_subset(dataset: PageDataset, pages: Iterable[Page], root: str | os.PathLike) -> PageDataset:
    """Write ``pages`` of ``dataset`` as their own store (images linked or copied), streaming.

    Re-writing a subset keeps the curation state stored on its pages: a ``meta`` key that only
    the subset's copy of a page has (``consistency`` from mining a split, say) survives, while
    everything the source page has wins. The subset is replaced in one commit; writing the same
    pages again changes no file.
    """
    subset = PageDataset(root)
    if subset.root.resolve() == dataset.root.resolve():
        raise ValueError(f"a subset must go to another folder than its dataset ({dataset.root})")

    def merged(chunk: list[Page]) -> Iterator[Page]:
        existing = subset.get_many(p.page_id for p in chunk)
        for page in chunk:
            link_or_copy(dataset.image_path(page), subset.root / page.image)
            previous = existing.get(page.page_id)
            if previous is not None and set(previous.meta) - set(page.meta):
                page = replace(page, meta={**previous.meta, **page.meta})
            yield page

    def written() -> Iterator[Page]:
        chunk: list[Page] = []
        for page in pages:
            chunk.append(page)
            if len(chunk) == 512:
                yield from merged(chunk)
                chunk = []
        yield from merged(chunk)

    subset.write(written())
    return subset
