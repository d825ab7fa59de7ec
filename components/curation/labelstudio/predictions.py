"""A model's reading of a page as a Label Studio prediction: the page image, the markup or the
block view's boxes, the "Prefilled:" header, and one current prediction per task."""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any

from PIL import Image

from components.curation.labelstudio.api import call, iso
from components.curation.labelstudio.interface import (
    CURRENT_PREDICTION,
    IMAGE_FIELD,
    LAYOUT_FIELD,
    MARKUP_FIELD,
    MAX_IMAGE_BYTES,
    TRANSCRIPTION_FIELD,
    UNCERTAINTY_SAMPLING,
)
from components.data.markup import ALL_CATEGORIES, BLOCK_CATEGORIES, MarkupBlock, render_markup
from components.data.page_store import PageDataset
from components.data.pages import InvalidPageError, LayoutElement, Page


@dataclass(frozen=True)
class PagePrediction:
    """A model's markup for one dataset page and its confidence (lower = review sooner);
    ``elements`` (pixel boxes with their markup) fill the block view's rectangles."""

    page_id: str
    markup: str
    confidence: float
    elements: tuple[LayoutElement, ...] = ()
    # per element: its consistency C when mining found it hard (shown on its region), else None
    hard_consistency: tuple[float | None, ...] = ()




# Label Studio fits the page to its panel, but draws a page smaller than the panel larger than the
# panel (the image and its box layer then disagree: synthetic 320x416 pages were cut by 4-10 % on
# every side at 1400x1000). Pages below this height are sent enlarged by a whole factor, so Label
# Studio only ever shrinks them; boxes are stored in percent, and exported in page pixels.
DISPLAY_MIN_HEIGHT = 1200


def display_scale(height: int) -> int:
    """The whole factor a page of this height is enlarged by for Label Studio (1: as it is)."""
    return max(1, math.ceil(DISPLAY_MIN_HEIGHT / max(1, height)))


def image_data_uri(dataset: PageDataset, page) -> str:
    """The page image as a ``data:image/png;base64,...`` URI (decoded once to reject corrupt files),
    enlarged by :func:`display_scale` when the page is small."""
    path = dataset.image_path(page)
    image = dataset.load_image(page)  # raises InvalidPageError with the path if missing or corrupt
    raw = path.read_bytes()
    scale = display_scale(image.height)
    if scale > 1:
        buffer = io.BytesIO()
        image.convert("RGB").resize((image.width * scale, image.height * scale), Image.Resampling.LANCZOS).save(
            buffer, format="PNG", optimize=True)
        raw = buffer.getvalue()
    if len(raw) > MAX_IMAGE_BYTES:
        raise ValueError(
            f"page {page.page_id!r} image {path} is {len(raw) / 1e6:.1f} MB; data URIs above "
            f"{MAX_IMAGE_BYTES / 1e6:.0f} MB bloat every Label Studio task listing; downscale it first"
        )
    mime = "image/png" if raw[:8] == b"\x89PNG\r\n\x1a\n" else "image/jpeg" if raw[:2] == b"\xff\xd8" else "image/png"
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


def prediction(pred: PagePrediction, model_version: str, page: Page | None = None, view: str = "page") -> dict:
    if view == "blocks" and page is not None:
        result = block_regions(pred, page)
    else:
        result = [{"from_name": MARKUP_FIELD, "to_name": IMAGE_FIELD, "type": "textarea", "value": {"text": [pred.markup]}}]
    return {"model_version": model_version, "score": float(pred.confidence), "result": result}


def block_regions(pred: PagePrediction, page: Page) -> list[dict]:
    """Rectangle + transcription results (same region id) for each predicted element; without
    elements (a model that returns markup only), one page-wide text box holding the markup."""
    width, height = float(page.width), float(page.height)
    elements = list(pred.elements) or [LayoutElement("text", (0, 0, width, height), pred.markup)]
    results = []
    for index, element in enumerate(elements):
        x0, y0, x1, y1 = element.bbox
        box = {"x": 100 * x0 / width, "y": 100 * y0 / height, "width": 100 * (x1 - x0) / width,
               "height": 100 * (y1 - y0) / height, "rotation": 0}
        common = {"id": f"b{index}", "to_name": IMAGE_FIELD, "original_width": page.width,
                  "original_height": page.height, "image_rotation": 0}
        rectangle = {**common, "from_name": LAYOUT_FIELD, "type": "rectanglelabels",
                     "value": {**box, "rectanglelabels": [element.category]}}
        hard = pred.hard_consistency[index] if index < len(pred.hard_consistency) else None
        if hard is not None:  # consistency mining found this element hard: say so on its region
            rectangle |= {"score": float(hard), "meta": {"text": [f"hard element: consistency {hard:.2f}"]}}
        results.append(rectangle)
        results.append({**common, "from_name": TRANSCRIPTION_FIELD, "type": "textarea",
                        "value": {**box, "text": [element.content]}})
    return results


