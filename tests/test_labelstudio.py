"""The annotation loop against a real Label Studio 1.23 server (session fixture ``label_studio``)."""

from __future__ import annotations

import base64
import io
import socket
import uuid
from urllib.parse import urlparse

import httpx
import pytest

from components.curation.labelstudio.api import LabelStudioUnavailableError, connect
from components.curation.labelstudio.corrections import apply_corrections, export_corrections
from components.curation.labelstudio.interface import (
    CURRENT_PREDICTION,
    NEEDS_FIX_VIEW_TITLE,
    ORDER_VIEW_TITLE,
    VALIDATION_META_KEY,
)
from components.curation.labelstudio.markup_check import validate_markup
from components.curation.labelstudio.predictions import PagePrediction, display_scale, image_data_uri
from components.curation.labelstudio.project import ensure_project, view_id
from components.curation.labelstudio.queue import queue_pages
from components.data.page_store import PageDataset
from components.data.pages import InvalidPageError
from components.data.synthetic import generate_dataset
from components.services.labelstudio import ServiceError, start_label_studio
from components.services.process import LOOPBACK, free_port

GOOD_TABLE = "<table><tr><th>name</th><th>value</th></tr><tr><td>alpha</td><td>1</td></tr></table>"
BROKEN_TABLE = "<table><tr><td>alpha</td><td>1</tr></table>"  # second <td> never closed


# --------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def client(label_studio):
    return connect(label_studio.url, label_studio.api_key)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> PageDataset:
    return generate_dataset(tmp_path_factory.mktemp("ls-pages"), n_pages=5, seed=100)


@pytest.fixture
def project_title(client):
    """A unique title per test; the project is deleted afterwards so the server stays small."""
    title = f"docmarkup-test-{uuid.uuid4().hex[:10]}"
    yield title
    for project in client.projects.list(title=title):
        if project.title == title:
            client.projects.delete(id=project.id)


def _predictions(dataset: PageDataset, confidences: list[float]) -> list[PagePrediction]:
    pages = dataset.pages()
    return [PagePrediction(page.page_id, page.markup, conf) for page, conf in zip(pages, confidences, strict=False)]


def _first_task(client, project_id: int, view: int | None = None):
    kwargs = {"project": project_id, "fields": "all", "page_size": 1}
    if view is not None:
        kwargs["view"] = view
    return next(iter(client.tasks.list(**kwargs)))


def _submit(client, task_id: int, markup: str, confidence: str = "sure"):
    """What the labeling UI sends when an annotator edits the TextArea and presses Submit."""
    return client.annotations.create(
        id=task_id,
        result=[
            {"from_name": "markup", "to_name": "page", "type": "textarea", "value": {"text": [markup]}},
            {"from_name": "annotator_confidence", "to_name": "page", "type": "choices", "value": {"choices": [confidence]}},
        ],
        lead_time=12.5,
    )


# --------------------------------------------------------------------------------------------
# validation (no server)


def test_validate_markup_accepts_generated_pages(dataset):
    for page in dataset.pages():
        assert validate_markup(page.markup) == [], page.markup


@pytest.mark.parametrize(
    ("markup", "expected"),
    [
        ("", "empty"),
        (f"# Title\n\n{BROKEN_TABLE}", "not well-formed"),
        ("<table><tr><td>a</td></tr>", "outside a complete <table>"),  # never closed: falls back to text
        ("<table><td>a</td></table>", "only contain rows"),
        ("<table><tr><p>a</p></tr></table>", "<td>/<th>"),
        ("<table><tr><td>a</td><td>b</td></tr><tr><td>c</td></tr></table>", "different numbers of columns"),
        ("<table><tr><td colspan='x'>a</td></tr></table>", "positive integer"),
        ("text\n\n$$\nx^2", "unclosed $$"),
    ],
)
def test_validate_markup_rejects_broken_markup(markup, expected):
    problems = validate_markup(markup)
    assert problems and any(expected in p for p in problems), problems


