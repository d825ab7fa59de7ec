"""The loop cannot fool itself: truth with a provenance that evaluation respects, no no-op
versions, probes that are not traffic, and drift verdicts that follow their tests.

Against the real services where they run: a SQLite MLflow store, a real Triton (PyTriton's
server) and real PDFs read by pdfium.
"""

from __future__ import annotations

import json
import shutil
import stat
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from components.curation.preannotate import make_preannotator, preannotate_dataset
from components.curation.targets import TargetReport, page_with_target
from components.data.page_store import PageDataset
from components.data.pdf import import_pdfs
from components.data.provenance import (
    LINEAGE_KEY,
    TEXT_LAYER,
    model_lineage,
    truth_of,
    written_by,
)
from components.data.synthetic import SyntheticConfig, generate_dataset
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.evaluate import OwnOutputTruthError, evaluate_decoders
from components.services.process import VAR_DIR
from models.loading import model_fingerprint, new_tiny_model, save_markup_model
from monitoring.drift import MIN_VERDICT_PAGES, NotEnoughPagesError, check_drift
from tests.test_pdf_loader import write_pdf_objects

BODY = ["The quick brown fox jumps over the lazy dog near the river bank.",
        "Annotators correct what the model wrote, and the model learns from them.",
        "Born-digital manuals carry every character with its box in the file."]


def _text_pdf(path: Path, title: str, lines: list[str], invisible: bool = False, rotate: int = 0) -> Path:
    """A born-digital one-page PDF (Helvetica, a text layer). ``invisible``: the text is in the
    layer but not drawn (render mode 3), as in a scan whose OCR layer does not match its pixels;
    ``rotate``: the page's /Rotate (shown turned, its text layer in unturned coordinates)."""
    mode = b"3 Tr " if invisible else b""
    ops = [b"BT %s/F1 20 Tf 72 720 Td (%s) Tj ET" % (mode, title.encode())]
    for index, line in enumerate(lines):
        ops.append(b"BT %s/F1 11 Tf 72 %d Td (%s) Tj ET" % (mode, 680 - 16 * index, line.encode()))
    stream = b"\n".join(ops)
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Rotate %d "
               b"/Resources << /Font << /F1 5 0 R >> >> >>" % rotate,
               b"<< /Length %d >> stream\n%s\nendstream" % (len(stream), stream),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>"]
    return write_pdf_objects(path, objects)


def _image_pdf(path: Path, source_pdf: Path) -> Path:
    """The same page rasterised into an image-only PDF (no text layer)."""
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument(str(source_pdf))
    image = pdf[0].render(scale=1).to_pil().convert("RGB")
    pdf.close()
    image.save(path, "PDF", resolution=72)
    return path


@pytest.fixture(scope="module")
def pdf_pages(tmp_path_factory):
    """One born-digital page, one image-only page and one whose text layer is not what is drawn."""
    root = tmp_path_factory.mktemp("pdfs")
    pdfs = root / "in"
    pdfs.mkdir()
    digital = _text_pdf(pdfs / "manual.pdf", "Getting started", BODY)
    _image_pdf(pdfs / "scan.pdf", digital)
    _text_pdf(pdfs / "hidden.pdf", "Hidden words", ["these words are not on the page"] * 3, invisible=True)
    _text_pdf(pdfs / "rotated.pdf", "Turned page", BODY, rotate=90)
    _text_pdf(pdfs / "empty.pdf", "", [])
    dataset = PageDataset(root / "pages")
    import_pdfs(pdfs, dataset.root, dpi=100)
    by_file = {page.source.split(":")[1].split("#")[0]: page for page in dataset.pages()}
    hidden = by_file["hidden.pdf"]  # paint ink where the (invisible) layer says nothing
    image = dataset.load_image(hidden).convert("L")
    pixels = np.asarray(image).copy()
    pixels[600:700, 80:600] = 0
    dataset.upsert([replace(hidden, image=dataset.save_image(hidden.page_id, Image.fromarray(pixels)))])
    report = preannotate_dataset(dataset, make_preannotator({"backend": "auto"}))
    assert not report.failed, report.failed
    return {name: dataset.get(page.page_id) for name, page in by_file.items()}, dataset


