"""Queue pages for annotators, lowest confidence first, batched and idempotent."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from components.curation.labelstudio.api import LabelStudioRequestError, call, queued_page_ids
from components.curation.labelstudio.interface import CURRENT_PREDICTION, DEFAULT_BATCH_SIZE, LABEL_CONFIGS
from components.curation.labelstudio.predictions import (
    PagePrediction,
    image_data_uri,
    prediction,
    prediction_source,
    replace_predictions,
    show_current_predictions,
)
from components.data.page_store import PageDataset


@dataclass(frozen=True)
class QueueResult:
    queued: list[str]  # page ids imported now, in import (lowest confidence first) order
    already_queued: list[str]  # page ids that had a task already
    predictions_replaced: list[str]  # already-queued pages whose prediction this model replaced
    task_ids: dict[str, int]  # page id -> task id for every page passed in


def queue_pages(
    client,
    project_id: int,
    dataset: PageDataset,
    pages_with_predictions: Iterable[PagePrediction],
    model_version: str,
    *,
    view: str = "page",
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int, int], None] | None = None,
) -> QueueResult:
    """Import pages as tasks with the model's markup as prediction, lowest confidence first.

    Re-running with the same pages imports nothing new. ``progress(done, total)`` is called
    after each batch so long imports can report how far they are.
    """
    predictions = list(pages_with_predictions)
    if not model_version:
        raise ValueError("model_version (the model that made these predictions) must be a non-empty string")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    seen: set[str] = set()
    for pred in predictions:
        if pred.page_id in seen:
            raise ValueError(f"page {pred.page_id!r} is listed twice; pass one prediction per page")
        seen.add(pred.page_id)
        if not math.isfinite(pred.confidence):
            raise ValueError(f"page {pred.page_id!r} has a non-finite confidence {pred.confidence!r}")
    pages = dataset.get_many(seen)
    missing = sorted(seen - pages.keys())
    if missing:
        raise KeyError(f"pages not in dataset {dataset.root}: {missing[:10]}{' ...' if len(missing) > 10 else ''}")

    existing = queued_page_ids(client, project_id)
    already = [p for p in predictions if p.page_id in existing]
    fresh = sorted((p for p in predictions if p.page_id not in existing), key=lambda p: (p.confidence, p.page_id))

    if view not in LABEL_CONFIGS:
        raise ValueError(f"unknown Label Studio view {view!r}; choose one of {sorted(LABEL_CONFIGS)}")
    predictions_replaced = replace_predictions(client, project_id, already, existing, model_version, pages, view)
    if already:  # current predictions exist now (replaced, or already there)
        show_current_predictions(client, project_id)

    task_ids = {p.page_id: existing[p.page_id] for p in already}
    queued: list[str] = []
    for start in range(0, len(fresh), batch_size):
        batch = fresh[start : start + batch_size]
        tasks = [
            {
                "data": {
                    "image": image_data_uri(dataset, pages[p.page_id]),
                    "page_id": p.page_id,
                    "page_width": pages[p.page_id].width,
                    "page_height": pages[p.page_id].height,
                    "confidence": round(float(p.confidence), 6),
                    "model_version": model_version,
                    "prediction_source": prediction_source(model_version, p.confidence, pages[p.page_id]),
                    "validation_error": "",
                },
                "predictions": [prediction(p, CURRENT_PREDICTION, pages[p.page_id], view)],
            }
            for p in batch
        ]
        response = call(
            client,
            f"import {len(tasks)} tasks",
            lambda t=tasks: client.projects.import_tasks(project_id, request=t, return_task_ids=True),
        )
        ids = list(response.task_ids or [])
        if len(ids) != len(batch):
            raise LabelStudioRequestError(
                f"Label Studio imported {len(ids)} tasks for a batch of {len(batch)}; re-run queue_pages "
                "(it skips pages already queued)"
            )
        for pred, task_id in zip(batch, ids, strict=True):
            task_ids[pred.page_id] = task_id
            queued.append(pred.page_id)
        if start == 0 and not already:
            # As soon as current predictions exist (Label Studio refuses a model_version it has
            # no predictions for), so an interrupted import still shows what it queued.
            show_current_predictions(client, project_id)
        if progress is not None:
            progress(len(queued), len(fresh))
    return QueueResult(
        queued=queued, already_queued=[p.page_id for p in already], predictions_replaced=predictions_replaced,
        task_ids=task_ids,
    )
