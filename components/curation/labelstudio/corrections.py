"""Annotators' corrections: exported and validated (broken ones kept and flagged, never dropped),
then written into the page store."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from components.curation.labelstudio.api import call, iso, iter_tasks
from components.curation.labelstudio.interface import CONFIDENCE_FIELD, MARKUP_FIELD, VALIDATION_META_KEY
from components.curation.labelstudio.markup_check import validate_markup
from components.curation.labelstudio.predictions import blocks_from_result, markup_of
from components.data.page_store import PageDataset
from components.data.pages import LayoutElement


@dataclass(frozen=True)
class Correction:
    """One submitted annotation: the corrected markup and who/when, or why it was rejected."""

    page_id: str
    task_id: int
    annotation_id: int
    markup: str
    annotator: str
    created_at: str
    updated_at: str
    annotator_confidence: str | None = None
    accepted: bool = True
    problems: tuple[str, ...] = field(default_factory=tuple)
    elements: tuple[LayoutElement, ...] = ()  # block view: the corrected boxes, in reading order

    @property
    def reason(self) -> str:
        return "; ".join(self.problems)




def _result_value(result: list[dict], from_name: str, key: str) -> list:
    for item in result or []:
        if item.get("from_name") == from_name:
            return list((item.get("value") or {}).get(key) or [])
    return []



def export_corrections(client, project_id: int) -> list[Correction]:
    """Every submitted (not skipped) annotation as a :class:`Correction`, validated.

    A correction that fails validation is returned with ``accepted=False`` and its reasons,
    and its task is marked in Label Studio (``data.validation_error`` + ``meta``) so the
    annotator sees what to fix; the annotation itself is left exactly as submitted. When a
    later edit passes, the mark is cleared.
    """
    users = {u.id: (u.email or u.username or str(u.id)) for u in call(client, "list users", client.users.list)}
    annotated = {
        "filters": {
            "conjunction": "and",
            "items": [{"filter": "filter:tasks:total_annotations", "operator": "greater", "type": "Number", "value": 0}],
        }
    }
    corrections: list[Correction] = []
    for task in iter_tasks(client, project_id, fields="all", query=annotated):
        data = dict(task.data or {})
        page_id = str(data.get("page_id", ""))
        task_corrections = []
        for ann in task.annotations or []:
            ann = ann if isinstance(ann, dict) else ann.dict()
            if ann.get("was_cancelled"):
                continue
            texts = _result_value(ann.get("result"), MARKUP_FIELD, "text")
            markup = "\n".join(str(t) for t in texts).strip()
            size = (data["page_width"], data["page_height"]) if data.get("page_width") and data.get("page_height") else None
            elements, box_problems = blocks_from_result(ann.get("result"), size)
            if elements or box_problems:  # the block view: markup rebuilt from the boxes
                markup = markup_of(elements)
                texts = [markup]
            completed_by = ann.get("completed_by")
            if isinstance(completed_by, dict):
                annotator = completed_by.get("email") or str(completed_by.get("id"))
            else:
                annotator = users.get(completed_by, str(completed_by))
            problems = [] if page_id else ["task has no page_id in its data (not imported by queue_pages)"]
            problems += box_problems
            problems += validate_markup(markup) if texts else ["no corrected markup was submitted"]
            choices = _result_value(ann.get("result"), CONFIDENCE_FIELD, "choices")
            task_corrections.append(
                Correction(
                    page_id=page_id, task_id=task.id, annotation_id=int(ann["id"]), markup=markup,
                    annotator=annotator, created_at=iso(ann.get("created_at")), updated_at=iso(ann.get("updated_at")),
                    annotator_confidence=choices[0] if choices else None, accepted=not problems,
                    problems=tuple(problems), elements=tuple(elements),
                )
            )
        if task_corrections:
            latest = max(task_corrections, key=lambda c: (c.updated_at, c.annotation_id))
            _mark_task(client, task, data, latest)
            corrections.extend(task_corrections)
    return corrections


def _mark_task(client, task, data: dict, latest: Correction) -> None:
    """Show the latest annotation's validation outcome on its task (writes only on change)."""
    message = (
        f"Correction #{latest.annotation_id} by {latest.annotator} was NOT accepted: {latest.reason}. "
        "Edit the markup and update the annotation."
        if not latest.accepted
        else ""
    )
    meta = dict(task.meta or {})
    record = {
        "status": "accepted" if latest.accepted else "rejected",
        "annotation_id": latest.annotation_id,
        "annotator": latest.annotator,
        "annotation_updated_at": latest.updated_at,
        "problems": list(latest.problems),
    }
    previous = {k: v for k, v in (meta.get(VALIDATION_META_KEY) or {}).items() if k != "checked_at"}
    if data.get("validation_error", "") == message and previous == record:
        return
    meta[VALIDATION_META_KEY] = {**record, "checked_at": datetime.now(UTC).isoformat(timespec="seconds")}
    call(
        client,
        f"mark task {task.id} with its validation result",
        lambda: client.tasks.update(id=task.id, data={**data, "validation_error": message}, meta=meta),
    )




def apply_corrections(dataset: PageDataset, corrections: Iterable[Correction]) -> list[str]:
    """Write accepted corrections into the dataset; returns the page ids that changed.

    Per page the most recently updated accepted correction wins. Rejected ones are never
    applied. Re-applying the same corrections changes nothing (no rewrite of the manifest).
    """
    latest: dict[str, Correction] = {}
    for corr in corrections:
        if not corr.accepted:
            continue
        current = latest.get(corr.page_id)
        if current is None or (corr.updated_at, corr.annotation_id) > (current.updated_at, current.annotation_id):
            latest[corr.page_id] = corr
    if not latest:
        return []
    pages = dataset.get_many(latest)
    unknown = sorted(set(latest) - pages.keys())
    if unknown:
        raise KeyError(f"corrections for pages not in dataset {dataset.root}: {unknown[:10]}")
    changed = []
    for page_id, corr in latest.items():
        page = pages[page_id]
        provenance = {
            "source": "label-studio",
            "annotator": corr.annotator,
            "annotation_id": corr.annotation_id,
            "task_id": corr.task_id,
            "annotated_at": corr.updated_at,
            "annotator_confidence": corr.annotator_confidence,
        }
        elements = list(corr.elements) or page.elements
        if page.markup_override == corr.markup and page.meta.get("correction") == provenance and elements == page.elements:
            continue
        pages[page_id] = replace(page, markup_override=corr.markup, elements=elements,
                                 meta={**page.meta, "correction": provenance})
        changed.append(page_id)
    if changed:
        dataset.upsert(pages[pid] for pid in changed)
    return changed
