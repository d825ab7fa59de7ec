"""The loop back: low-confidence and suspect production pages become Label Studio tasks.

Served pages the model was unsure of (their images are kept by the request log) are copied into
a ``production`` dataset and queued with the model's own output as the prediction (in element
mode its served boxes, one region each), so an annotator corrects rather than retypes; corrected pages then flow into the next training run
like any curated page. Queueing is idempotent (Label Studio tasks are keyed by page id).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from components.curation.labelstudio.predictions import PagePrediction
from components.curation.labelstudio.queue import QueueResult, queue_pages
from components.data.page_store import PageDataset
from components.data.pages import LayoutElement, Page, load_image
from monitoring.request_log import RequestLog, ServedPage
from monitoring.suspect import LOW_CONFIDENCE, review_reasons


@dataclass
class FeedbackResult:
    candidates: int
    queue: QueueResult | None


def entries_for_review(entries: Iterable[ServedPage], threshold: float) -> list[tuple[ServedPage, list[str]]]:
    """Served pages annotators should see, with why: below ``threshold`` confidence, or an empty,
    truncated or looping output at any confidence. Newest entry per page; pages with an output
    problem first, then lowest confidence first. Only entries that kept their image qualify."""
    latest: dict[str, tuple[ServedPage, list[str]]] = {}
    for entry in entries:
        reasons = review_reasons(entry.text, truncated=entry.truncated, mean_confidence=entry.mean_confidence,
                                 low_confidence=threshold)
        if reasons and entry.image and (entry.page_id not in latest or entry.timestamp > latest[entry.page_id][0].timestamp):
            latest[entry.page_id] = (entry, reasons)
    return sorted(latest.values(), key=lambda item: (item[1] == [LOW_CONFIDENCE], item[0].mean_confidence))


def served_layout(entry: ServedPage) -> tuple[LayoutElement, ...]:
    """The served element boxes with their markup (element mode); page mode served none, and the
    block view then shows one page box holding the served text."""
    return tuple(LayoutElement(e["category"], tuple(e["box"]), e.get("markup", "")) for e in entry.elements)


def low_confidence_entries(entries: Iterable[ServedPage], threshold: float) -> list[ServedPage]:
    """The entries of :func:`entries_for_review`, without their reasons."""
    return [entry for entry, _ in entries_for_review(entries, threshold)]


def add_to_dataset(log: RequestLog, entries: list[ServedPage], dataset: PageDataset,
                   reasons: dict[str, list[str]] | None = None) -> list[Page]:
    """Copy the pages' images into ``dataset`` (no ground truth yet) and return their records."""
    pages = []
    reasons = reasons or {}
    for entry in entries:
        kept = log.image_path(entry)
        if kept is None:  # pruned by the retention policy since it was logged
            continue
        image = load_image(kept)
        pages.append(Page(
            page_id=entry.page_id, image=dataset.save_image(entry.page_id, image), width=image.width,
            height=image.height, source="production",
            meta={"decoder": entry.decoder, "confidence": entry.mean_confidence, "served_at": entry.timestamp,
                  "model_version": entry.model_version, "review_reasons": reasons.get(entry.page_id, [])},
        ))
    if pages:
        dataset.upsert(pages)
    return pages


def push_low_confidence_pages(
    client, project_id: int, log: RequestLog, dataset: PageDataset, threshold: float, model_version: str,
    since: float | None = None, view: str = "page",
) -> FeedbackResult:
    """Queue every served page worth a look (:func:`entries_for_review`), the served output as prediction."""
    chosen = entries_for_review(log.entries(since=since), threshold)
    if not chosen:
        return FeedbackResult(candidates=0, queue=None)
    entries = [entry for entry, _ in chosen]
    reasons = {entry.page_id: why for entry, why in chosen}
    added = {page.page_id for page in add_to_dataset(log, entries, dataset, reasons)}  # images pruned since are skipped
    # Pages with an output problem go first in the queue whatever the model thought of them.
    predictions = [PagePrediction(e.page_id, e.text, e.mean_confidence if reasons[e.page_id] == [LOW_CONFIDENCE] else 0.0,
                                  served_layout(e)) for e in entries if e.page_id in added]
    return FeedbackResult(candidates=len(entries), queue=queue_pages(client, project_id, dataset, predictions, model_version,
                                                                        view=view))
