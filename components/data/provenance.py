"""Where a page's target came from, and which models a model descends from.

A score means something only against truth the scored model did not write. Every page's target
has a provenance (``page.meta["truth"]``, or derived from the page's record):

- ``correction``: an annotator corrected it in Label Studio;
- ``text-layer``: the exact text of a born-digital PDF (the corpus, the ``pdf-text``/``auto``
  pre-annotation);
- ``synthetic``: the generator's own markup;
- ``preannotation:<model version>``: what a model or an OCR engine wrote (silver truth).

A model's lineage is its own weights' fingerprint and those of every model it was trained from
(``training_meta.json`` records them). Evaluation refuses pages whose truth a model of the lineage
wrote: grading a reader against its own pre-annotation measures nothing (it once scored 100.00).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from components.data.pages import Page
from models.loading import model_fingerprint

TRUTH_KEY = "truth"  # page.meta key: where the page's target came from
PREANNOTATION = "preannotation"
TEXT_LAYER = "text-layer"
CORRECTION = "correction"
INDEPENDENT_KINDS = (CORRECTION, TEXT_LAYER, "synthetic")  # no model of ours wrote these
LINEAGE_KEY = "lineage"  # training_meta.json: fingerprints of the models this one was trained from


def truth_of(page: Page) -> str:
    """The provenance of the page's target (see the module's list)."""
    recorded = page.meta.get(TRUTH_KEY)
    if recorded:
        return str(recorded)
    if page.meta.get(CORRECTION):
        return CORRECTION
    prefix = page.source.split(":")[0]
    return TEXT_LAYER if prefix == "debian" else prefix


def independent_record(meta: dict, has_own_markup: bool) -> bool:
    """Whether a stored page's target will be independent truth (see :func:`truth_of`), read from
    its record alone: its own markup (synthetic, corpus), an annotator's correction, or a
    pre-annotation read from the PDF's text layer."""
    if has_own_markup or meta.get(CORRECTION):
        return True
    record = meta.get("preannotation") or {}
    return (record.get("extra") or {}).get("source") == TEXT_LAYER


def truth_kind(truth: str) -> str:
    """``preannotation:rapidocr-3.4`` -> ``preannotation``; other kinds are their own name."""
    return truth.split(":", 1)[0]


def truth_model(truth: str) -> str | None:
    """The model version that wrote a silver truth, else None."""
    kind, _, version = truth.partition(":")
    return version if kind == PREANNOTATION and version else None


def written_by(truth: str, lineage: Iterable[str]) -> bool:
    """Whether a model of ``lineage`` (weight fingerprints) wrote this truth: its pre-annotation's
    version names one of them (``docmarkup_reader:<fingerprint>``, or an ``auto(...|...)`` wrapper)."""
    version = truth_model(truth)
    if version is None:
        return False
    return any(fingerprint and fingerprint in version for fingerprint in lineage)


def truth_counts(pages: Iterable[Page]) -> dict[str, int]:
    """Pages per truth (full provenance, e.g. ``preannotation:rapidocr-...``), most first."""
    return dict(Counter(truth_of(page) for page in pages).most_common())


def truth_kinds(counts: dict[str, int]) -> dict[str, int]:
    """Pages per kind of truth (``preannotation`` pooled over the models that wrote them)."""
    kinds: Counter = Counter()
    for truth, n in counts.items():
        kinds[truth_kind(truth)] += n
    return dict(kinds)


def describe_truth(counts: dict[str, int]) -> str:
    """``text-layer 3, correction 1`` for run descriptions and closing lines."""
    return ", ".join(f"{truth} {n}" for truth, n in counts.items()) or "none"


def model_lineage(model_dir: str | Path | None) -> set[str]:
    """Fingerprints of a model folder's weights and of every model it was trained from."""

    lineage: set[str] = set()
    folder = Path(model_dir) if model_dir else None
    seen: set[Path] = set()
    while folder is not None and folder.is_dir() and folder.resolve() not in seen:
        seen.add(folder.resolve())
        if (folder / "config.json").is_file():
            lineage.add(model_fingerprint(folder))
        meta = _training_meta(folder)
        lineage.update(meta.get(LINEAGE_KEY) or [])
        init = meta.get("init_model")
        folder = Path(init) if init else None
    return lineage


def _training_meta(folder: Path) -> dict:
    for name in ("training_meta.json", "pretrain.json"):
        path = folder / name
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                return {}
    return {}