def test_a_born_digital_page_is_read_from_its_text_layer_exactly(pdf_pages):
    pages, _ = pdf_pages
    record = pages["manual.pdf"].meta["preannotation"]
    assert record["extra"]["source"] == TEXT_LAYER and record["confidence"] == 1.0
    assert record["markup"] == "# Getting started\n\n" + " ".join(BODY)
    target = page_with_target(pages["manual.pdf"])
    assert truth_of(target) == TEXT_LAYER


def test_pages_without_a_usable_text_layer_fall_back_to_ocr_with_the_reason(pdf_pages):
    pages, _ = pdf_pages
    scan = pages["scan.pdf"].meta["preannotation"]
    assert scan["extra"]["source"].startswith("ocr:rapidocr") and scan["extra"]["fallback_reason"] == "no text layer"
    assert "quick brown fox" in scan["markup"]  # RapidOCR read the pixels
    hidden = pages["hidden.pdf"].meta["preannotation"]
    assert hidden["extra"]["source"].startswith("ocr:") and "lines have ink under them" in hidden["extra"]["fallback_reason"]
    report = TargetReport()
    targets = [page_with_target(pages[name], report) for name in ("manual.pdf", "scan.pdf")]
    assert truth_of(targets[0]) == TEXT_LAYER and truth_of(targets[1]).startswith("preannotation:rapidocr")
    assert report.kept == {"text-layer": 1, "preannotation": 1}


def test_a_rotated_page_and_an_empty_page_get_a_stated_outcome_and_lose_nothing(pdf_pages):
    """A turned page (/Rotate 90): pdfium's character boxes stay unturned, so they lie off the ink
    and the page goes to OCR, which says why; an empty page: OCR finds nothing, so it has no
    target and the split drops it with a count."""
    pages, _ = pdf_pages
    rotated = pages["rotated.pdf"].meta["preannotation"]
    assert rotated["extra"]["source"].startswith("ocr:") and "have ink under them" in rotated["extra"]["fallback_reason"]
    assert "quick brown fox" in rotated["markup"]
    empty = pages["empty.pdf"].meta["preannotation"]
    assert empty["extra"]["fallback_reason"] == "no text layer" and empty["markup"] == ""
    report = TargetReport()
    assert page_with_target(pages["empty.pdf"], report) is None and report.dropped == {"empty pre-annotation": 1}
    assert len(pages) == 5  # nothing else of the batch was lost


def test_the_pdf_text_backend_refuses_a_page_without_a_text_layer(pdf_pages):
    from components.curation.preannotate.pdf_text import TextLayerUnusable

    pages, dataset = pdf_pages
    backend = make_preannotator({"backend": "pdf-text"})
    page = pages["scan.pdf"]
    with pytest.raises(TextLayerUnusable, match="no text layer"):
        backend.annotate_page(page, dataset.load_image(page))
    gone = replace(page, meta={**page.meta, "pdf_path": "/nonexistent/manual.pdf"})
    with pytest.raises(TextLayerUnusable, match="is gone"):
        backend.annotate_page(gone, dataset.load_image(page))


@pytest.fixture(scope="module")
def own_output_pages(curation_model_dir, tmp_path_factory):
    """Three synthetic pages: two pre-annotated by the tiny model with their own truth removed
    (as imported PDF pages are), one keeping its synthetic truth."""
    dataset = generate_dataset(tmp_path_factory.mktemp("own"), 3, seed=910, cfg=SyntheticConfig.preset("tiny"))
    pages = dataset.pages()
    imported = [replace(page, elements=[], markup_override=None) for page in pages[:2]]
    dataset.upsert(imported)
    annotator = make_preannotator({"backend": "model", "model_dir": str(curation_model_dir), "max_new_tokens": 12})
    preannotate_dataset(dataset, annotator, page_ids=[page.page_id for page in imported])
    targets = [page_with_target(page) for page in dataset.pages()]
    return dataset, [page for page in targets if page is not None]


