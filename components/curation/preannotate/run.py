"""Run a backend over a page store, journaling each finished page so nothing finished is lost."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from components.curation.preannotate.base import (
    JOURNAL_NAME,
    META_KEY,
    PageAnnotationError,
    PreAnnotation,
    PreAnnotator,
    strip_image_tokens,
)
from components.curation.storage import Journal, link_or_copy
from components.data.page_store import PageDataset
from components.data.pages import InvalidPageError, Page

logger = logging.getLogger(__name__)



# ---------------------------------------------------------------------------------------------
# running a backend over a dataset


@dataclass
class PreAnnotationReport:
    model_version: str
    annotated: list[str] = field(default_factory=list)  # page ids annotated by this call
    skipped: list[str] = field(default_factory=list)  # already annotated by this model version earlier
    failed: dict[str, str] = field(default_factory=dict)  # page id -> reason (corrupt image, refused page)
    seconds: float = 0.0

    @property
    def pages_per_second(self) -> float:
        return len(self.annotated) / self.seconds if self.seconds > 0 else 0.0


def _meta_record(record: dict) -> dict:
    return {key: record[key] for key in ("markup", "confidence", "model_version", "elements", "extra", "annotated_at")}


def _fold(dataset: PageDataset, target: PageDataset, journal: Journal) -> int:
    """Write every journaled annotation into the target manifest (atomically). Returns pages changed."""
    latest = journal.latest_done()
    if not latest:
        return 0
    in_place = target.root.resolve() == dataset.root.resolve()
    source_pages = dataset.get_many(latest)
    current = target.get_many(latest)
    changed: list[Page] = []
    for page_id, record in latest.items():
        meta_record = _meta_record(record)
        if in_place:
            page = current.get(page_id)
            if page is None or page.meta.get(META_KEY) == meta_record:
                continue
            changed.append(replace(page, meta={**page.meta, META_KEY: meta_record}))
        else:
            source = source_pages.get(page_id)
            existing = current.get(page_id)
            if source is None or (existing is not None and existing.meta.get(META_KEY) == meta_record):
                continue
            link_or_copy(dataset.image_path(source), target.root / source.image)
            annotation = PreAnnotation.from_json(record)
            changed.append(replace(
                source, elements=annotation.elements, markup_override=annotation.markup, source=f"preannotation:{annotation.model_version}",
                meta={**source.meta, META_KEY: meta_record, "origin_dataset": str(dataset.root)},
            ))
    if changed:
        target.upsert(changed)
    return len(changed)


def preannotate_dataset(
    dataset: PageDataset,
    annotator: PreAnnotator,
    out: PageDataset | None = None,
    *,
    resume: bool = True,
    page_ids: Iterable[str] | None = None,
    flush_every: int = 25,
    progress: Callable[[Page, PreAnnotation | None], None] | None = None,
) -> PreAnnotationReport:
    """Annotate every page of ``dataset`` not yet annotated by this ``annotator.model_version``.

    Results land in ``page.meta["preannotation"]`` (markup, confidence, model_version, elements)
    of ``dataset`` itself, or, with ``out``, as pages of a separate dataset whose markup *is*
    the pre-annotation (images hard-linked or copied). Each finished page is journaled
    (``preannotations.journal.jsonl`` in the written dataset) before the next starts, and the
    manifest is rewritten atomically every ``flush_every`` pages and at the end, also when the
    run stops on an error. Corrupt images and pages the backend refuses are reported in
    ``failed`` and skipped; an unreachable backend stops the run (finished pages are kept).
    ``resume=False`` redoes pages this model version already annotated.
    """
    if flush_every < 1:
        raise ValueError(f"flush_every must be >= 1, got {flush_every}")
    target = out if out is not None else dataset  # (an empty PageDataset is falsy)
    journal = Journal(target.root / JOURNAL_NAME)
    journal.repair()
    version = annotator.model_version
    report = PreAnnotationReport(model_version=version)
    _fold(dataset, target, journal)  # a crash after journaling but before the manifest rewrite
    done = {r["page_id"] for r in journal.records() if r.get("status") == "done" and r.get("model_version") == version}
    wanted = list(dict.fromkeys(page_ids)) if page_ids is not None else None
    started = time.perf_counter()
    pending = 0
    try:
        for page in dataset.iter_pages(page_ids=wanted):
            if resume and page.page_id in done:
                report.skipped.append(page.page_id)
                continue
            try:
                image = dataset.load_image(page)
                # backends that read more than pixels (a PDF's text layer) get the page record too
                annotate_page = getattr(annotator, "annotate_page", None)
                annotation = annotate_page(page, image) if annotate_page else annotator.annotate(image, page.page_id)
            except (InvalidPageError, PageAnnotationError) as exc:
                report.failed[page.page_id] = str(exc)
                logger.warning("pre-annotation skipped page %s: %s", page.page_id, exc)
                journal.append({"page_id": page.page_id, "status": "failed", "model_version": version, "reason": str(exc)})
                if progress:
                    progress(page, None)
                continue
            annotation.markup = strip_image_tokens(annotation.markup)
            record = {"page_id": page.page_id, "status": "done", **annotation.to_json(),
                      "annotated_at": datetime.now(UTC).isoformat(timespec="seconds")}
            journal.append(record)
            report.annotated.append(page.page_id)
            if progress:
                progress(page, annotation)
            pending += 1
            if pending >= flush_every:
                _fold(dataset, target, journal)
                pending = 0
    finally:
        _fold(dataset, target, journal)
        report.seconds = time.perf_counter() - started
    return report


def preannotation_of(page: Page) -> PreAnnotation | None:
    """The pre-annotation stored on a page by :func:`preannotate_dataset`, if any."""
    record = page.meta.get(META_KEY)
    return PreAnnotation.from_json(record) if record else None
