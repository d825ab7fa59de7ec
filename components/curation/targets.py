"""What a page is trained and evaluated against, and which pages have nothing to learn from.

A page's target is, in order of trust: its own markup (synthetic ground truth or an annotator's
correction), else its pre-annotation (silver truth, named in ``meta["truth"]`` so evaluation can
say what it scored against). A page with neither — never pre-annotated, pre-annotated as empty,
or holding only page furniture (running heads, page numbers, figures, which the markup leaves out)
— is unusable: curation drops it from the splits with a count instead of letting training fail on it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from components.curation.preannotate.base import META_KEY, PreAnnotation
from components.data.pages import Page
from components.data.provenance import PREANNOTATION, TEXT_LAYER, TRUTH_KEY, truth_of


@dataclass
class TargetReport:
    """Per split write: how many pages kept each kind of truth, and how many were dropped why."""

    kept: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)

    def summary(self) -> dict[str, dict[str, int]]:
        return {"kept": dict(self.kept), "dropped": dict(self.dropped)}


def page_with_target(page: Page, report: TargetReport | None = None) -> Page | None:
    """``page`` with the markup it is trained and scored against, or None when it has none."""
    report = report if report is not None else TargetReport()
    if page.markup.strip():
        report.kept[truth_of(page)] += 1
        return page
    record = page.meta.get(META_KEY)
    if not isinstance(record, dict):
        report.dropped["not pre-annotated"] += 1
        return None
    annotation = PreAnnotation.from_json(record)
    if not annotation.markup.strip():
        report.dropped["only page furniture" if annotation.elements else "empty pre-annotation"] += 1
        return None
    # the text layer (pdf-text / auto) is exact; anything else a model or OCR engine wrote is silver
    source = annotation.extra.get("source")
    truth = TEXT_LAYER if source == TEXT_LAYER else f"{PREANNOTATION}:{annotation.model_version}"
    if source and source.startswith("ocr:"):
        truth = f"{PREANNOTATION}:{source.removeprefix('ocr:')}"
    report.kept[TEXT_LAYER if truth == TEXT_LAYER else PREANNOTATION] += 1
    return replace(page, elements=list(annotation.elements), markup_override=annotation.markup,
                   meta={**page.meta, TRUTH_KEY: truth})