def test_a_model_is_never_scored_against_its_own_pre_annotation(curation_model_dir, own_output_pages):
    dataset, pages = own_output_pages
    lineage = model_lineage(curation_model_dir)
    assert sum(written_by(truth_of(page), lineage) for page in pages) == 2
    engine = DecodingEngine.from_pretrained(curation_model_dir)
    params = [DecodeParams(decoder="ar", max_new_tokens=12)]
    report = evaluate_decoders(engine, dataset, params, pages=pages, lineage=lineage)
    assert report.n_pages == 1 and report.refused_own_output == 2 and report.truth == {"synthetic": 1}
    assert "truth: synthetic 1 (2 pages refused" in report.table()
    own = [page for page in pages if written_by(truth_of(page), lineage)]
    with pytest.raises(OwnOutputTruthError, match="all 2 pages"):
        evaluate_decoders(engine, dataset, params, pages=own, lineage=lineage)
    # another model may be graded on them: its lineage did not write them
    other = evaluate_decoders(engine, dataset, params, pages=own, lineage={"0123456789ab"})
    assert other.n_pages == 2 and other.truth and all(k.startswith("preannotation:docvlm:") for k in other.truth)


def test_a_trained_models_lineage_reaches_the_checkpoint_it_started_from(curation_model_dir, tokenizer, tmp_path):
    child = save_markup_model(new_tiny_model(tokenizer, seed=3), tokenizer, tmp_path / "child")
    (child / "training_meta.json").write_text(json.dumps({"init_model": str(curation_model_dir),
                                                          LINEAGE_KEY: sorted(model_lineage(curation_model_dir))}))
    grandchild = save_markup_model(new_tiny_model(tokenizer, seed=4), tokenizer, tmp_path / "grandchild")
    (grandchild / "training_meta.json").write_text(json.dumps({"init_model": str(child)}))
    parent = model_fingerprint(curation_model_dir)
    assert parent in model_lineage(child) and parent in model_lineage(grandchild)
    assert model_fingerprint(child) in model_lineage(grandchild)
    assert parent not in model_lineage(save_markup_model(new_tiny_model(tokenizer, seed=5), tokenizer, tmp_path / "x"))
    assert written_by(f"preannotation:docvlm:{parent}", model_lineage(grandchild))
    assert written_by(f"preannotation:auto(pdf-text-v1|docvlm:{parent})", {parent})


def test_unchanged_weights_register_no_version(curation_model_dir, tmp_path, monkeypatch):
    """The chain's output is the checkpoint it started from (every stage reverted): the
    evaluation still runs and reports, but nothing is registered, promoted or deployed."""
    import mlflow

    from components.pipeline import load_pipeline_config
    from lifecycle.evaluation import evaluate_and_register

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    pages = generate_dataset(tmp_path / "test", 2, seed=920, cfg=SyntheticConfig.preset("tiny"))
    cfg = load_pipeline_config("configs/pipeline/demo.yaml", {
        "training.base_model": str(curation_model_dir), "evaluation.pages_dir": str(pages.root),
        "evaluation.decoders": ["ar"], "evaluation.max_new_tokens": 8, "evaluation.formula_metric": "edit",
        "evaluation.model_name": "noop-test", "work_dir": str(tmp_path / "run")})
    result = evaluate_and_register(cfg, Path(curation_model_dir))
    assert result["unchanged"] and result["version"] is None and not result["promoted"]
    assert result["gate_failures"][0].startswith("nothing new to promote: the weights are those of starting checkpoint")
    assert result["truth"] == {"synthetic": 2}
    assert mlflow.MlflowClient().search_model_versions("name='noop-test'") == []
    copy = Path(shutil.copytree(curation_model_dir, tmp_path / "trained"))  # same weights, another folder
    assert evaluate_and_register(cfg, copy)["unchanged"]


