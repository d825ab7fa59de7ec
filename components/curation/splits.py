"""Deterministic train/val/test splits that never move a page once it has a split.

A page's split comes from a hash of its group key (``meta["document_id"]`` when present, so all
pages of one document land together and cannot leak across splits; else the page id), mapped
to [0, 1) and cut by the configured ratios. Adding pages never changes the split of existing
ones. ``splits.json`` in the dataset folder records every assignment; when it exists, recorded
assignments win over the hash, so even changing the ratios later only affects new pages
(``reassign=True`` recomputes everything on purpose).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from components.curation.storage import write_subset
from components.data.pages import Page, PageDataset, atomic_write_text

logger = logging.getLogger(__name__)

SPLITS_FILE = "splits.json"
DEFAULT_RATIOS = {"train": 0.8, "val": 0.1, "test": 0.1}
DEFAULT_SALT = "docmarkup-splits-v1"
DEFAULT_GROUP_KEY = "document_id"


def validate_ratios(ratios: dict[str, float]) -> dict[str, float]:
    if not ratios:
        raise ValueError("split ratios are empty")
    bad = {name: r for name, r in ratios.items() if not isinstance(r, int | float) or not math.isfinite(r) or r < 0}
    if bad:
        raise ValueError(f"split ratios must be finite and >= 0, got {bad}")
    total = sum(ratios.values())
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise ValueError(f"split ratios must sum to 1, got {total} for {ratios}")
    return dict(ratios)


def hash_fraction(key: str, salt: str = DEFAULT_SALT) -> float:
    """A uniform number in [0, 1) that depends only on ``salt`` and ``key``."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_split(key: str, ratios: dict[str, float] = DEFAULT_RATIOS, salt: str = DEFAULT_SALT) -> str:
    """The split of one group key: walk the cumulative ratios (in the order given)."""
    fraction = hash_fraction(key, salt)
    cumulative = 0.0
    names = [name for name, ratio in ratios.items() if ratio > 0]
    for name in names:
        cumulative += ratios[name]
        if fraction < cumulative:
            return name
    return names[-1]  # rounding at the very top of [0, 1)


def group_key(page: Page, group_by: str | None = DEFAULT_GROUP_KEY) -> str:
    if group_by and page.meta.get(group_by) is not None:
        return f"{group_by}:{page.meta[group_by]}"
    return f"page:{page.page_id}"


@dataclass
class SplitResult:
    assignments: dict[str, str]  # page id -> split
    ratios: dict[str, float]
    new_pages: list[str] = field(default_factory=list)  # assigned by this call
    datasets: dict[str, PageDataset] = field(default_factory=dict)  # split -> dataset, when written

    def counts(self) -> dict[str, int]:
        counts = Counter(self.assignments.values())
        return {name: counts.get(name, 0) for name in self.ratios}

    def pages_of(self, split: str) -> list[str]:
        return sorted(pid for pid, name in self.assignments.items() if name == split)


def load_splits(dataset: PageDataset) -> dict | None:
    path = dataset.root / SPLITS_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or delete it (assignments would be lost)") from exc


def make_splits(
    dataset: PageDataset,
    ratios: dict[str, float] | None = None,
    *,
    salt: str = DEFAULT_SALT,
    group_by: str | None = DEFAULT_GROUP_KEY,
    out_dir: str | os.PathLike | None = None,
    reassign: bool = False,
) -> SplitResult:
    """Assign every page a split, record it in ``splits.json``, optionally write split datasets.

    With ``out_dir``, each split is written as its own dataset folder ``out_dir/<split>/``.
    """
    ratios = validate_ratios(ratios or DEFAULT_RATIOS)
    recorded = None if reassign else load_splits(dataset)
    previous: dict[str, str] = dict(recorded["assignments"]) if recorded else {}
    if recorded and recorded.get("ratios") != ratios:
        logger.warning("split ratios changed from %s to %s: existing pages keep their split, new pages use the new ratios",
                       recorded.get("ratios"), ratios)
    unknown_splits = sorted({name for name in previous.values() if name not in ratios})
    if unknown_splits:
        raise ValueError(f"{dataset.root / SPLITS_FILE} assigns pages to {unknown_splits}, which the ratios {ratios} lack; "
                         f"keep those split names or pass reassign=True")
    pages = dataset.pages()
    assignments: dict[str, str] = {}
    new_pages = []
    group_split: dict[str, str] = {}
    for page in pages:  # a group that already has a page keeps using that page's split
        if page.page_id in previous:
            group_split.setdefault(group_key(page, group_by), previous[page.page_id])
    for page in pages:
        if page.page_id in previous:
            assignments[page.page_id] = previous[page.page_id]
            continue
        key = group_key(page, group_by)
        split = group_split.get(key) or assign_split(key, ratios, salt)
        group_split[key] = split
        assignments[page.page_id] = split
        new_pages.append(page.page_id)
    # Pages no longer in the dataset keep their record: if they come back, they come back to the same split.
    merged = {**previous, **assignments}
    record = {"method": "sha256(salt, group key) cut by cumulative ratios", "salt": salt, "group_by": group_by,
              "ratios": ratios, "assignments": dict(sorted(merged.items()))}
    path = dataset.root / SPLITS_FILE
    text = json.dumps(record, indent=1, ensure_ascii=False) + "\n"
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        atomic_write_text(path, text)
    result = SplitResult(assignments=assignments, ratios=ratios, new_pages=new_pages)
    if out_dir is not None:
        by_id = {page.page_id: page for page in pages}
        for name in ratios:
            members = [by_id[pid] for pid in sorted(assignments) if assignments[pid] == name]
            result.datasets[name] = write_subset(dataset, members, Path(out_dir) / name)
    return result