def test_validate_markup_judges_structure_not_cell_text():
    table = (
        "<table><thead><tr><th rowspan='2'>a</th><th>b</th></tr><tr><th>c</th></tr></thead>"
        "<tbody><tr><td colspan='2'>R&D&nbsp;costs<br>&lt;5 &amp; rising</td></tr></tbody></table>"
    )
    assert validate_markup(table) == []
    assert validate_markup(table.replace("&nbsp;", "&nosuchentity;"))  # unknown entities are still errors


def test_image_data_uri_round_trips_and_rejects_corrupt_images(dataset, tmp_path):
    page = dataset.pages()[0]
    uri = image_data_uri(dataset, page)
    assert uri.startswith("data:image/png;base64,")
    # A small page is sent enlarged by a whole factor (Label Studio only ever shrinks it), same content.
    from PIL import Image, ImageChops

    shown = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")
    original = dataset.load_image(page).convert("RGB")
    scale = display_scale(original.height)
    assert scale > 1 and shown.size == (original.width * scale, original.height * scale)
    difference = ImageChops.difference(shown.resize(original.size, Image.Resampling.BOX), original)
    assert max(channel[1] for channel in difference.getextrema()) < 64
    assert display_scale(416) == 3 and display_scale(1584) == 1  # a 144-dpi Letter page goes as it is
    broken = PageDataset(tmp_path)
    broken.write([page])
    (tmp_path / page.image).parent.mkdir(parents=True)
    (tmp_path / page.image).write_bytes(b"not a png")
    with pytest.raises(InvalidPageError, match="corrupt"):
        image_data_uri(broken, page)


# --------------------------------------------------------------------------------------------
# server