def _signals(rng, n: int, confidence: float) -> dict[str, list[float]]:
    return {"mean_confidence": list(np.clip(rng.normal(confidence, 0.02, n), 0, 1)),
            "new_tokens": list(rng.normal(300, 30, n))}


def test_drift_needs_enough_pages_and_its_verdict_follows_both_tests():
    rng = np.random.default_rng(7)
    reference = _signals(rng, 300, 0.95)
    with pytest.raises(NotEnoughPagesError, match=f"not enough production pages: 4 < {MIN_VERDICT_PAGES}"):
        check_drift(reference, _signals(rng, 4, 0.5), min_production=4)  # the config cannot lower the floor
    same = check_drift(reference, _signals(rng, 60, 0.95))
    assert same.verdict == "none" and not same.drifted
    shifted = check_drift(reference, _signals(rng, 60, 0.80))
    assert shifted.verdict == "drift" and shifted.drifted
    assert "mean_confidence PSI" in shifted.summary() and "> 0.2" in shifted.summary() and "< 0.01" in shifted.summary()
    # PSI far over its threshold while KS does not reject: not "none"
    psi_only = check_drift(reference, _signals(rng, 60, 0.80), pvalue_threshold=1e-300)
    assert psi_only.verdict == "inconclusive" and not psi_only.drifted
    assert psi_only.as_dict()["psi_threshold"] == 0.2 and psi_only.as_dict()["pvalue_threshold"] == 1e-300


def test_the_pipeline_config_refuses_a_drift_window_too_small_for_a_verdict():
    from components.pipeline import PipelineConfigError, load_pipeline_config

    with pytest.raises(PipelineConfigError, match="min_production_pages"):
        load_pipeline_config("configs/pipeline/demo.yaml", {"monitoring.min_production_pages": 4})


# ---------------------------------------------------------------------------------------------
# Probes on a real Triton (the server module's fixtures: a throw-away registry and a Triton on free ports)
from tests.test_triton_server import MAX_TOKENS, client, png, registry, triton  # noqa: E402, F401


@pytest.mark.services
def test_the_platforms_own_probes_never_reach_the_request_log_or_the_metrics(triton, client, registry):  # noqa: F811
    """Probes in page and element mode, unary and streamed, leave no observation in any of the
    backend's series (elements and batch sizes included) and no request-log entry; real traffic does."""
    from components.data.synthetic import generate_page
    from monitoring.backend_metrics import parse_samples
    from monitoring.request_log import RequestLog

    probe, traffic = png(generate_page(501)[1]), png(generate_page(502)[1])

    def ours(samples) -> dict:  # every sample of the backend's own series, by name and labels
        return {key: value for key, value in samples.items() if key[0].startswith("docmarkup_")}

    before = ours(parse_samples(triton.metrics_text()))
    for parse in ("page", "elements"):
        client.transcribe(probe, decoder="ar", max_new_tokens=MAX_TOKENS, parse=parse, probe=True)
        with client.stream_transcribe(probe, decoder="ar", max_new_tokens=MAX_TOKENS, parse=parse, probe=True) as stream:
            probed = "".join(chunk.text for chunk in stream)
        assert probed  # a probe is answered like any request
    middle = ours(parse_samples(triton.metrics_text()))
    changed = {key for key in set(before) | set(middle) if before.get(key, 0.0) != middle.get(key, 0.0)}
    assert not changed, f"probes reached the metrics: {sorted(changed)[:5]}"
    served = client.transcribe(traffic, decoder="ar", max_new_tokens=MAX_TOKENS, parse="elements")
    after = ours(parse_samples(triton.metrics_text()))
    grown = {key[0] for key in after if after[key] != middle.get(key, 0.0)}
    assert {"docmarkup_request_latency_seconds_count", "docmarkup_elements_total",
            "docmarkup_batch_pages_count"} <= grown
    log = RequestLog(registry["root"] / "requests")
    logged = {entry.page_id for entry in log.entries()}
    assert RequestLog.page_id_for(probe) not in logged and RequestLog.page_id_for(traffic) in logged
    assert served.text is not None


