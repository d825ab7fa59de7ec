"""The loop back: low-confidence production pages become Label Studio tasks.

Served pages the model was unsure of (their images are kept by the request log) are copied into
a ``production`` dataset and queued with the model's own output as the prediction, so an
annotator corrects rather than retypes; corrected pages then flow into the next training run
like any curated page. Queueing is idempotent (Label Studio tasks are keyed by page id).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from components.curation.labelstudio import PagePrediction, QueueResult, queue_pages
from components.data.page_store import PageDataset
from components.data.pages import Page, load_image
from monitoring.request_log import RequestLog, ServedPage


@dataclass
class FeedbackResult:
    candidates: int
    queue: QueueResult | None


def low_confidence_entries(entries: Iterable[ServedPage], threshold: float) -> list[ServedPage]:
    """Entries below ``threshold`` that kept their image, newest first per page, lowest first overall."""
    latest: dict[str, ServedPage] = {}
    for entry in entries:
        if entry.mean_confidence < threshold and entry.image and (
            entry.page_id not in latest or entry.timestamp > latest[entry.page_id].timestamp
        ):
            latest[entry.page_id] = entry
    return sorted(latest.values(), key=lambda e: e.mean_confidence)


def add_to_dataset(log: RequestLog, entries: list[ServedPage], dataset: PageDataset) -> list[Page]:
    """Copy the pages' images into ``dataset`` (no ground truth yet) and return their records."""
    pages = []
    for entry in entries:
        kept = log.image_path(entry)
        if kept is None:  # pruned by the retention policy since it was logged
            continue
        image = load_image(kept)
        pages.append(Page(
            page_id=entry.page_id, image=dataset.save_image(entry.page_id, image), width=image.width,
            height=image.height, source="production",
            meta={"decoder": entry.decoder, "confidence": entry.mean_confidence, "served_at": entry.timestamp,
                  "model_version": entry.model_version},
        ))
    if pages:
        dataset.upsert(pages)
    return pages


def push_low_confidence_pages(
    client, project_id: int, log: RequestLog, dataset: PageDataset, threshold: float, model_version: str,
    since: float | None = None, view: str = "page",
) -> FeedbackResult:
    """Queue every low-confidence served page (with the served output as prediction)."""
    entries = low_confidence_entries(log.entries(since=since), threshold)
    if not entries:
        return FeedbackResult(candidates=0, queue=None)
    added = {page.page_id for page in add_to_dataset(log, entries, dataset)}  # images pruned since are skipped
    predictions = [PagePrediction(e.page_id, e.text, e.mean_confidence) for e in entries if e.page_id in added]
    return FeedbackResult(candidates=len(entries), queue=queue_pages(client, project_id, dataset, predictions, model_version,
                                                                        view=view))
