"""Consistency mining: find the pages the model is unsure about by sampling it T times.

For each page, T stochastic decodes run as one batched engine call (the same image T times;
the engine seeds row r with ``seed + r``, so the rows differ). The page's consistency
C(x) = mean pairwise similarity of the T outputs (:func:`pairwise_consistency`, with the
task's metric: TEDS for tables, 1 − normalized edit distance for text and formulas, and the
block-matched mix of those for whole pages). Pages with C(x) < τ_train are *hard*: they go to
Label Studio for correction. C(x) stays on the page (``meta["consistency"]``) so the Stage-2
data loader can weight a page by 1 + β(1 − C).

With element parsing (``parsing.mode == "elements"``: two-stage models) the T samples of a page
are T parses of it, all their elements one engine batch; each element gets its own C over its T
readings, with its category's similarity (TEDS for tables, edit for text and formulas). The
page's C(x) is the mean over its elements; ``meta["hard_elements"]`` lists the elements under
τ_train (box, category, C) and, with the page's own boxes as layout, ``meta["element_consistency"]``
is aligned with ``page.elements`` so Stage 2 weights each element by its own C.

Each page's seed is derived from its id, so a page's samples do not depend on the order of
pages or on where a previous run stopped. Finished pages are journaled
(``consistency.journal.jsonl``) and folded into the manifest atomically; a re-run with the same
settings skips them, and a re-run with another τ_train only re-labels ``hard``.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from components.curation.storage import Journal, write_subset
from components.data.page_records import HARD
from components.data.page_store import PageDataset
from components.data.pages import InvalidPageError, Page
from components.decoding.types import DecodeParams
from components.metrics.consistency import CONSISTENCY_KINDS, pairwise_consistency
from components.parsing import ParseSettings, make_layout, parse_pages
from components.parsing.assembly import recognition_category
from components.progress import Progress

logger = logging.getLogger(__name__)

JOURNAL_NAME = "consistency.journal.jsonl"
MINING_KINDS = tuple(k for k in CONSISTENCY_KINDS if k != "layout")


@dataclass
class MiningReport:
    scores: dict[str, float]  # page id -> C(x), every page scored with these settings (this run or earlier)
    hard: list[str]  # page ids with C(x) < tau_train
    tau_train: float
    settings: dict[str, Any]
    mined: list[str] = field(default_factory=list)  # scored by this call
    skipped: list[str] = field(default_factory=list)  # scored earlier with the same settings
    failed: dict[str, str] = field(default_factory=dict)  # page id -> reason (corrupt image, ...)
    engine_calls: int = 0
    seconds: float = 0.0

    @property
    def mean_consistency(self) -> float | None:
        return sum(self.scores.values()) / len(self.scores) if self.scores else None


def page_seed(seed: int, page_id: str) -> int:
    """A per-page seed independent of page order: ``seed`` + CRC32 of the page id."""
    return seed + zlib.crc32(page_id.encode("utf-8"))


def _settings_key(settings: dict[str, Any]) -> str:
    return ";".join(f"{k}={settings[k]}" for k in sorted(settings))


def _fold(dataset: PageDataset, journal: Journal, tau_train: float) -> None:
    latest = journal.latest_done()
    if not latest:
        return
    changed: list[Page] = []
    for page in dataset.get_many(latest).values():
        record = latest[page.page_id]
        meta = {**page.meta, "consistency": record["consistency"], "hard": record["consistency"] < tau_train,
                "consistency_run": {**record["settings"], "tau_train": tau_train, "mined_at": record["mined_at"]}}
        if "elements" in record:  # element mining: which elements are hard, at this tau
            meta["hard_elements"] = [e for e in record["elements"] if e["consistency"] < tau_train]
            meta["hard"] = bool(meta["hard_elements"])
            if record.get("aligned"):
                meta["element_consistency"] = record["element_consistency"]
        if meta != page.meta:
            changed.append(replace(page, meta=meta))
    if changed:
        dataset.upsert(changed)


def mine_consistency(
    engine,
    dataset: PageDataset,
    T: int = 4,
    temperature: float = 1.0,
    tau_train: float = 0.8,
    kind: str = "page",
    seed: int = 0,
    decoder: str = "ar",
    max_new_tokens: int = 512,
    resume: bool = True,
    *,
    top_k: int = 0,
    model_version: str | None = None,
    page_ids: Iterable[str] | None = None,
    flush_every: int = 25,
    keep_samples: bool = False,
    journal_name: str | None = None,
    parsing: ParseSettings | None = None,
) -> MiningReport:
    """Score every page's consistency C(x) and flag pages under ``tau_train`` as hard.

    ``model_version`` (recommended) is part of the settings a finished page is matched on, so
    a new model re-mines every page. ``keep_samples`` also journals the T outputs (for
    inspection; the manifest only gets C, ``hard`` and the settings). Tasks mining different
    pages of one store in parallel (one per shard) each pass their own ``journal_name``.
    """
    if T < 2:
        raise ValueError(f"consistency needs at least T=2 samples per page, got T={T}")
    if temperature <= 0:
        raise ValueError(f"consistency mining samples, so temperature must be > 0, got {temperature}")
    if not 0.0 <= tau_train <= 1.0:
        raise ValueError(f"tau_train must be in [0, 1], got {tau_train}")
    if kind not in MINING_KINDS:
        hint = " (the engine outputs markup, not boxes: score layout with pairwise_consistency(boxes, 'layout'))" \
            if kind == "layout" else ""
        raise ValueError(f"kind must be one of {MINING_KINDS}, got {kind!r}{hint}")
    DecodeParams(decoder=decoder, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k)  # validate early

    settings = {"T": T, "temperature": temperature, "top_k": top_k, "kind": kind, "seed": seed, "decoder": decoder,
                "max_new_tokens": max_new_tokens, "model_version": model_version}
    by_element = parsing is not None and parsing.elements
    layout = make_layout(parsing.layout) if by_element else None
    if by_element:
        settings |= {"parse": "elements", "layout": parsing.layout}
    key = _settings_key(settings)
    journal = Journal(dataset.root / (journal_name or JOURNAL_NAME))
    journal.repair()
    _fold(dataset, journal, tau_train)

    latest = journal.latest_done()
    report = MiningReport(scores={}, hard=[], tau_train=tau_train, settings=settings)
    started = time.perf_counter()
    pending = 0
    page_ids = list(page_ids) if page_ids is not None else dataset.ids()
    progress = Progress(f"mine C(x), T={T}", len(page_ids), quiet_s=10.0)
    try:
        for page in dataset.iter_pages(page_ids=page_ids):
            progress.update(page.page_id)
            previous = latest.get(page.page_id)
            if resume and previous is not None and previous.get("settings_key") == key:
                report.scores[page.page_id] = previous["consistency"]
                report.skipped.append(page.page_id)
                continue
            try:
                image = dataset.load_image(page)
            except InvalidPageError as exc:
                report.failed[page.page_id] = str(exc)
                logger.warning("consistency mining skipped page %s: %s", page.page_id, exc)
                continue
            params = DecodeParams(decoder=decoder, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  seed=page_seed(seed, page.page_id))
            record = {"page_id": page.page_id, "status": "done", "settings": settings, "settings_key": key,
                      "mined_at": datetime.now(UTC).isoformat(timespec="seconds")}
            if by_element:
                parses = parse_pages([image] * T, engine, layout, params, [page] * T, prompt_style=parsing.prompt_style)
                report.engine_calls += 1
                outputs = [parse.markup for parse in parses]
                scored = element_consistency(parses)
                if not scored:
                    report.failed[page.page_id] = parses[0].reason or "no element could be read"
                    continue
                consistency = sum(e["consistency"] for e in scored) / len(scored)
                per_element = {e["index"]: e["consistency"] for e in scored}
                record |= {"elements": scored, "aligned": parsing.layout == "ground-truth",
                           "element_consistency": [per_element.get(i) for i in range(len(parses[0].elements))]}
            else:
                results = engine.generate([image] * T, params)
                report.engine_calls += 1
                outputs = [result.text for result in results]
                consistency = float(pairwise_consistency(outputs, kind))
            record["consistency"] = round(consistency, 6)
            if keep_samples:
                record["samples"] = outputs
            journal.append(record)
            report.scores[page.page_id] = record["consistency"]
            report.mined.append(page.page_id)
            pending += 1
            if pending >= flush_every:
                _fold(dataset, journal, tau_train)
                pending = 0
    finally:
        _fold(dataset, journal, tau_train)
        report.seconds = time.perf_counter() - started
    report.hard = sorted((pid for pid, c in report.scores.items() if c < tau_train), key=lambda pid: (report.scores[pid], pid))
    return report


def element_consistency(parses: list) -> list[dict]:
    """Per element read in every sample: its index, box, category and C over the T readings."""
    first = parses[0]
    scored = []
    for index, element in enumerate(first.elements):
        readings = [parse.elements[index] for parse in parses]
        if any(r.stats is None for r in readings):
            continue  # skipped (layout-only, blank) or failed in some sample
        category = recognition_category(element.category) or "text"
        kind = category if category in ("table", "formula") else "text"
        value = float(pairwise_consistency([r.markup for r in readings], kind))
        scored.append({"index": index, "box": [round(v, 1) for v in element.box], "category": element.category,
                       "consistency": round(value, 6)})
    return scored


def hard_example_ids(dataset: PageDataset) -> list[str]:
    """Ids of the pages flagged hard by the last mining run, least consistent first (three columns read)."""
    keys = []
    for table in dataset.scan(["page_id", "consistency"], HARD):
        ids, scores = table.column("page_id").to_pylist(), table.column("consistency").to_pylist()
        keys += [(0.0 if c is None else c, pid) for pid, c in zip(ids, scores, strict=True)]
    return [pid for _, pid in sorted(keys)]


def hard_examples(dataset: PageDataset) -> list[Page]:
    """The hard pages themselves, least consistent first."""
    return list(dataset.iter_pages(page_ids=hard_example_ids(dataset)))


def write_hard_examples(dataset: PageDataset, root: str | os.PathLike) -> PageDataset:
    """Write the hard pages as their own :class:`PageDataset` (for Label Studio and DVC), streaming."""
    return write_subset(dataset, dataset.iter_pages(page_ids=hard_example_ids(dataset)), root)


def consistency_weight(page: Page, beta: float) -> float:
    """Stage-2 sample weight 1 + β(1 − C); pages never mined weigh 1."""
    consistency = page.meta.get("consistency")
    return 1.0 if consistency is None else 1.0 + beta * (1.0 - float(consistency))