@pytest.mark.services
def test_server_reuse_and_taken_port(label_studio):
    port = urlparse(label_studio.url).port
    again = start_label_studio(port, name="labelstudio-test")  # already running: reused, same token
    assert again == label_studio
    with socket.socket() as squatter:
        squatter.bind((LOOPBACK, 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with pytest.raises(ServiceError, match=f"port {taken} is already taken"):
            start_label_studio(taken, name="labelstudio-port-check")


@pytest.mark.services
def test_server_down_gives_a_clear_error():
    url = f"http://{LOOPBACK}:{free_port()}"
    with pytest.raises(LabelStudioUnavailableError) as excinfo:
        connect(url, "not-a-token")
    message = str(excinfo.value)
    assert url in message and "./run services start labelstudio" in message
    from label_studio_sdk import LabelStudio

    offline = LabelStudio(base_url=url, api_key="not-a-token")
    with pytest.raises(LabelStudioUnavailableError, match=url):
        ensure_project(offline, "never-created")


@pytest.mark.services
def test_ensure_project_is_idempotent(client, project_title):
    first = ensure_project(client, project_title)
    assert ensure_project(client, project_title) == first
    matching = [p for p in client.projects.list(title=project_title) if p.title == project_title]
    assert [p.id for p in matching] == [first]
    project = client.projects.get(id=first)
    assert 'name="markup"' in project.label_config and "TextArea" in project.label_config
    assert project.sampling == "Uncertainty sampling"
    views = [(v.data or {}).get("title") for v in client.views.list(project=first)]
    assert views == [ORDER_VIEW_TITLE, NEEDS_FIX_VIEW_TITLE]


@pytest.mark.services
def test_queue_lowest_confidence_first_with_visible_predictions(client, project_title, dataset, label_studio):
    project_id = ensure_project(client, project_title)
    predictions = _predictions(dataset, [0.9, 0.2, 0.75, 0.05, 0.5])
    result = queue_pages(client, project_id, dataset, predictions, "toy-v1", batch_size=2)
    by_confidence = [p.page_id for p in sorted(predictions, key=lambda p: p.confidence)]
    assert result.queued == by_confidence
    assert result.already_queued == []

    project = client.projects.get(id=project_id)
    assert project.model_version == CURRENT_PREDICTION
    expected_markup = {p.page_id: p.markup for p in predictions}

    # Default Data Manager order (task id) and our tab both start with the least confident page.
    first = _first_task(client, project_id)
    assert first.data["page_id"] == by_confidence[0]
    ordered = [t.data["page_id"] for t in client.tasks.list(project=project_id, view=view_id(client, project_id))]
    assert ordered == by_confidence

    # The label stream ("Label All Tasks") hands out the least confident page first too.
    response = httpx.get(
        f"{label_studio.url}/api/projects/{project_id}/next",
        headers={"Authorization": f"Token {label_studio.api_key}"},
        timeout=30,
    )
    assert response.status_code == 200 and response.json()["data"]["page_id"] == by_confidence[0]
    # ... with the model's markup as the prediction the editor pre-fills (the payload the UI renders).
    [shown] = response.json()["predictions"]
    assert shown["model_version"] == CURRENT_PREDICTION and response.json()["data"]["model_version"] == "toy-v1"
    assert shown["result"][0]["value"]["text"] == [expected_markup[by_confidence[0]]]

    # One prediction per task, filed under the project's model_version so the editor shows it.
    expected = {p.page_id: p for p in predictions}
    for task in client.tasks.list(project=project_id, fields="all"):
        preds = [p if isinstance(p, dict) else p.dict() for p in task.predictions]
        assert [p["model_version"] for p in preds] == [CURRENT_PREDICTION]
        wanted = expected[task.data["page_id"]]
        assert preds[0]["score"] == pytest.approx(wanted.confidence)
        assert preds[0]["result"][0]["value"]["text"] == [wanted.markup]
        assert task.data["image"].startswith("data:image/png;base64,")


def _task_predictions(client, project_id: int) -> dict[str, list[dict]]:
    return {task.data["page_id"]: [p if isinstance(p, dict) else p.dict() for p in task.predictions]
            for task in client.tasks.list(project=project_id, fields="all")}


@pytest.mark.services
def test_requeue_keeps_one_current_prediction_per_task(client, project_title, dataset):
    project_id = ensure_project(client, project_title)
    first_round = _predictions(dataset, [0.6, 0.4, 0.8])
    queue_pages(client, project_id, dataset, first_round, "toy-v1", batch_size=2)
    task_ids_before = sorted(t.id for t in client.tasks.list(project=project_id))

    again = queue_pages(client, project_id, dataset, first_round, "toy-v1")
    assert again.queued == [] and sorted(again.already_queued) == sorted(p.page_id for p in first_round)
    assert again.predictions_replaced == []
    assert sorted(t.id for t in client.tasks.list(project=project_id)) == task_ids_before
    assert len(client.predictions.list(project=project_id)) == 3

    # A retrained model re-scores everything and adds a page that is even less certain: each task
    # keeps one prediction, the newer model's, and lists the one it replaced.
    second_round = _predictions(dataset, [0.7, 0.5, 0.9, 0.1])
    result = queue_pages(client, project_id, dataset, second_round, "toy-v2")
    newest = second_round[3].page_id
    assert result.queued == [newest]
    assert sorted(result.predictions_replaced) == sorted(p.page_id for p in first_round)
    assert client.projects.get(id=project_id).model_version == CURRENT_PREDICTION
    shown = _task_predictions(client, project_id)
    assert all(len(preds) == 1 for preds in shown.values())
    tasks = {t.data["page_id"]: t for t in client.tasks.list(project=project_id, fields="all")}
    assert {page_id: t.data["model_version"] for page_id, t in tasks.items()} == dict.fromkeys(tasks, "toy-v2")
    old = tasks[first_round[0].page_id].data
    assert [h["model_version"] for h in old["prediction_history"]] == ["toy-v1"]
    assert old["confidence"] == pytest.approx(0.7) and old["prediction_source"] == "toy-v2 (confidence 0.70)"
    # The new page has the highest task id, yet our tab still shows it first.
    assert _first_task(client, project_id, view=view_id(client, project_id)).data["page_id"] == newest

    # Another source queues one more page only: nothing is copied, each task keeps the prediction of
    # the model that made it, and the tab still orders all of them by confidence.
    page = next(p for p in dataset.pages() if p.page_id not in shown)
    queue_pages(client, project_id, dataset, [PagePrediction(page.page_id, page.markup, 0.05)], "other-v3")
    shown = _task_predictions(client, project_id)
    assert all(len(preds) == 1 for preds in shown.values()) and len(shown) == 5
    makers = {t.data["page_id"]: t.data["model_version"] for t in client.tasks.list(project=project_id)}
    assert makers.pop(page.page_id) == "other-v3" and set(makers.values()) == {"toy-v2"}
    assert _first_task(client, project_id, view=view_id(client, project_id)).data["page_id"] == page.page_id


@pytest.mark.services
def test_correction_round_trip_into_dataset(client, project_title, tmp_path):
    dataset = generate_dataset(tmp_path / "pages", n_pages=3, seed=7)
    project_id = ensure_project(client, project_title)
    queued = queue_pages(client, project_id, dataset, _predictions(dataset, [0.3, 0.6, 0.9]), "toy-v1")
    page_id = queued.queued[0]
    corrected = f"# Corrected title\n\n{GOOD_TABLE}\n\n$$\nx^{{2}}\n$$"
    annotation = _submit(client, queued.task_ids[page_id], corrected)

    corrections = export_corrections(client, project_id)
    assert len(corrections) == 1
    correction = corrections[0]
    assert correction.accepted and correction.problems == ()
    assert (correction.page_id, correction.annotation_id, correction.markup) == (page_id, annotation.id, corrected)
    assert correction.annotator == "curator@docmarkup.local"
    assert correction.annotator_confidence == "sure"
    assert correction.created_at and correction.updated_at

    assert apply_corrections(dataset, corrections) == [page_id]
    page = {p.page_id: p for p in dataset.pages()}[page_id]
    assert page.markup == corrected
    assert page.meta["correction"]["annotator"] == "curator@docmarkup.local"
    assert page.meta["correction"]["annotation_id"] == annotation.id
    assert page.meta["correction"]["annotated_at"] == correction.updated_at
    untouched = [p for p in dataset.pages() if p.page_id != page_id]
    assert all(p.markup_override is None for p in untouched)

    version = dataset.fingerprint()
    assert apply_corrections(dataset, export_corrections(client, project_id)) == []
    assert dataset.fingerprint() == version


@pytest.mark.services
def test_broken_correction_is_reported_not_applied_not_lost(client, project_title, tmp_path):
    dataset = generate_dataset(tmp_path / "pages", n_pages=2, seed=11)
    project_id = ensure_project(client, project_title)
    queued = queue_pages(client, project_id, dataset, _predictions(dataset, [0.2, 0.4]), "toy-v1")
    page_id = queued.queued[0]
    task_id = queued.task_ids[page_id]
    broken = f"# Title\n\n{BROKEN_TABLE}"
    annotation = _submit(client, task_id, broken, confidence="unsure")
    version = dataset.fingerprint()

    corrections = export_corrections(client, project_id)
    [rejected] = corrections
    assert not rejected.accepted and rejected.page_id == page_id
    assert "not well-formed" in rejected.reason
    assert apply_corrections(dataset, corrections) == []
    assert dataset.fingerprint() == version

    # The annotator sees why, on the task itself and in the "Needs fix" tab ...
    task = client.tasks.get(id=task_id)
    assert f"#{annotation.id}" in task.data["validation_error"] and "not well-formed" in task.data["validation_error"]
    assert task.meta[VALIDATION_META_KEY]["status"] == "rejected"
    assert task.meta[VALIDATION_META_KEY]["annotation_id"] == annotation.id
    needs_fix = client.tasks.list(project=project_id, view=view_id(client, project_id, NEEDS_FIX_VIEW_TITLE))
    assert [t.id for t in needs_fix] == [task_id]
    # ... and the submitted work is still there, exactly as submitted.
    [kept] = [a if isinstance(a, dict) else a.dict() for a in task.annotations]
    assert kept["id"] == annotation.id and kept["result"][0]["value"]["text"] == [broken]

    # Exporting again does not re-mark an unchanged task (meta timestamp stays put).
    checked_at = task.meta[VALIDATION_META_KEY]["checked_at"]
    export_corrections(client, project_id)
    assert client.tasks.get(id=task_id).meta[VALIDATION_META_KEY]["checked_at"] == checked_at

    # The annotator fixes the markup in place; the next export accepts it and clears the mark.
    fixed = f"# Title\n\n{GOOD_TABLE}"
    client.annotations.update(
        id=annotation.id,
        result=[{"from_name": "markup", "to_name": "page", "type": "textarea", "value": {"text": [fixed]}}],
    )
    [accepted] = export_corrections(client, project_id)
    assert accepted.accepted and accepted.markup == fixed and accepted.annotation_id == annotation.id
    task = client.tasks.get(id=task_id)
    assert task.data["validation_error"] == ""
    assert task.meta[VALIDATION_META_KEY]["status"] == "accepted"
    assert list(client.tasks.list(project=project_id, view=view_id(client, project_id, NEEDS_FIX_VIEW_TITLE))) == []
    assert apply_corrections(dataset, [accepted]) == [page_id]
    assert {p.page_id: p for p in dataset.pages()}[page_id].markup == fixed



def test_credentials_stay_off_command_lines_and_out_of_logs(label_studio):
    """The admin password and API token reach Label Studio through its environment: no process of
    the server's group shows them in its arguments (world-readable through ``ps``), the log
    never holds them, and the service's log and state folder are private to their owner."""
    import os
    import stat
    from pathlib import Path

    from components.services.labelstudio import TEST_SERVICE_NAME, load_or_create_credentials
    from components.services.process import VAR_DIR, ManagedService

    credentials = load_or_create_credentials(TEST_SERVICE_NAME)
    service = ManagedService(name=TEST_SERVICE_NAME, command=[], health=lambda: False)
    group = service.pid()
    assert group is not None
    command_lines = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.getpgid(int(proc.name)) == group:
                    command_lines.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
    assert command_lines and any("label-studio" in line for line in command_lines)
    log = service.log_file.read_text()
    for secret in (credentials.password, credentials.api_key):
        assert all(secret not in line for line in command_lines)
        assert secret not in log
    assert stat.S_IMODE(service.log_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(service.pid_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((VAR_DIR / "services" / TEST_SERVICE_NAME / "credentials.json").stat().st_mode) == 0o600
    assert stat.S_IMODE(service.state_dir.stat().st_mode) == 0o700


@pytest.mark.services
def test_queue_order_holds_across_three_sources_of_tasks(client, project_title, tmp_path, label_studio):
    """Pre-annotation, hard-example mining and production feedback each queue pages under their own
    model version; every switch of the project's version must leave all tasks scored and visible."""
    dataset = generate_dataset(tmp_path / "pages", n_pages=6, seed=300)
    project_id = ensure_project(client, project_title)
    predictions = _predictions(dataset, [0.3, 0.7, 0.1, 0.5, 0.2, 0.9])
    for source, chosen in [("rapidocr:3.4", predictions[0:2]), ("model:abc123", predictions[2:4]),
                           ("model:def456", predictions[4:6])]:
        queue_pages(client, project_id, dataset, chosen, source)
    by_confidence = [p.page_id for p in sorted(predictions, key=lambda p: p.confidence)]
    ordered = [t.data["page_id"] for t in client.tasks.list(project=project_id, view=view_id(client, project_id))]
    assert ordered == by_confidence
    response = httpx.get(f"{label_studio.url}/api/projects/{project_id}/next",
                         headers={"Authorization": f"Token {label_studio.api_key}"}, timeout=30)
    assert response.json()["data"]["page_id"] == by_confidence[0]
    markup = {p.page_id: p.markup for p in predictions}
    for task in client.tasks.list(project=project_id, fields="all"):
        shown = [p if isinstance(p, dict) else p.dict() for p in task.predictions]
        assert [p["result"][0]["value"]["text"] for p in shown] == [[markup[task.data["page_id"]]]]  # one, visible
    by_page = {t.data["page_id"]: t.data["model_version"] for t in client.tasks.list(project=project_id)}
    assert by_page[predictions[0].page_id] == "rapidocr:3.4" and by_page[predictions[2].page_id] == "model:abc123"


@pytest.mark.services
def test_block_view_round_trip_boxes_to_markup(client, project_title, tmp_path):
    """Block view: the pre-annotation's boxes arrive as labelled rectangles with their text; an
    annotator fixes one box's text, relabels another and moves a box above the rest; on export
    the page markup is rebuilt from the boxes in reading order, headers/footers dropped."""
    from components.curation.labelstudio.interface import BLOCKS_LABEL_CONFIG
    from components.curation.labelstudio.predictions import PagePrediction

    dataset = generate_dataset(tmp_path / "pages", n_pages=1, seed=11)
    [page] = dataset.pages()
    body = [e for e in page.elements if e.category in ("text", "title", "table", "formula")]
    assert len(body) >= 2, "seed 11 should give a page with at least two body blocks"
    project_id = ensure_project(client, project_title, BLOCKS_LABEL_CONFIG)
    prediction = PagePrediction(page.page_id, page.markup, 0.4, tuple(page.elements))
    result = queue_pages(client, project_id, dataset, [prediction], "layout-v1", view="blocks")
    task = client.tasks.get(id=result.task_ids[page.page_id])
    assert task.data["prediction_source"] == "layout-v1 (confidence 0.40)"
    [predicted] = [p if isinstance(p, dict) else p.dict() for p in task.predictions]
    regions = predicted["result"]
    assert len(regions) == 2 * len(page.elements)
    first_box = next(r for r in regions if r["from_name"] == "layout" and r["id"] == "b0")
    assert first_box["value"]["rectanglelabels"] == [page.elements[0].category]
    assert first_box["value"]["x"] == pytest.approx(100 * page.elements[0].bbox[0] / page.width)

    # The annotator's edits, as the UI submits them (same region ids for a box and its text).
    edited = [dict(r, value=dict(r["value"])) for r in regions]
    last = body[-1]
    last_id = f"b{page.elements.index(last)}"
    for region in edited:
        if region["id"] == last_id:
            region["value"]["y"] = 0.0  # dragged to the top of the page: now read first
            if region["from_name"] == "transcription":
                region["value"]["text"] = ["fixed words"]
            else:
                region["value"]["rectanglelabels"] = ["text"]
    client.annotations.create(id=task.id, result=edited, lead_time=3.0)

    [correction] = export_corrections(client, project_id)
    assert correction.accepted, correction.problems
    expected_body = ["fixed words"] + [
        f"# {e.content}" if e.category == "title" else f"$$\n{e.content}\n$$" if e.category == "formula" else e.content
        for e in body[:-1]]
    assert correction.markup == "\n\n".join(expected_body)
    assert correction.elements[0].category == "text"
    assert apply_corrections(dataset, [correction]) == [page.page_id]
    stored = PageDataset(dataset.root).pages()[0]
    assert stored.markup == correction.markup and stored.elements[0].content == "fixed words"

    # A box left without a category is reported, not silently dropped.
    unlabeled = [dict(r, value={k: v for k, v in r["value"].items() if k != "rectanglelabels"}) for r in edited]
    client.annotations.create(id=task.id, result=unlabeled, lead_time=1.0)
    latest = max(export_corrections(client, project_id), key=lambda c: c.annotation_id)
    assert not latest.accepted and "has no category" in latest.reason


def test_boxes_drawn_on_an_enlarged_page_export_in_page_pixels():
    """Label Studio records the displayed image's size with each box; a small page is displayed
    enlarged, so the task's own page size must win or every box would come back 3x too large."""
    from components.curation.labelstudio.predictions import blocks_from_result

    value = {"x": 10.0, "y": 20.0, "width": 50.0, "height": 5.0}
    common = {"id": "r1", "to_name": "page", "original_width": 960, "original_height": 1248}
    result = [{**common, "from_name": "layout", "type": "rectanglelabels", "value": {**value, "rectanglelabels": ["text"]}},
              {**common, "from_name": "transcription", "type": "textarea", "value": {**value, "text": ["body"]}}]
    elements, problems = blocks_from_result(result, (320, 416))
    assert problems == [] and elements[0].bbox == pytest.approx((32.0, 83.2, 192.0, 104.0))
    assert blocks_from_result(result)[0][0].bbox == pytest.approx((96.0, 249.6, 576.0, 312.0))  # older tasks: as recorded
