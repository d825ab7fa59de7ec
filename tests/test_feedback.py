"""Low-confidence production pages become Label Studio tasks (real server, session fixture)."""

from __future__ import annotations

import io
import uuid

import pytest

from components.curation.labelstudio.api import connect, queued_page_ids
from components.curation.labelstudio.interface import LABEL_CONFIGS
from components.curation.labelstudio.project import ensure_project
from components.data.page_store import PageDataset
from components.data.synthetic import generate_page
from monitoring.feedback import low_confidence_entries, push_low_confidence_pages
from monitoring.request_log import RequestLog, ServedPage

pytestmark = pytest.mark.services


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    generate_page(seed)[1].save(buffer, format="PNG")
    return buffer.getvalue()


def _serve(log: RequestLog, seed: int, confidence: float) -> ServedPage:
    image = _png(seed)
    entry = ServedPage(page_id=RequestLog.page_id_for(image), decoder="sdb", mean_confidence=confidence, new_tokens=40,
                       forward_passes=12, latency_s=0.2, truncated=False, text=f"served text {seed}")
    return log.record(entry, image)


def test_only_low_confidence_pages_with_images_are_candidates(tmp_path):
    log = RequestLog(tmp_path, keep_images_below=0.9)
    low, high = _serve(log, 1, 0.4), _serve(log, 2, 0.95)
    assert [e.page_id for e in low_confidence_entries(log.entries(), threshold=0.8)] == [low.page_id]
    assert high.image is None


def test_low_confidence_pages_reach_label_studio_once(label_studio, tmp_path):
    client = connect(label_studio.url, label_studio.api_key)
    title = f"feedback-{uuid.uuid4().hex[:8]}"
    project_id = ensure_project(client, title)
    try:
        log = RequestLog(tmp_path / "log", keep_images_below=0.9)
        pages = [_serve(log, seed, confidence) for seed, confidence in ((3, 0.7), (4, 0.3), (5, 0.99), (6, 0.85))]
        dataset = PageDataset(tmp_path / "production")
        first = push_low_confidence_pages(client, project_id, log, dataset, threshold=0.8, model_version="v7")
        assert first.candidates == 2
        assert first.queue.queued == [pages[1].page_id, pages[0].page_id]  # lowest confidence first
        assert set(queued_page_ids(client, project_id)) == {pages[0].page_id, pages[1].page_id}
        stored = {p.page_id: p for p in dataset.pages()}
        assert stored[pages[1].page_id].source == "production" and dataset.load_image(stored[pages[1].page_id]).size == (320, 416)
        again = push_low_confidence_pages(client, project_id, log, dataset, threshold=0.8, model_version="v7")
        assert again.queue.queued == [] and len(queued_page_ids(client, project_id)) == 2
    finally:
        client.projects.delete(id=project_id)


def test_element_mode_pages_go_back_with_their_served_boxes(label_studio, tmp_path):
    """A page served in element mode is queued with one region per served element (box, category,
    markup); a page-mode page with one page box holding the served text."""
    client = connect(label_studio.url, label_studio.api_key)
    project_id = ensure_project(client, f"feedback-{uuid.uuid4().hex[:8]}", LABEL_CONFIGS["blocks"])
    try:
        log = RequestLog(tmp_path / "log", keep_images_below=0.9)
        image = _png(21)
        elements = [{"category": "title", "box": [20.0, 12.0, 300.0, 40.0], "markup": "# Results", "confidence": 0.6},
                    {"category": "text", "box": [20.0, 60.0, 300.0, 200.0], "markup": "Body text.", "confidence": 0.4}]
        served = log.record(ServedPage(page_id=RequestLog.page_id_for(image), decoder="ar", mean_confidence=0.5,
                                       new_tokens=9, forward_passes=9, latency_s=0.1, truncated=False,
                                       text="# Results\n\nBody text.", elements=elements), image)
        page_mode = _serve(log, 22, 0.3)
        push_low_confidence_pages(client, project_id, log, PageDataset(tmp_path / "production"), threshold=0.8,
                                  model_version="v8", view="blocks")
        tasks = {t.data["page_id"]: t.id for t in client.tasks.list(project=project_id)}
        results = {page_id: client.predictions.list(task=task_id)[0].result for page_id, task_id in tasks.items()}
        rectangles = [r for r in results[served.page_id] if r["type"] == "rectanglelabels"]
        texts = [r["value"]["text"][0] for r in results[served.page_id] if r["type"] == "textarea"]
        assert [r["value"]["rectanglelabels"] for r in rectangles] == [["title"], ["text"]]
        assert rectangles[0]["value"]["x"] == pytest.approx(100 * 20 / 320) and texts == ["# Results", "Body text."]
        whole = [r for r in results[page_mode.page_id] if r["type"] == "rectanglelabels"]
        assert len(whole) == 1 and whole[0]["value"]["width"] == pytest.approx(100)
    finally:
        client.projects.delete(id=project_id)


def _serve_text(log: RequestLog, seed: int, confidence: float, text: str, truncated: bool = False) -> ServedPage:
    image = _png(seed)
    entry = ServedPage(page_id=RequestLog.page_id_for(image), decoder="sdb", mean_confidence=confidence, new_tokens=40,
                       forward_passes=12, latency_s=0.2, truncated=truncated, text=text)
    return log.record(entry, image)


def test_empty_truncated_and_looping_outputs_go_back_whatever_their_confidence(tmp_path):
    from monitoring.feedback import entries_for_review

    log = RequestLog(tmp_path, keep_images_below=0.8)
    fine = _serve_text(log, 11, 0.97, "A served page with a sensible transcription of its body text.")
    empty = _serve_text(log, 12, 0.93, "   ")
    cut = _serve_text(log, 13, 0.99, "A long page whose decoding hit the token limit", truncated=True)
    loop = _serve_text(log, 14, 0.98, "Results of the run. " + "the the table " * 12)
    chars = _serve_text(log, 15, 0.96, "Header\n" + "=-" * 40)
    unsure = _serve_text(log, 16, 0.5, "A page the model was unsure about.")
    assert fine.image is None and all(e.image for e in (empty, cut, loop, chars, unsure))
    chosen = entries_for_review(log.entries(), threshold=0.8)
    reasons = {entry.page_id: why for entry, why in chosen}
    assert fine.page_id not in reasons
    assert reasons[empty.page_id] == ["empty output"] and reasons[cut.page_id] == ["truncated"]
    assert reasons[loop.page_id] == ["repetitive"] and reasons[chars.page_id] == ["repetitive"]
    assert reasons[unsure.page_id] == ["low confidence"]
    assert chosen[-1][0].page_id == unsure.page_id  # output problems come before mere low confidence


def test_repetition_check_leaves_ordinary_prose_and_tables_alone():
    from components.data.synthetic import generate_page
    from monitoring.suspect import is_repetitive

    assert not any(is_repetitive(generate_page(seed)[0].markup) for seed in range(40))
    assert is_repetitive("x = 1\n" + "0" * 60)