@pytest.mark.services
def test_a_probe_without_the_platforms_key_is_refused_with_the_reason(triton, client):  # noqa: F811
    """Only the platform may hide a request from monitoring: a client's own PROBE is refused."""
    from components.data.synthetic import generate_page
    from deploy.triton.client import DocMarkupClient, TranscriptionError

    page = png(generate_page(503)[1])
    guesser = DocMarkupClient(triton.http_url, triton.grpc_url, timeout_s=300, probe_key="not-the-key")
    with pytest.raises(TranscriptionError, match="PROBE is reserved") as refused:
        guesser.transcribe(page, decoder="ar", max_new_tokens=MAX_TOKENS, probe=True)
    assert refused.value.status == "400"
    with pytest.raises(ValueError, match="probe key"):
        DocMarkupClient(triton.http_url, triton.grpc_url).transcribe(page, probe=True)
    key_file = VAR_DIR / "services" / triton.name / "probe.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and key_file.read_text().strip() == triton.probe_key


def test_services_refuse_a_port_another_process_holds():
    import socket

    from components.services.process import LOOPBACK, ServiceError
    from components.services.tracking import prefect_service

    with socket.socket() as holder:
        holder.bind((LOOPBACK, 0))
        holder.listen()
        port = holder.getsockname()[1]
        service = replace(prefect_service(port), name="prefect-port-test")  # never the project's own server
        with pytest.raises(ServiceError, match=f"port {port} on 127.0.0.1 is already in use"):
            service.start()
        assert not service.running()


def test_services_status_shows_where_each_service_listens(tmp_path):
    """The URL a service really started on (any port) is recorded at start and shown by status."""
    import sys

    from components.services.process import ManagedService, free_port, http_ok
    from lifecycle.services import status_line

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    service = ManagedService("status-url-test", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                             health=lambda: http_ok(url), cwd=tmp_path, ports=(port,), url=url)
    try:
        service.start()
        assert service.recorded_url() == url
    finally:
        service.stop()
        shutil.rmtree(service.state_dir, ignore_errors=True)
    assert service.recorded_url() is None  # a stopped service has no address
    assert status_line("mlflow").startswith("mlflow: ")


def test_prefect_port_is_configurable():
    from components.pipeline import load_pipeline_config
    from lifecycle.services import PORTS, main

    assert load_pipeline_config("configs/pipeline/demo.yaml", {"execution.prefect_port": 4321}).execution.prefect_port == 4321
    assert main(["status", "prefect", "--port", "4399"]) == 0 and PORTS["prefect"] == 4399
    PORTS["prefect"] = 4200




def test_test_splits_take_documents_with_independent_truth_first(tmp_path):
    """Ten new documents, half read from their text layer, half only pre-annotated by OCR: the
    test split fills with text-layer documents; the counts per split stay those of the hashes."""
    from components.curation.splits import make_splits
    from components.data.pages import Page

    store = PageDataset(tmp_path / "pages")
    pages = []
    for index in range(10):
        source = TEXT_LAYER if index % 2 else "ocr:rapidocr-3.10"
        record = {"markup": "words", "confidence": 0.9, "model_version": "auto", "elements": [],
                  "extra": {"source": source}}
        pages.append(Page(f"doc{index}-p1", "images/none.png", 32, 32, [],
                          meta={"document_id": f"pdf:{index}", "preannotation": record}))
    store.upsert(pages)
    ratios = {"train": 0.7, "test": 0.3}
    preferred = make_splits(store, ratios)
    in_test = [page.page_id for page in store.pages() if page.meta["split"] == "test"]
    assert in_test and all(int(page_id[3]) % 2 for page_id in in_test)  # text-layer documents only
    plain = PageDataset(tmp_path / "plain")
    plain.upsert([replace(page, meta={k: v for k, v in page.meta.items() if k != "split"}) for page in pages])
    by_hash = make_splits(plain, ratios, prefer_independent_test=False)
    assert preferred.counts() == by_hash.counts()
