"""Deterministic train/val/test splits that never move a page once it has a split.

A page's split comes from a hash of its group key (``meta["document_id"]`` when present, so all
pages of one document land together and cannot leak across splits; else the page id), mapped
to [0, 1) and cut by the configured ratios. Adding pages never changes the split of existing
ones: each page records its split in ``meta["split"]``, which wins over the hash, so even changing
the ratios later only affects new pages (``reassign=True`` recomputes everything on purpose).
``splits.json`` records how (method, salt, ratios). Kept on the page rather than in one file of
every assignment, the record grows with the store's shards and a split run holds one shard at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from components.curation.storage import write_subset
from components.data.page_store import PageDataset
from components.data.pages import Page, atomic_write_text
from components.data.pdf import pdf_document_id
from components.data.provenance import independent_record

logger = logging.getLogger(__name__)

SPLITS_FILE = "splits.json"  # how splits are assigned (method, salt, ratios); each page records its own
SPLIT_KEY = "split"  # page.meta key holding the page's split
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


def document_group(meta: dict, group_by: str | None = DEFAULT_GROUP_KEY) -> str | None:
    """The group key of a page from its ``meta``, or None when the page is its own group."""
    value = meta.get(group_by) if group_by else None
    if value is None and group_by == DEFAULT_GROUP_KEY and meta.get("pdf_sha256"):
        value = pdf_document_id(meta["pdf_sha256"])  # pages imported before document ids were recorded
    return f"{group_by}:{value}" if value is not None else None


@dataclass
class SplitResult:
    dataset: PageDataset
    ratios: dict[str, float]
    split_counts: dict[str, int]
    new_pages: list[str] = field(default_factory=list)  # assigned by this call
    datasets: dict[str, PageDataset] = field(default_factory=dict)  # split -> dataset, when written

    def counts(self) -> dict[str, int]:
        return dict(self.split_counts)

    @property
    def assignments(self) -> dict[str, str]:
        """Page id -> split, read from the store (every page: memory grows with it; for inspection)."""
        return {page.page_id: page.meta[SPLIT_KEY] for page in self.dataset.iter_pages() if SPLIT_KEY in page.meta}

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


def _plan_new_groups(new: list[str], existing: dict[str, str], ratios: dict[str, float], salt: str,
                     trusted: set[str] | None = None, prefer: str = "test") -> dict[str, str]:
    """Splits for document groups seen for the first time: by hash, except that a split with a
    share but no document yet takes the newcomer with the lowest hash from the fullest split (so
    four PDFs still give a test split), and that the ``prefer`` split (test) holds newcomers with
    independent truth (``trusted``: corrected, text-layer, synthetic) before silver ones: a silver
    newcomer planned for it trades places with a trusted newcomer planned elsewhere, lowest hashes
    first, so every split keeps its count. Groups that already have a split never move."""
    planned = {group: assign_split(group, ratios, salt) for group in new}
    per_split = Counter(existing.values()) + Counter(planned.values())
    for name in (name for name, ratio in ratios.items() if ratio > 0):
        if per_split[name]:
            continue
        donor = max(ratios, key=lambda other: per_split[other])
        movable = sorted((g for g, split in planned.items() if split == donor), key=lambda g: hash_fraction(g, salt))
        if per_split[donor] < 2 or not movable:
            continue
        planned[movable[0]] = name
        per_split[donor] -= 1
        per_split[name] += 1
    if trusted is not None and prefer in ratios:
        by_hash = sorted(planned, key=lambda g: hash_fraction(g, salt))
        silver = [g for g in by_hash if planned[g] == prefer and g not in trusted]
        spare = [g for g in by_hash if planned[g] != prefer and g in trusted]
        for group, other in zip(silver, spare, strict=False):
            planned[group], planned[other] = planned[other], prefer
    return planned


def make_splits(
    dataset: PageDataset,
    ratios: dict[str, float] | None = None,
    *,
    salt: str = DEFAULT_SALT,
    group_by: str | None = DEFAULT_GROUP_KEY,
    out_dir: str | os.PathLike | None = None,
    reassign: bool = False,
    target: Callable[[Page], Page | None] | None = None,
    prefer_independent_test: bool = True,
) -> SplitResult:
    """Give every page without one a split (recorded on the page), optionally write split datasets.

    With ``out_dir``, each split is written as its own dataset folder ``out_dir/<split>/``. Memory
    stays bounded whatever the size of the store: one shard of pages at a time plus one entry per
    document group. ``target`` maps each page to what the split store holds (its training target),
    or to None to leave it out of the written splits (it keeps its split assignment). With
    ``prefer_independent_test``, new documents whose pages all have independent truth (their own
    markup, a correction, the text layer) go to ``test`` before documents graded only by a model's
    pre-annotation (:func:`_plan_new_groups`).
    """
    ratios = validate_ratios(ratios or DEFAULT_RATIOS)
    recorded = load_splits(dataset)
    if recorded and not reassign and recorded.get("ratios") != ratios:
        logger.warning("split ratios changed from %s to %s: existing pages keep their split, new pages use the new ratios",
                       recorded.get("ratios"), ratios)
    # Pass 1, two columns: splits already given, per page and per document group.
    group_split: dict[str, str] = {}
    new_groups: set[str] = set()
    silver_groups: set[str] = set()  # new groups with a page whose only truth would be a model's output
    unknown: set[str] = set()
    for table in dataset.scan(["meta", "elements", "markup_override"]):
        rows = zip(table.column("meta").to_pylist(), table.column("elements").to_pylist(),
                   table.column("markup_override").to_pylist(), strict=True)
        for meta_json, elements, override in rows:
            meta = json.loads(meta_json) if f'"{SPLIT_KEY}"' in meta_json or '"document_id"' in meta_json \
                or '"pdf_sha256"' in meta_json else {}
            group = document_group(meta, group_by)
            split = None if reassign else meta.get(SPLIT_KEY)
            if split is None:
                if group is not None:
                    new_groups.add(group)
                    own_markup = elements not in ("[]", "", None) or bool(override)
                    if not independent_record(json.loads(meta_json) if meta_json else {}, own_markup):
                        silver_groups.add(group)
                continue
            if split not in ratios:
                unknown.add(split)
            if group is not None:
                group_split.setdefault(group, split)
    if unknown:
        raise ValueError(f"pages of {dataset.root} are in splits {sorted(unknown)}, which the ratios {ratios} lack; "
                         f"keep those split names or pass reassign=True")
    fresh = sorted(new_groups - group_split.keys())
    trusted = set(fresh) - silver_groups if prefer_independent_test else None
    group_split.update(_plan_new_groups(fresh, group_split, ratios, salt, trusted))
    # Pass 2, shard by shard: assign the pages that have no split yet and write them back.
    counts = Counter({name: 0 for name in ratios})
    new_pages = []
    for shard in dataset.shards():
        changed = []
        for page in dataset.shard_pages(shard):
            split = None if reassign else page.meta.get(SPLIT_KEY)
            if split is None:
                group = document_group(page.meta, group_by)
                split = group_split.get(group) if group is not None else None
                split = split or assign_split(group if group is not None else f"page:{page.page_id}", ratios, salt)
                if group is not None:
                    group_split[group] = split
                if page.meta.get(SPLIT_KEY) != split:
                    changed.append(replace(page, meta={**page.meta, SPLIT_KEY: split}))
                    new_pages.append(page.page_id)
            counts[split] += 1
        dataset.upsert(changed, compact=False)  # the shards still to read stay where they are
    if new_pages:
        dataset.compact()
    header = {"method": "sha256(salt, group key) cut by cumulative ratios; each page records its split in "
                        f"meta[{SPLIT_KEY!r}]", "salt": salt, "group_by": group_by, "ratios": ratios}
    if recorded != header:
        atomic_write_text(dataset.root / SPLITS_FILE, json.dumps(header, indent=1) + "\n")
    result = SplitResult(dataset=dataset, ratios=ratios, split_counts=dict(counts), new_pages=new_pages)
    if out_dir is not None:  # one streaming pass over the store per split
        for name in ratios:
            members = (page for page in dataset.iter_pages() if page.meta.get(SPLIT_KEY) == name)
            if target is not None:
                members = (kept for kept in map(target, members) if kept is not None)
            result.datasets[name] = write_subset(dataset, members, Path(out_dir) / name)
    return result
