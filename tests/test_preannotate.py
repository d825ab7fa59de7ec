"""Pre-annotation: image-token stripping, the offline OCR default, our model, a real OpenAI-style server,
and crash-safe, resumable runs over a dataset."""

from __future__ import annotations

import base64
import io
import json
import socket
import statistics
import time

import pytest
import requests

from components.curation.preannotate import (
    JOURNAL_NAME,
    AnnotatorUnavailableError,
    BackendNotInstalledError,
    ModelAnnotator,
    ModelAnnotatorConfig,
    PaddleOCRVLPipelineAnnotator,
    PaddleOCRVLServerAnnotator,
    PaddleOCRVLServerConfig,
    PageAnnotationError,
    PreAnnotation,
    RapidOCRAnnotator,
    RapidOCRConfig,
    image_data_uri,
    make_preannotator,
    paddle_result_to_annotation,
    preannotate_dataset,
    preannotation_of,
    strip_image_tokens,
    unicode_math_to_latex,
)
from components.data.page_store import PageDataset
from components.data.synthetic import SyntheticConfig, generate_dataset, generate_page
from components.metrics import score_page
from components.services.process import free_port

MAX_TOKENS = 24


# ----- strip_image_tokens ---------------------------------------------------------------------
def test_strip_keeps_markup_without_pictures_byte_identical():
    markup = "# Title\n\nSome  text with **bold** and a [link](http://x).\n\n<table><tr><td>a</td></tr></table>\n\n$$\nx^{2}\n$$\n"
    assert strip_image_tokens(markup) == markup
    assert strip_image_tokens("") == ""


def test_strip_removes_picture_only_blocks_with_their_separator():
    markup = "first para\n\n![figure 1](imgs/fig1.png)\n\nsecond para\n\n<div style=\"text-align: center;\"><img src=\"a.jpg\" alt=\"Image\" width=\"50%\" /></div>\n\nthird"
    assert strip_image_tokens(markup) == "first para\n\nsecond para\n\nthird"
    assert strip_image_tokens("![x](y.png)\n\nonly text") == "only text"
    assert strip_image_tokens("text\n\n![x](y.png)\n") == "text\n"


def test_strip_removes_inline_images_vision_tokens_and_keeps_the_rest():
    assert strip_image_tokens("see ![chart](c.png) below") == "see below"
    assert strip_image_tokens("<|vision_start|><|image_pad|><|image_pad|><|vision_end|>Hello world") == "Hello world"
    assert strip_image_tokens("a <|IMAGE_PLACEHOLDER|> b <IMG_CONTEXT>") == "a b"
    assert strip_image_tokens("[![badge](b.svg)](http://x) text") == "text"
    table = "<table><tr><td><img src=\"x.png\"/></td><td>42</td></tr></table>"
    assert strip_image_tokens(table) == "<table><tr><td></td><td>42</td></tr></table>"
    figure = "<figure><img src=\"a.png\"><figcaption>Figure 2: results</figcaption></figure>"
    assert strip_image_tokens(figure) == "Figure 2: results"
    # An image line inside a paragraph goes without creating a new block boundary.
    assert strip_image_tokens("line one\n![x](y.png)\nline two") == "line one\nline two"


def test_strip_is_idempotent_and_leaves_math_alone():
    samples = ["a ![x](y) b\n\n<img src=z>\n\nc", "$$\n\\frac{a}{b} < c\n$$", "x <|image_pad|>"]
    for sample in samples:
        once = strip_image_tokens(sample)
        assert strip_image_tokens(once) == once
    assert strip_image_tokens("$$\n\\frac{a}{b} < c\n$$") == "$$\n\\frac{a}{b} < c\n$$"


def test_unicode_math_to_latex():
    assert unicode_math_to_latex("α³ = √π") == r"\alpha^{3} = \sqrt{\pi}"
    assert unicode_math_to_latex("x₀ − y") == r"x_{0} - y"


