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

TRUTH_KEY = "truth"  # page.meta key: where the page's target came from


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
        truth = page.meta.get(TRUTH_KEY) or ("correction" if page.meta.get("correction") else page.source.split(":")[0])
        report.kept[truth] += 1
        return page
    record = page.meta.get(META_KEY)
    if not isinstance(record, dict):
        report.dropped["not pre-annotated"] += 1
        return None
    annotation = PreAnnotation.from_json(record)
    if not annotation.markup.strip():
        report.dropped["only page furniture" if annotation.elements else "empty pre-annotation"] += 1
        return None
    truth = f"preannotation:{annotation.model_version}"
    report.kept["preannotation"] += 1
    return replace(page, elements=list(annotation.elements), markup_override=annotation.markup,
                   meta={**page.meta, TRUTH_KEY: truth})