def blocks_from_result(
    result: list[dict] | None, page_size: tuple[int, int] | None = None
) -> tuple[list[LayoutElement], list[str]]:
    """The boxes of a block-view annotation in reading order (top to bottom, then left to right),
    in page pixels, and the problems that stop it from becoming page markup. ``page_size`` (the
    task's ``page_width``/``page_height``) wins over the size Label Studio recorded, which is the
    displayed image's (enlarged for small pages)."""
    regions: dict[str, dict] = {}
    for item in result or []:
        if item.get("from_name") not in (LAYOUT_FIELD, TRANSCRIPTION_FIELD) or "id" not in item:
            continue
        region = regions.setdefault(item["id"], {"value": item.get("value", {}), "labels": [], "text": [],
                                                  "size": (item.get("original_width"), item.get("original_height"))})
        value = item.get("value", {})
        region["labels"] += value.get("rectanglelabels", [])
        region["text"] += value.get("text", [])
    elements, problems = [], []
    for region_id, region in regions.items():
        value, (width, height) = region["value"], page_size or region["size"]
        labels = [label for label in region["labels"] if label in ALL_CATEGORIES]
        if not labels:
            problems.append(f"box {region_id} has no category (pick one of {', '.join(ALL_CATEGORIES)})")
            continue
        if not width or not height:
            problems.append(f"box {region_id} lacks the image size")
            continue
        x0, y0 = value.get("x", 0) * width / 100, value.get("y", 0) * height / 100
        x1, y1 = x0 + value.get("width", 0) * width / 100, y0 + value.get("height", 0) * height / 100
        try:
            elements.append(LayoutElement(labels[0], (x0, y0, x1, y1), "\n".join(str(t) for t in region["text"]).strip()))
        except InvalidPageError as exc:
            problems.append(f"box {region_id}: {exc}")
    elements.sort(key=lambda e: (e.bbox[1], e.bbox[0]))
    return elements, problems


def markup_of(elements: list[LayoutElement]) -> str:
    """Page markup of block-view boxes: body categories in reading order, headers/footers dropped."""
    return render_markup([MarkupBlock(e.category, e.content) for e in elements if e.category in BLOCK_CATEGORIES])


def show_current_predictions(client, project_id: int) -> None:
    """Make the project pre-fill and score by the current predictions (it hides other versions)."""
    call(
        client,
        f"set the project's model_version to {CURRENT_PREDICTION!r}",
        lambda: client.projects.update(
            id=project_id, model_version=CURRENT_PREDICTION, sampling=UNCERTAINTY_SAMPLING, show_collab_predictions=True
        ),
    )


def prediction_source(model_version: str, confidence: float, page: Page | None) -> str:
    """The task header's "Prefilled:" line: who made the prediction, how sure it is, and, for a
    pre-annotation, where its text came from (the PDF's text layer, or OCR and why not the layer)."""
    line = f"{model_version} (confidence {confidence:.2f})"
    record = (page.meta.get("preannotation") if page is not None else None) or {}
    extra = record.get("extra") or {} if record.get("model_version") == model_version else {}
    source = extra.get("source")
    if source == "text-layer":
        return f"{line}; text from the PDF's text layer"
    if source:
        reason = f" (text layer not used: {extra['fallback_reason']})" if extra.get("fallback_reason") else ""
        return f"{line}; text by {source.replace(':', ' ', 1)}{reason}"
    return line


def replace_predictions(
    client, project_id: int, already: list[PagePrediction], existing: dict[str, int], model_version: str,
    pages: dict[str, Page], view: str,
) -> list[str]:
    """Give each already-queued page re-scored in this call this model's prediction as its only
    one; the ones it replaces go to the task's ``prediction_history``. Returns those page ids."""
    if not already:
        return []
    listed = call(client, "list predictions", lambda: client.predictions.list(project=project_id))
    by_task: dict[int, list[Any]] = {}
    for pred in sorted(listed, key=lambda p: p.id):
        by_task.setdefault(pred.task, []).append(pred)
    replaced = []
    for fresh in already:
        task_id = existing[fresh.page_id]
        body = prediction(fresh, CURRENT_PREDICTION, pages.get(fresh.page_id), view)
        current = by_task.get(task_id, [])
        task = call(client, f"read task {task_id}", lambda t=task_id: client.tasks.get(id=t))
        data = dict(task.data or {})
        if (len(current) == 1 and current[0].model_version == CURRENT_PREDICTION and data.get("model_version") == model_version
                and current[0].result == body["result"] and math.isclose(current[0].score or 0.0, body["score"])):
            continue  # the same prediction is there already
        maker = data.get("model_version")
        history = list(data.get("prediction_history") or [])
        history += [{"model_version": maker if old.model_version == CURRENT_PREDICTION and maker else old.model_version,
                     "score": old.score, "created_at": iso(old.created_at)} for old in current]
        for old in current:
            call(client, f"delete prediction {old.id}", lambda o=old: client.predictions.delete(id=o.id))
        call(client, f"add a prediction to task {task_id}", lambda b=body, t=task_id: client.predictions.create(
            task=t, model_version=b["model_version"], score=b["score"], result=b["result"]))
        data |= {"confidence": round(float(fresh.confidence), 6), "model_version": model_version,
                 "prediction_source": prediction_source(model_version, fresh.confidence, pages.get(fresh.page_id)),
                 "prediction_history": history}
        call(client, f"update task {task_id}", lambda d=data, t=task_id: client.tasks.update(id=t, data=d))
        replaced.append(fresh.page_id)
    return replaced