# ----- factory --------------------------------------------------------------------------------
def test_factory_selects_backends_and_rejects_bad_config(curation_model_dir):
    assert isinstance(make_preannotator(), RapidOCRAnnotator)
    assert isinstance(make_preannotator({"backend": "rapidocr", "threads": 1}), RapidOCRAnnotator)
    model = make_preannotator({"backend": "model", "model_dir": str(curation_model_dir), "max_new_tokens": 8})
    assert isinstance(model, ModelAnnotator) and model.model_version.startswith("docvlm:")
    server = make_preannotator({"backend": "paddleocr_vl_server", "url": "http://127.0.0.1:1/v1", "model": "m"})
    assert isinstance(server, PaddleOCRVLServerAnnotator) and server.base_url == "http://127.0.0.1:1/v1"
    with pytest.raises(ValueError, match=r"unknown pre-annotation backend 'tesseract'.*rapidocr"):
        make_preannotator({"backend": "tesseract"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['urll'\].*accepted: \['url'"):
        make_preannotator({"backend": "paddleocr_vl_server", "urll": "http://x"})
    with pytest.raises(ValueError, match="needs `url`"):
        make_preannotator({"backend": "paddleocr_vl_server"})
    with pytest.raises(ValueError, match="needs `model_dir`"):
        make_preannotator({"backend": "model"})


def test_pipeline_backend_explains_how_to_install():
    try:
        import paddleocr  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("paddleocr is installed here")
    annotator = make_preannotator({"backend": "paddleocr_vl_pipeline", "server_url": "http://127.0.0.1:8118/v1"})
    assert isinstance(annotator, PaddleOCRVLPipelineAnnotator)
    page, image = generate_page(0)
    with pytest.raises(BackendNotInstalledError, match=r"paddleocr\[doc-parser\].*paddleocr_vl_server"):
        annotator.annotate(image, page.page_id)


def test_paddle_pipeline_result_conversion():
    result = {"parsing_res_list": [
        {"block_label": "doc_title", "block_content": "A title", "block_bbox": [10, 10, 200, 40]},
        {"block_label": "image", "block_content": "", "block_bbox": [10, 50, 200, 150]},
        {"block_label": "text", "block_content": "Body text.", "block_bbox": "[10, 160, 300, 200]"},
    ]}
    markdown = "# A title\n\n<div style=\"text-align: center;\"><img src=\"imgs/img_in_image_box_10_50_200_150.jpg\" alt=\"Image\" /></div>\n\nBody text."
    annotation = paddle_result_to_annotation(result, markdown, "paddle-vl", 320, 416)
    assert annotation.markup == "# A title\n\nBody text."
    assert [(e.category, e.bbox) for e in annotation.elements] == [("title", (10, 10, 200, 40)), ("text", (10, 160, 300, 200))]
    assert annotation.confidence == 0.0 and annotation.extra["confidence_source"] == "none"


# ----- RapidOCR, offline ----------------------------------------------------------------------
@pytest.mark.slow
def test_rapidocr_reads_synthetic_pages_offline(monkeypatch):
    """The embedded default runs with the network cut (any connect raises) and reads pages well."""

    def no_network(*args, **kwargs):
        raise OSError("network access attempted during an offline test")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    annotator = RapidOCRAnnotator(RapidOCRConfig(threads=1))
    text_pages = SyntheticConfig(category_weights=(("text", 0.75), ("title", 0.25)))
    text_edits, mixed_edits, confidences = [], [], []
    started = time.perf_counter()
    for seed in range(4):
        page, image = generate_page(5000 + seed, text_pages)
        annotation = annotator.annotate(image, page.page_id)
        text_edits.append(score_page(annotation.markup, page.markup).text_edit)
        confidences.append(annotation.confidence)
        assert annotation.elements and all(e.category in ("title", "text", "header", "footer") for e in annotation.elements)
    for seed in range(3):
        page, image = generate_page(6000 + seed)
        scores = score_page(annotator.annotate(image, page.page_id).markup, page.markup)
        if scores.text_edit is not None:
            mixed_edits.append(scores.text_edit)
    seconds_per_page = (time.perf_counter() - started) / 7
    print(f"\nRapidOCR text edit distance: text pages {statistics.mean(text_edits):.4f}, "
          f"mixed pages {statistics.mean(mixed_edits):.4f}; {seconds_per_page:.2f} s/page")
    assert statistics.mean(text_edits) < 0.05
    assert statistics.mean(mixed_edits) < 0.15
    assert all(0.8 < c <= 1.0 for c in confidences)
    assert annotator.model_version.startswith("rapidocr-3.")


def test_rapidocr_blank_page_has_no_markup_and_zero_confidence():
    from PIL import Image

    annotation = RapidOCRAnnotator(RapidOCRConfig(threads=1)).annotate(Image.new("RGB", (320, 416), "white"), "blank")
    assert annotation.markup == "" and annotation.confidence == 0.0


# ----- our model ------------------------------------------------------------------------------
def test_model_annotator_confidence_is_mean_token_probability(curation_model_dir):
    annotator = ModelAnnotator.from_config(ModelAnnotatorConfig(curation_model_dir, max_new_tokens=MAX_TOKENS, model_version="tiny-v1"))
    page, image = generate_page(1)
    annotation = annotator.annotate(image, page.page_id)
    [result] = annotator.engine.generate([image], annotator.params)
    assert annotation.markup == strip_image_tokens(result.text)
    assert annotation.confidence == pytest.approx(sum(result.confidences) / len(result.confidences))
    assert 0.0 < annotation.confidence < 1.0 and annotation.model_version == "tiny-v1"


def test_paddleocr_vl_through_transformers_runs_on_our_engine_with_its_ocr_prompt(tmp_path, curation_model_dir):
    from recipes.tiny_checkpoint import write_tiny

    folder = write_tiny("paddleocr_vl", tmp_path / "paddleocr-vl", n_texts=20)
    annotator = make_preannotator({"backend": "paddleocr_vl_transformers", "model_dir": str(folder), "max_new_tokens": 8})
    assert type(annotator.engine.model).__name__ == "HFMarkupModel" and annotator.engine.model.prompt == "OCR:"
    assert "OCR:" in annotator.engine.model.chat_prompt()
    page, image = generate_page(2)
    annotation = annotator.annotate(image, page.page_id)
    assert annotation.model_version.startswith("paddleocr_vl:") and 0.0 < annotation.confidence <= 1.0
    assert annotation.extra["new_tokens"] > 0
    # As PaddleOCR-VL was trained: layout, then element crops with their task prompts; boxes come back.
    assert annotation.extra["parse"] == "elements" and annotation.elements
    assert all(0 <= e.bbox[0] < e.bbox[2] <= image.width for e in annotation.elements)
    whole = make_preannotator({"backend": "paddleocr_vl_transformers", "model_dir": str(folder), "max_new_tokens": 8,
                               "parse": "page"}).annotate(image, page.page_id)
    assert whole.extra["parse"] == "page" and whole.elements == []
    with pytest.raises(ValueError, match="holds a 'docvlm' model; this backend needs a 'paddleocr_vl' folder"):
        make_preannotator({"backend": "paddleocr_vl_transformers", "model_dir": str(curation_model_dir)})


# ----- running over a dataset -----------------------------------------------------------------
class CountingAnnotator:
    """Wraps a backend, counts calls and can fail on a given call, like a crash mid-run."""

    def __init__(self, inner, crash_on_call: int | None = None):
        self.inner = inner
        self.name = inner.name
        self.calls: list[str] = []
        self.crash_on_call = crash_on_call

    @property
    def model_version(self) -> str:
        return self.inner.model_version

    def annotate(self, image, page_id):
        self.calls.append(page_id)
        if self.crash_on_call is not None and len(self.calls) == self.crash_on_call:
            raise RuntimeError("simulated crash")
        return self.inner.annotate(image, page_id)


@pytest.fixture(scope="module")
def model_annotator(curation_model_dir):
    return ModelAnnotator.from_config(ModelAnnotatorConfig(curation_model_dir, max_new_tokens=MAX_TOKENS, model_version="tiny-v1"))


def _dataset_with_corrupt_page(root, n_pages: int = 5) -> PageDataset:
    dataset = generate_dataset(root, n_pages, seed=100)
    pages = dataset.pages()
    dataset.image_path(pages[2]).write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    return dataset


def test_preannotate_dataset_skips_corrupt_pages_and_resumes_without_redoing(tmp_path, model_annotator):
    dataset = _dataset_with_corrupt_page(tmp_path / "pages")
    pages = dataset.pages()
    first = CountingAnnotator(model_annotator)
    report = preannotate_dataset(dataset, first, flush_every=2)
    assert set(report.failed) == {pages[2].page_id} and "corrupt" in report.failed[pages[2].page_id]
    assert report.annotated == [p.page_id for i, p in enumerate(pages) if i != 2]
    stored = {p.page_id: preannotation_of(p) for p in dataset.pages()}
    assert stored[pages[2].page_id] is None
    for page_id in report.annotated:
        annotation = stored[page_id]
        assert annotation.model_version == "tiny-v1" and 0.0 < annotation.confidence < 1.0
    # Ground truth is untouched: pre-annotations live in meta only.
    assert [p.markup for p in dataset.pages()] == [p.markup for p in pages]

    again = CountingAnnotator(model_annotator)
    second = preannotate_dataset(dataset, again)
    assert again.calls == []  # finished pages are not redone...
    assert list(second.failed) == [pages[2].page_id]  # ...the failed one is retried (and fails again)
    assert second.skipped == report.annotated and not second.annotated
    assert {p.page_id: preannotation_of(p) for p in dataset.pages()} == stored

    redo = CountingAnnotator(model_annotator)
    preannotate_dataset(dataset, redo, resume=False)
    assert redo.calls == report.annotated  # every readable page again


def test_preannotate_dataset_survives_a_crash_and_a_torn_journal(tmp_path, model_annotator):
    dataset = generate_dataset(tmp_path / "pages", 5, seed=200)
    ids = [p.page_id for p in dataset.pages()]
    crashing = CountingAnnotator(model_annotator, crash_on_call=4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        preannotate_dataset(dataset, crashing, flush_every=100)
    # The three finished pages reached the manifest even though the run died before a flush.
    assert [p.page_id for p in dataset.pages() if preannotation_of(p)] == ids[:3]
    # A crash in the middle of a journal append leaves a torn line; it must not poison the resume.
    with open(dataset.root / JOURNAL_NAME, "a", encoding="utf-8") as handle:
        handle.write('{"page_id": "' + ids[3] + '", "status": "do')
    resumed = CountingAnnotator(model_annotator)
    report = preannotate_dataset(dataset, resumed)
    assert resumed.calls == ids[3:] and report.skipped == ids[:3]
    assert all(preannotation_of(p) for p in dataset.pages())
    lines = (dataset.root / JOURNAL_NAME).read_text().splitlines()
    assert [json.loads(line)["page_id"] for line in lines] == ids  # one record per page, no duplicates


def test_preannotate_into_a_separate_dataset(tmp_path, model_annotator):
    dataset = generate_dataset(tmp_path / "raw", 3, seed=300)
    out = PageDataset(tmp_path / "preannotated")
    report = preannotate_dataset(dataset, model_annotator, out)
    assert len(report.annotated) == 3 and not (dataset.root / JOURNAL_NAME).exists()
    for page in out.pages():
        annotation = preannotation_of(page)
        assert page.markup == annotation.markup and page.source == "preannotation:tiny-v1"
        assert out.load_image(page).size == (page.width, page.height)
    assert all(preannotation_of(p) is None for p in dataset.pages())


def test_unreachable_server_stops_the_run_with_a_clear_error_and_keeps_finished_pages(tmp_path, model_annotator):
    dataset = generate_dataset(tmp_path / "pages", 3, seed=400)
    ids = [p.page_id for p in dataset.pages()]
    preannotate_dataset(dataset, model_annotator, page_ids=ids[:1])
    url = f"http://127.0.0.1:{free_port()}"
    down = PaddleOCRVLServerAnnotator(PaddleOCRVLServerConfig(url=url, model="PaddleOCR-VL-0.9B", retries=1, backoff_s=0.05,
                                                              model_version="tiny-v1"))
    with pytest.raises(AnnotatorUnavailableError) as error:
        preannotate_dataset(dataset, down)
    message = str(error.value)
    assert f"{url}/v1/chat/completions" in message and "2 attempt(s)" in message and "openai_server" in message
    assert [p.page_id for p in dataset.pages() if preannotation_of(p)] == ids[:1]


# ----- a real OpenAI-compatible server serving our model ---------------------------------------
@pytest.fixture(scope="module")
def markup_server(curation_model_dir):
    from components.curation.openai_server import openai_server_service

    service, url = openai_server_service(curation_model_dir, model_name="tiny-docvlm", name="test-openai-markup-server")
    service.start()
    try:
        yield service, url
    finally:
        service.stop()
        assert not service.running()


@pytest.mark.services
def test_server_annotator_matches_local_model_through_a_real_server(markup_server, model_annotator):
    _, url = markup_server
    models = requests.get(f"{url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny-docvlm"]
    annotator = PaddleOCRVLServerAnnotator(PaddleOCRVLServerConfig(url=url, max_tokens=MAX_TOKENS))  # model discovered
    assert annotator.model_version == "openai:tiny-docvlm"
    page, image = generate_page(7)
    remote = annotator.annotate(image, page.page_id)
    [local] = model_annotator.engine.generate([image], model_annotator.params)
    assert remote.markup == strip_image_tokens(local.text)
    token_probs = local.confidences[: len(local.token_ids) - int(local.finished)]  # the server leaves <eos> out
    assert remote.confidence == pytest.approx(sum(token_probs) / len(token_probs), rel=1e-4)
    assert remote.extra["confidence_source"] == "token_probability"
    assert remote.extra["finish_reason"] == ("stop" if local.finished else "length")


@pytest.mark.services
def test_server_sampling_streaming_and_errors(markup_server):
    _, url = markup_server
    page, image = generate_page(8)
    message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_uri(image)}},
                                             {"type": "text", "text": "OCR:"}]}]
    body = {"model": "tiny-docvlm", "messages": message, "max_tokens": MAX_TOKENS, "temperature": 1.5, "seed": 3, "n": 3}
    sampled = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    texts = [choice["message"]["content"] for choice in sampled["choices"]]
    assert len(texts) == 3 and len(set(texts)) > 1  # rows are seeded seed, seed+1, seed+2
    assert requests.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["content"] == texts[0]

    greedy = {"messages": message, "max_tokens": MAX_TOKENS}
    whole = requests.post(f"{url}/v1/chat/completions", json=greedy, timeout=60).json()["choices"][0]["message"]["content"]
    with requests.post(f"{url}/v1/chat/completions", json={**greedy, "stream": True}, timeout=60, stream=True) as response:
        events = [line[6:] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["delta"].get("content", "") for c in chunks) == whole
    assert chunks[-1]["finish_reason"] in ("stop", "length")

    # parse: elements runs the layout on the server and decodes every element; the elements come back too
    parsed = requests.post(f"{url}/v1/chat/completions", json={**greedy, "parse": "elements"}, timeout=60).json()
    elements = parsed["choices"][0]["elements"]
    assert elements and all(len(e["box"]) == 4 for e in elements)
    assert parsed["choices"][0]["message"]["content"] == "\n\n".join(e["markup"] for e in elements if e["markup"].strip())
    bad_mode = requests.post(f"{url}/v1/chat/completions", json={**greedy, "parse": "columns"}, timeout=10)
    assert bad_mode.status_code == 400 and "`parse` must be one of" in bad_mode.json()["error"]["message"]

    wrong_model = requests.post(f"{url}/v1/chat/completions", json={**greedy, "model": "gpt-4o"}, timeout=10)
    assert wrong_model.status_code == 404 and "tiny-docvlm" in wrong_model.json()["error"]["message"]
    broken = [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}}]}]
    bad = requests.post(f"{url}/v1/chat/completions", json={"messages": broken}, timeout=10)
    assert bad.status_code == 400 and "corrupt" in bad.json()["error"]["message"]
    no_image = requests.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert no_image.status_code == 400 and "no image" in no_image.json()["error"]["message"]

    # The annotator maps a page the server refuses (here 4x4 pixels) to a page-level error and a
    # wrong model name to an outage.
    tiny = generate_page(9)[1].resize((4, 4))
    buffer = io.BytesIO()
    tiny.save(buffer, format="PNG")
    refused = PaddleOCRVLServerAnnotator(PaddleOCRVLServerConfig(url=url, max_tokens=MAX_TOKENS))
    with pytest.raises(PageAnnotationError, match="HTTP 400"):
        refused._request("POST", "/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()}}]}]})
    wrong = PaddleOCRVLServerAnnotator(PaddleOCRVLServerConfig(url=url, model="gpt-4o", max_tokens=MAX_TOKENS))
    with pytest.raises(AnnotatorUnavailableError, match="HTTP 404"):
        wrong.annotate(image, page.page_id)


def test_preannotation_rejects_non_finite_confidence():
    with pytest.raises(ValueError, match="finite"):
        PreAnnotation("x", float("nan"), "v")
    assert PreAnnotation("x", 1.5, "v").confidence == 1.0


def test_the_model_backend_loads_in_parallel_threads_and_versions_by_content(curation_model_dir, tmp_path):
    """Two shards build their annotator at once (threads): both load; a copy of the same weights
    in another folder keeps the version, different weights in a folder of the same name do not."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from models.loading import load_markup_model, save_markup_model

    config = {"backend": "model", "model_dir": str(curation_model_dir), "max_new_tokens": 4}
    with ThreadPoolExecutor(4) as pool:
        annotators = list(pool.map(lambda _: make_preannotator(dict(config)), range(4)))
    assert len({a.model_version for a in annotators}) == 1
    copy = shutil.copytree(curation_model_dir, tmp_path / "elsewhere" / "model")
    assert make_preannotator({**config, "model_dir": str(copy)}).model_version == annotators[0].model_version
    model, tokenizer = load_markup_model(curation_model_dir)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    retrained = save_markup_model(model, tokenizer, tmp_path / "retrained" / curation_model_dir.name)
    assert make_preannotator({**config, "model_dir": str(retrained)}).model_version != annotators[0].model_version
