"""The human correction loop on Label Studio: queue low-confidence pages, read corrections back.

Flow: :func:`ensure_project` → :func:`queue_pages` (page image + model markup as a prediction)
→ annotators fix the markup in Label Studio → :func:`export_corrections` validates what they
submitted → :func:`apply_corrections` writes the accepted fixes into the :class:`PageDataset`.

Design choices, each against a known Label Studio pain point:

- **Images travel as base64 data URIs** inside the task. That works offline, needs no storage
  connection, no ``LOCAL_FILES_DOCUMENT_ROOT`` covering the dataset and no shared filesystem
  with the server, and the task stays valid if the dataset moves. The cost is ~1.33× the PNG
  size per task in Label Studio's database and in task listings, which is fine for page-sized
  PNGs (tens of KB here); :data:`MAX_IMAGE_BYTES` refuses absurdly large pages loudly.
- **One current prediction per task**, and the task says which model made it. Label Studio's
  labelling stream pre-fills, and its uncertainty sampling scores, only predictions whose
  ``model_version`` equals the project's, while the task view lists every prediction as a tab.
  Pages come from several makers (pre-annotation, hard-example mining, production feedback), so
  every prediction is filed under one project-wide name, :data:`CURRENT_PREDICTION`; the maker
  is the task's ``model_version`` field and its header ("Prefilled: <maker> (confidence ...)").
  A page re-scored by a newer model gets that prediction in place of the old one, never beside
  it, and the replaced ones are listed in the task's ``prediction_history`` (maker, score, when).
- **Lowest confidence first**, in every place an annotator looks: tasks are imported in rising
  confidence (Data Manager default order is task id), the project samples by uncertainty
  (``Label All Tasks`` picks the lowest prediction score), and a Data Manager tab orders by
  prediction score, which stays right across several import rounds.
- **Imports are batched** (bulk prediction imports time out otherwise) and **idempotent**: each
  task carries ``page_id`` and pages already in the project are never imported twice.
- **Broken corrections are never dropped silently**: the annotation is kept as submitted, the
  task gets a ``validation_error`` (a Data Manager column, and shown in red above the page in
  the labeling view) plus a machine-readable record in ``meta``, a "Needs fix" tab lists such
  tasks, and the returned :class:`Correction` says ``accepted=False`` with the reasons.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import httpx
from lxml import etree
from PIL import Image

from components.data.markup import ALL_CATEGORIES, BLOCK_CATEGORIES, MarkupBlock, parse_markup, render_markup
from components.data.page_store import PageDataset
from components.data.pages import InvalidPageError, LayoutElement, Page

MARKUP_FIELD = "markup"
CONFIDENCE_FIELD = "annotator_confidence"
IMAGE_FIELD = "page"
LAYOUT_FIELD = "layout"  # block view: one rectangle per layout element, labelled by category
TRANSCRIPTION_FIELD = "transcription"  # block view: the markup of each rectangle
ORDER_VIEW_TITLE = "Lowest confidence first"
NEEDS_FIX_VIEW_TITLE = "Needs fix"
VALIDATION_META_KEY = "docmarkup_validation"
DEFAULT_BATCH_SIZE = 50
MAX_IMAGE_BYTES = 8 * 1024 * 1024
UNCERTAINTY_SAMPLING = "Uncertainty sampling"
# The one model_version every prediction is filed under, so Label Studio shows and scores all of
# them; which model made a task's prediction is in its data (see the module docstring).
CURRENT_PREDICTION = "current"

# Real pages must be readable on a 1366x768 laptop: a 1224x1584 manual page has body lines ~18 px
# high, so it needs about half scale (>= 9 px on screen). Label Studio fits an image into a box no
# taller than the window (its inline ``max-height: calc(100vh - 194px)``), which drew such a page at
# 212x300 px. So the page spans the labelling area's whole width, that cap is lifted (``<Style>``),
# the page is fitted to the width, and the labelling area scrolls; the editor comes below the page,
# and the block view's per-box texts are in the region list beside it. The labelling area's image
# container is found by its class prefix (CSS modules of Label Studio 1.23).
PAGE_STYLE = """.lsf-main-view .lsf-object [class^="container--"] { max-height: none !important; }"""


def _page_first_config(image_extra: str, edit_side: str) -> str:
    """The page image across the whole labelling area, the editor under it. ``$validation_error``
    is empty until a submitted correction fails validation; then the reason shows above the page.
    The header says which prediction was prefilled and where its text came from (the PDF's text
    layer, OCR with the reason the text layer was not used, or a model, with its confidence).
    ``image_extra`` (the block view's label palette) sits right above the page."""
    return f"""<View>
  <Style>{PAGE_STYLE}</Style>
  <View style="color: #b00020; font-weight: bold;">
    <Header value="$validation_error" size="5"/>
  </View>
  <Header value="Prefilled: $prediction_source" size="6"/>
{image_extra}  <Image name="{IMAGE_FIELD}" value="$image" zoom="true" zoomControl="true" maxWidth="100%"/>
{edit_side}  <Header value="How sure are you of this correction?" size="6"/>
  <Choices name="{CONFIDENCE_FIELD}" toName="{IMAGE_FIELD}" choice="single" showInline="true" required="false">
    <Choice value="sure"/>
    <Choice value="unsure"/>
  </Choices>
</View>
"""


# The whole page's markup in one text box.
LABEL_CONFIG = _page_first_config("", f"""  <Header value="Page markup: fix it to match the page (blank line between blocks; tables as HTML)" size="6"/>
  <TextArea name="{MARKUP_FIELD}" toName="{IMAGE_FIELD}" editable="true" maxSubmissions="1" rows="28"
            showSubmitButton="false" placeholder="corrected page markup"/>
""")

_CATEGORY_COLOURS = {"title": "#d62728", "text": "#1f77b4", "table": "#2ca02c", "formula": "#9467bd",
                     "code": "#17becf", "header": "#7f7f7f", "footer": "#8c564b", "figure": "#e377c2"}

# Label Studio's OCR pattern: the pre-annotation's layout boxes as editable rectangles labelled by
# category, one transcription per box (``perRegion``); the page markup is rebuilt from the boxes
# in reading order on export. Headers and footers are boxes without markup (as in OmniDocBench).
BLOCKS_LABEL_CONFIG = _page_first_config(f"""  <Header value="Select a box and fix its text in the region list (tables as HTML, formulas as LaTeX); draw missing boxes" size="6"/>
  <RectangleLabels name="{LAYOUT_FIELD}" toName="{IMAGE_FIELD}" strokeWidth="2">
{chr(10).join(f'    <Label value="{c}" background="{colour}"/>' for c, colour in _CATEGORY_COLOURS.items())}
  </RectangleLabels>
""", f"""  <TextArea name="{TRANSCRIPTION_FIELD}" toName="{IMAGE_FIELD}" perRegion="true" editable="true" rows="4"
            displayMode="region-list" placeholder="what this box says"/>
""")
LABEL_CONFIGS = {"page": LABEL_CONFIG, "blocks": BLOCKS_LABEL_CONFIG}

PROJECT_DESCRIPTION = (
    "Correct the model's page markup. Pages are ordered lowest model confidence first. "
    "Submitted markup is validated on export; problems show in the validation_error column."
)


class LabelStudioUnavailableError(ConnectionError):
    """Label Studio cannot be reached (not started, wrong URL, or it went down)."""

    def __init__(self, url: str, reason: object):
        super().__init__(
            f"Label Studio is not reachable at {url} ({reason}). Start it with "
            "`./run services start labelstudio` (or "
            "`components.services.labelstudio.start_label_studio()`), or pass the URL of a running server."
        )
        self.url = url


class LabelStudioRequestError(RuntimeError):
    """Label Studio answered, but refused a request (bad token, bad config, bad task)."""


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


@dataclass(frozen=True)
class QueueResult:
    queued: list[str]  # page ids imported now, in import (lowest confidence first) order
    already_queued: list[str]  # page ids that had a task already
    predictions_replaced: list[str]  # already-queued pages whose prediction this model replaced
    task_ids: dict[str, int]  # page id -> task id for every page passed in


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


# ---------------------------------------------------------------------------------------------
# connection


def _base_url(client) -> str:
    return client._client_wrapper.get_base_url()


def _call(client, what: str, fn: Callable[[], Any]) -> Any:
    """Run one SDK call, turning transport failures and API refusals into our own errors."""
    # deferred: only talking to Label Studio needs the SDK
    from label_studio_sdk.core.api_error import ApiError

    try:
        return fn()
    except httpx.TransportError as exc:
        raise LabelStudioUnavailableError(_base_url(client), f"{type(exc).__name__}: {exc}") from exc
    except ApiError as exc:
        raise LabelStudioRequestError(
            f"Label Studio at {_base_url(client)} refused to {what}: HTTP {exc.status_code}: {str(exc.body)[:500]}"
        ) from exc


def connect(url: str, api_key: str, timeout: float = 120.0):
    """A ``LabelStudio`` SDK client, after checking the server answers and accepts the token."""
    from label_studio_sdk import LabelStudio  # deferred: only talking to Label Studio needs the SDK

    url = url.rstrip("/")
    try:
        health = httpx.get(f"{url}/health", timeout=5.0)
    except httpx.TransportError as exc:
        raise LabelStudioUnavailableError(url, f"{type(exc).__name__}: {exc}") from exc
    if health.status_code != 200:
        raise LabelStudioUnavailableError(url, f"/health answered HTTP {health.status_code}")
    client = LabelStudio(base_url=url, api_key=api_key, timeout=timeout)
    _call(client, "accept the API token", client.users.whoami)
    return client


# ---------------------------------------------------------------------------------------------
# project


def ensure_project(client, title: str, label_config: str = LABEL_CONFIG) -> int:
    """Id of the project called ``title``, creating it (and its Data Manager tabs) if needed."""
    projects = _call(client, "list projects", lambda: list(client.projects.list(title=title, page_size=100)))
    matching = sorted(p.id for p in projects if p.title == title)
    if matching:
        project_id = matching[0]
        project = _call(client, f"read project {project_id}", lambda: client.projects.get(id=project_id))
        if project.label_config != label_config:  # our XML changed since the project was made
            _call(
                client,
                f"update the labeling config of project {project_id}",
                lambda: client.projects.update(id=project_id, label_config=label_config),
            )
    else:
        project = _call(
            client,
            f"create project {title!r}",
            lambda: client.projects.create(
                title=title,
                description=PROJECT_DESCRIPTION,
                label_config=label_config,
                sampling=UNCERTAINTY_SAMPLING,
                show_collab_predictions=True,
            ),
        )
        project_id = project.id
    _ensure_views(client, project_id)
    return project_id


def _ensure_views(client, project_id: int) -> None:
    """The two Data Manager tabs annotators work from; created once, found by title after."""
    wanted = {
        # The task's own confidence, kept current with its one prediction: Label Studio's
        # prediction-score column counts only the project's model version.
        ORDER_VIEW_TITLE: {"title": ORDER_VIEW_TITLE, "ordering": ["tasks:data.confidence"],
                           "columnsDisplayType": {"tasks:data.confidence": "Number"}},
        NEEDS_FIX_VIEW_TITLE: {
            "title": NEEDS_FIX_VIEW_TITLE,
            "filters": {
                "conjunction": "and",
                "items": [
                    {"filter": "filter:tasks:data.validation_error", "operator": "empty", "type": "String", "value": False}
                ],
            },
        },
    }
    existing = _call(client, "list Data Manager views", lambda: client.views.list(project=project_id))
    by_title = {(view.data or {}).get("title"): view for view in existing}
    for title, data in wanted.items():  # dict order: the ordering tab comes first
        view = by_title.get(title)
        if view is None:
            _call(client, f"create view {title!r}", lambda d=data: client.views.create(project=project_id, data=d))
        elif any((view.data or {}).get(key) != value for key, value in data.items()):  # made by an older version
            _call(client, f"update view {title!r}", lambda v=view, d=data: client.views.update(
                id=v.id, project=project_id, data={**(v.data or {}), **d}))


def view_id(client, project_id: int, title: str = ORDER_VIEW_TITLE) -> int:
    """Id of one of our Data Manager tabs (for listing tasks the way annotators see them)."""
    for view in _call(client, "list Data Manager views", lambda: client.views.list(project=project_id)):
        if (view.data or {}).get("title") == title:
            return view.id
    raise LookupError(f"project {project_id} has no Data Manager view {title!r}; run ensure_project first")


# ---------------------------------------------------------------------------------------------
# queueing


def _iter_tasks(client, project_id: int, *, fields: str = "task_only", query: dict | None = None) -> Iterator[Any]:
    kwargs: dict[str, Any] = {"project": project_id, "fields": fields, "page_size": 100}
    if query is not None:
        kwargs["query"] = json.dumps(query)
    yield from _call(client, f"list tasks of project {project_id}", lambda: list(client.tasks.list(**kwargs)))


def queued_page_ids(client, project_id: int) -> dict[str, int]:
    """page_id -> task id for every task in the project that carries a page_id."""
    found: dict[str, int] = {}
    for task in _iter_tasks(client, project_id):
        page_id = (task.data or {}).get("page_id")
        if page_id is not None:
            found.setdefault(str(page_id), task.id)
    return found


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


def _prediction(pred: PagePrediction, model_version: str, page: Page | None = None, view: str = "page") -> dict:
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
    predictions_replaced = _replace_predictions(client, project_id, already, existing, model_version, pages, view)
    if already:  # current predictions exist now (replaced, or already there)
        _show_current_predictions(client, project_id)

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
                "predictions": [_prediction(p, CURRENT_PREDICTION, pages[p.page_id], view)],
            }
            for p in batch
        ]
        response = _call(
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
            _show_current_predictions(client, project_id)
        if progress is not None:
            progress(len(queued), len(fresh))
    return QueueResult(
        queued=queued, already_queued=[p.page_id for p in already], predictions_replaced=predictions_replaced,
        task_ids=task_ids,
    )


def _show_current_predictions(client, project_id: int) -> None:
    """Make the project pre-fill and score by the current predictions (it hides other versions)."""
    _call(
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


def _replace_predictions(
    client, project_id: int, already: list[PagePrediction], existing: dict[str, int], model_version: str,
    pages: dict[str, Page], view: str,
) -> list[str]:
    """Give each already-queued page re-scored in this call this model's prediction as its only
    one; the ones it replaces go to the task's ``prediction_history``. Returns those page ids."""
    if not already:
        return []
    listed = _call(client, "list predictions", lambda: client.predictions.list(project=project_id))
    by_task: dict[int, list[Any]] = {}
    for pred in sorted(listed, key=lambda p: p.id):
        by_task.setdefault(pred.task, []).append(pred)
    replaced = []
    for fresh in already:
        task_id = existing[fresh.page_id]
        body = _prediction(fresh, CURRENT_PREDICTION, pages.get(fresh.page_id), view)
        current = by_task.get(task_id, [])
        task = _call(client, f"read task {task_id}", lambda t=task_id: client.tasks.get(id=t))
        data = dict(task.data or {})
        if (len(current) == 1 and current[0].model_version == CURRENT_PREDICTION and data.get("model_version") == model_version
                and current[0].result == body["result"] and math.isclose(current[0].score or 0.0, body["score"])):
            continue  # the same prediction is there already
        maker = data.get("model_version")
        history = list(data.get("prediction_history") or [])
        history += [{"model_version": maker if old.model_version == CURRENT_PREDICTION and maker else old.model_version,
                     "score": old.score, "created_at": _iso(old.created_at)} for old in current]
        for old in current:
            _call(client, f"delete prediction {old.id}", lambda o=old: client.predictions.delete(id=o.id))
        _call(client, f"add a prediction to task {task_id}", lambda b=body, t=task_id: client.predictions.create(
            task=t, model_version=b["model_version"], score=b["score"], result=b["result"]))
        data |= {"confidence": round(float(fresh.confidence), 6), "model_version": model_version,
                 "prediction_source": prediction_source(model_version, fresh.confidence, pages.get(fresh.page_id)),
                 "prediction_history": history}
        _call(client, f"update task {task_id}", lambda d=data, t=task_id: client.tasks.update(id=t, data=d))
        replaced.append(fresh.page_id)
    return replaced


# ---------------------------------------------------------------------------------------------
# validation


_VOID_BR_RE = re.compile(r"<br\s*/?>", re.IGNORECASE)
_NAMED_ENTITY_RE = re.compile(r"&([A-Za-z][A-Za-z0-9]*);")
_BARE_AMPERSAND_RE = re.compile(r"&(?![A-Za-z][A-Za-z0-9]*;|#[0-9]+;|#[xX][0-9A-Fa-f]+;)")
_XML_ENTITIES = frozenset({"amp", "lt", "gt", "quot", "apos"})


def _html_fragment_problems(table_html: str) -> list[str]:
    """Why one ``<table>`` block is not a well-formed table of rows and cells ([] if it is)."""
    # Strict XML parsing catches unclosed/misnested tags that an HTML parser would silently fix.
    # Cell *text* is held to HTML's looser rules: <br> is closed, HTML named entities become
    # characters and a bare "&" (as in "R&D") is escaped, so only the structure is judged.
    normalised = _VOID_BR_RE.sub("<br/>", table_html)
    normalised = _NAMED_ENTITY_RE.sub(
        lambda m: m.group(0) if m.group(1) in _XML_ENTITIES else html.unescape(m.group(0)), normalised
    )
    normalised = _BARE_AMPERSAND_RE.sub("&amp;", normalised)
    parser = etree.XMLParser(recover=False, resolve_entities=False, no_network=True)
    try:
        root = etree.fromstring(normalised.encode("utf-8"), parser)
    except etree.XMLSyntaxError as exc:
        return [f"table is not well-formed HTML: {exc.msg}"]
    if root.tag.lower() != "table":
        return [f"expected a <table> element, found <{root.tag}>"]
    problems: list[str] = []
    rows = []
    for child in root:
        if not isinstance(child.tag, str):
            continue  # comments
        tag = child.tag.lower()
        if tag in ("thead", "tbody", "tfoot"):
            for sub in child:
                if isinstance(sub.tag, str) and sub.tag.lower() != "tr":
                    problems.append(f"<{tag}> may only contain <tr>, found <{sub.tag}>")
                elif isinstance(sub.tag, str):
                    rows.append(sub)
        elif tag == "tr":
            rows.append(child)
        elif tag != "caption":
            problems.append(f"<table> may only contain rows (<tr>), found <{child.tag}>")
    if not rows:
        problems.append("table has no <tr> rows")
    widths = []
    pending: list[int] = []  # remaining rowspan per occupied column, carried to the next rows
    for index, row in enumerate(rows, 1):
        cells = [c for c in row if isinstance(c.tag, str)]
        bad = [c.tag for c in cells if c.tag.lower() not in ("td", "th")]
        if bad:
            problems.append(f"row {index} may only contain <td>/<th> cells, found <{bad[0]}>")
            continue
        if not cells:
            problems.append(f"row {index} has no cells")
            continue
        carried = sum(1 for n in pending if n > 0)
        pending = [n - 1 for n in pending if n - 1 > 0]
        width = carried
        for cell in cells:
            spans = []
            for attr in ("colspan", "rowspan"):
                raw = cell.get(attr, "1")
                try:
                    value = int(raw)
                except ValueError:
                    value = 0
                if value < 1:
                    problems.append(f"row {index}: {attr}={raw!r} is not a positive integer")
                    value = 1
                spans.append(value)
            colspan, rowspan = spans
            width += colspan
            if rowspan > 1:
                pending.extend([rowspan - 1] * colspan)
        widths.append(width)
    if widths and len(set(widths)) > 1:
        problems.append(f"rows have different numbers of columns: {widths}")
    return problems


def validate_markup(markup: str) -> list[str]:
    """Reasons the corrected page markup cannot be used as ground truth ([] when it can)."""
    if not markup.strip():
        return ["the corrected markup is empty"]
    problems: list[str] = []
    for number, block in enumerate(parse_markup(markup), 1):
        if block.category == "table":
            problems.extend(f"block {number}: {p}" for p in _html_fragment_problems(block.content))
        elif block.category in ("text", "title"):
            lowered = block.content.lower()
            if "<table" in lowered or "</table" in lowered or "<tr" in lowered or "<td" in lowered:
                problems.append(f"block {number}: table markup outside a complete <table>...</table> (unclosed table?)")
            if "$$" in block.content:
                problems.append(f"block {number}: unclosed $$ formula")
    return problems


# ---------------------------------------------------------------------------------------------
# export


def _result_value(result: list[dict], from_name: str, key: str) -> list:
    for item in result or []:
        if item.get("from_name") == from_name:
            return list((item.get("value") or {}).get(key) or [])
    return []


def _iso(value) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value or "")


def export_corrections(client, project_id: int) -> list[Correction]:
    """Every submitted (not skipped) annotation as a :class:`Correction`, validated.

    A correction that fails validation is returned with ``accepted=False`` and its reasons,
    and its task is marked in Label Studio (``data.validation_error`` + ``meta``) so the
    annotator sees what to fix; the annotation itself is left exactly as submitted. When a
    later edit passes, the mark is cleared.
    """
    users = {u.id: (u.email or u.username or str(u.id)) for u in _call(client, "list users", client.users.list)}
    annotated = {
        "filters": {
            "conjunction": "and",
            "items": [{"filter": "filter:tasks:total_annotations", "operator": "greater", "type": "Number", "value": 0}],
        }
    }
    corrections: list[Correction] = []
    for task in _iter_tasks(client, project_id, fields="all", query=annotated):
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
                    annotator=annotator, created_at=_iso(ann.get("created_at")), updated_at=_iso(ann.get("updated_at")),
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
    _call(
        client,
        f"mark task {task.id} with its validation result",
        lambda: client.tasks.update(id=task.id, data={**data, "validation_error": message}, meta=meta),
    )


# ---------------------------------------------------------------------------------------------
# apply


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
