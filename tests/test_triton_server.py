"""The docmarkup models on a real Triton Inference Server (2.51, CPU), called with tritonclient.

One server per module, on free ports, serving ``models:/<name>@champion`` from a throw-away
SQLite MLflow registry, stopped by PID at the end.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from PIL import Image

from components.data.synthetic import generate_page
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.services.process import VAR_DIR, ServiceError
from deploy.triton.client import DocMarkupClient, ServerBusyError, TranscriptionError
from deploy.triton.model_source import resolve_model
from deploy.triton.server import TritonPorts, start_triton
from models.loading import new_tiny_model, save_markup_model
from monitoring.backend_metrics import parse_samples, sample_value
from monitoring.request_log import RequestLog

pytestmark = pytest.mark.services

REGISTERED_NAME = "docmarkup-test"
MAX_TOKENS = 48


def chaotic_model(tokenizer, seed: int):
    """A tiny untrained DocVLM with large weights, so greedy outputs vary from token to token
    (a default-initialised one repeats one token, which would make stream/unary checks vacuous)."""
    model = new_tiny_model(tokenizer, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 3.0 / parameter[0].numel() ** 0.5)
    return model


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def metric_delta(before, after, name: str, **labels: str) -> float:
    """How much a scraped sample grew between two scrapes (absent counts as 0)."""
    return (sample_value(after, name, **labels) or 0.0) - (sample_value(before, name, **labels) or 0.0)


def throwaway_registry(root, experiment_name: str):
    """(client, experiment id, tracking URI) of a new SQLite MLflow store under ``root``; the client is
    bound to that store, so no global MLflow state changes."""
    from mlflow import MlflowClient

    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    return client, client.create_experiment(experiment_name, artifact_location=(root / "artifacts").as_uri()), tracking_uri


def register_folder(client, experiment_id: str, name: str, folder) -> str:
    """Log ``folder`` as a run's ``model`` artifact and register it as a new version of ``name``."""
    run = client.create_run(experiment_id)
    client.log_artifacts(run.info.run_id, str(folder), artifact_path="model")
    client.set_terminated(run.info.run_id)
    return str(client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id).version)


@pytest.fixture(scope="module")
def registry(tokenizer, tmp_path_factory):
    """Two registered versions with different weights; ``champion`` points at version 2."""
    root = tmp_path_factory.mktemp("mlflow")
    client, experiment, tracking_uri = throwaway_registry(root, "triton-test")
    client.create_registered_model(REGISTERED_NAME)
    folders = {}
    for seed in (1, 2):
        folder = save_markup_model(chaotic_model(tokenizer, seed), tokenizer, root / f"model-{seed}")
        folders[register_folder(client, experiment, REGISTERED_NAME, folder)] = folder
    client.set_registered_model_alias(REGISTERED_NAME, "champion", "2")
    return {"tracking_uri": tracking_uri, "folders": folders, "root": root}


@pytest.fixture(scope="module")
def triton(registry):
    name = f"triton-test-{os.getpid()}"
    server = start_triton(
        f"models:/{REGISTERED_NAME}@champion", ports=TritonPorts.free(), name=name,
        tracking_uri=registry["tracking_uri"], repository_dir=registry["root"] / "model_repository",
        model_cache_dir=registry["root"] / "model_cache", request_log_dir=registry["root"] / "requests",
    )
    print(f"\nTriton start-up (both models loaded): {server.startup_seconds:.1f}s")
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(VAR_DIR / "services" / name, ignore_errors=True)


@pytest.fixture(scope="module")
def client(triton) -> DocMarkupClient:
    return DocMarkupClient(triton.http_url, triton.grpc_url, timeout_s=300, probe_key=triton.probe_key)


@pytest.fixture(scope="module")
def page() -> bytes:
    return png(generate_page(21)[1])


def test_server_is_ready_with_both_models(triton, client):
    assert triton.ready() and client.ready()
    import tritonclient.http as httpclient

    http = httpclient.InferenceServerClient(triton.http_url)
    try:
        stream_config = http.get_model_config("docmarkup_stream")
        assert stream_config["model_transaction_policy"]["decoupled"] is True
        assert http.get_server_metadata()["version"].startswith("2.")
    finally:
        http.close()


def test_model_control_needs_the_admin_key(triton, client):
    """A load may carry a model.py override (code run inside the server): without the key every
    model-control call is refused on both protocols and the served models stay up; with it, it works."""
    import base64
    import stat

    import requests
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    base = f"http://{triton.http_url}/v2/repository"
    override = {"parameters": {"config": "{}", "file:1/model.py": base64.b64encode(b"raise SystemExit(1)").decode()}}
    for url, body in [(f"{base}/models/docmarkup/load", override), (f"{base}/models/docmarkup/unload", {}),
                      (f"{base}/index", {})]:
        refused = requests.post(url, json=body, headers={"Content-Type": "text/plain"}, timeout=30)
        assert refused.status_code in (401, 403), (url, refused.status_code, refused.text)
        wrong = requests.post(url, json=body, headers={"docmarkup-admin-key": "guess"}, timeout=30)
        assert wrong.status_code in (401, 403), (url, wrong.status_code)
    grpc = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        with pytest.raises(InferenceServerException):
            grpc.unload_model("docmarkup")
        assert grpc.is_model_ready("docmarkup")
        index = grpc.get_model_repository_index(headers=triton.admin_headers("grpc"), as_json=True)
        assert {m["name"] for m in index["models"]} >= {"docmarkup", "docmarkup_stream"}
    finally:
        grpc.close()
    allowed = requests.post(f"{base}/index", json={}, headers=triton.admin_headers(), timeout=30)
    assert allowed.status_code == 200 and {m["name"] for m in allowed.json()} >= {"docmarkup", "docmarkup_stream"}
    assert client.ready()
    key_file = VAR_DIR / "services" / triton.name / "admin.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    log = triton.service.log_file
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert key_file.read_text().strip() not in log.read_text()


def test_champion_alias_is_resolved_to_its_version(triton, client, registry, page):
    result = client.transcribe(page, decoder="ar", max_new_tokens=MAX_TOKENS)
    assert result.stats["model"]["registered_name"] == REGISTERED_NAME
    assert (result.stats["model"]["alias"], result.stats["model"]["version"]) == ("champion", "2")
    # Same text as version 2 decoded in-process, and not version 1's.
    params = DecodeParams(decoder="ar", max_new_tokens=MAX_TOKENS)
    image = Image.open(io.BytesIO(page)).convert("RGB")
    expected = {v: DecodingEngine.from_pretrained(f).generate([image], params)[0] for v, f in registry["folders"].items()}
    assert result.text == expected["2"].text and result.token_ids == expected["2"].token_ids
    assert result.text != expected["1"].text
    # The resolver used by the backend, called directly, agrees.
    resolved = resolve_model(f"models:/{REGISTERED_NAME}@champion", registry["tracking_uri"], registry["root"] / "model_cache")
    assert resolved.version == "2" and (resolved.path / "config.json").exists()


def test_http_infer_returns_markup_text_and_stats(client, page):
    result = client.transcribe(page, max_new_tokens=MAX_TOKENS)
    assert result.text.strip()
    assert len(result.token_ids) == result.stats["new_tokens"] > 0
    assert result.stats["forward_passes"] > 0 and result.stats["params"]["decoder"] == "ar"
    assert 0.0 < result.stats["mean_confidence"] <= 1.0


@pytest.mark.parametrize("decoder", ["ar", "sdb"])
def test_stream_concatenates_to_the_unary_result(client, page, decoder):
    unary = client.transcribe(page, decoder=decoder, max_new_tokens=MAX_TOKENS)
    with client.stream_transcribe(page, decoder=decoder, max_new_tokens=MAX_TOKENS) as stream:
        chunks = list(stream)
    assert len(chunks) > 1
    assert "".join(chunk.text for chunk in chunks) == unary.text
    assert [t for chunk in chunks for t in chunk.token_ids] == unary.token_ids
    assert [chunk.forward_pass for chunk in chunks] == sorted({chunk.forward_pass for chunk in chunks})
    assert all(len(chunk.confidences) == len(chunk.token_ids) for chunk in chunks)
    assert stream.stats is not None and stream.stats["new_tokens"] == unary.stats["new_tokens"]
    assert stream.stats["forward_passes"] == unary.stats["forward_passes"]


def test_decoder_and_threshold_are_chosen_per_request(client, page):
    ar = client.transcribe(page, decoder="ar", max_new_tokens=MAX_TOKENS)
    sdb = client.transcribe(page, decoder="sdb", window=8, max_new_tokens=MAX_TOKENS)
    assert ar.stats["params"]["decoder"] == "ar" and sdb.stats["params"]["window"] == 8
    assert ar.stats["forward_passes"] == ar.stats["new_tokens"]  # AR: one token per forward
    assert sdb.token_ids == ar.token_ids  # greedy SDB is exact, whatever it accepts
    ppc = client.transcribe(page, decoder="ppc", span=8, threshold=1e-6, max_new_tokens=MAX_TOKENS)
    assert ppc.stats["tokens_per_forward"] > 2 * ar.stats["tokens_per_forward"]  # every guess is "confident"
    strict = client.transcribe(page, decoder="block", block_length=8, threshold=1.0, max_new_tokens=16)
    loose = client.transcribe(page, decoder="block", block_length=8, threshold=0.01, max_new_tokens=16)
    assert strict.stats["params"]["threshold"] == 1.0 and loose.stats["params"]["threshold"] == pytest.approx(0.01)
    assert loose.stats["forward_passes"] < strict.stats["forward_passes"]


def test_corrupt_image_gets_a_clear_error_and_the_server_keeps_serving(triton, client, page):
    with pytest.raises(TranscriptionError, match="not a readable image") as unary_error:
        client.transcribe(b"\x89PNG\r\n\x1a\n this is not a page")
    assert unary_error.value.status == "400"
    assert "object at 0x" not in str(unary_error.value) and str(unary_error.value).startswith("input IMAGE (")
    with pytest.raises(TranscriptionError, match="not a readable image") as stream_error, \
            client.stream_transcribe(b"") as stream:
        list(stream)
    assert stream_error.value.status == "400"  # the stream carries the status too, not None
    with pytest.raises(TranscriptionError, match="DECODER must be one of"):
        client.transcribe(page, decoder="beam")
    assert triton.ready()
    assert client.transcribe(page, max_new_tokens=4).stats["new_tokens"] == 4


def test_a_window_beyond_the_models_positions_is_a_400_naming_it_counted_under_its_decoder(triton, client, page):
    before = parse_samples(triton.metrics_text())
    with pytest.raises(TranscriptionError, match="window 1500 is too large for this model") as error:
        client.transcribe(page, decoder="sdb", window=1500)
    assert error.value.status == "400"
    with pytest.raises(TranscriptionError, match="DECODER must be one of"):
        client.transcribe(page, decoder="beam")
    time.sleep(1.5)  # Triton publishes metrics every second
    after = parse_samples(triton.metrics_text())
    invalid = {decoder: metric_delta(before, after, "docmarkup_requests_total", model="docmarkup", decoder=decoder,
                                     outcome="invalid") for decoder in ("sdb", "unknown", "ar")}
    assert invalid == {"sdb": 1.0, "unknown": 1.0, "ar": 0.0}


def test_concurrent_requests_are_batched_and_each_gets_its_own_page(triton, client, registry):
    pages = [png(generate_page(seed)[1]) for seed in (31, 32, 33)]
    requests = [(pages[0], "ar"), (pages[1], "sdb"), (pages[1], "ar"), (b"not an image", "ar"),
                (pages[2], "ar"), (pages[2], "sdb"), (pages[0], "sdb")]
    labels = {"model": "docmarkup", "version": "1"}
    before = parse_samples(triton.metrics_text())
    start = threading.Barrier(len(requests))

    def send(image: bytes, decoder: str):
        start.wait()
        try:
            return client.transcribe(image, decoder=decoder, max_new_tokens=MAX_TOKENS)
        except TranscriptionError as exc:
            return exc

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda request: send(*request), requests))
    after = parse_samples(triton.metrics_text())

    engine = DecodingEngine.from_pretrained(registry["folders"]["2"])
    for (image, decoder), answer in zip(requests, answers, strict=True):
        if image == b"not an image":  # a bad page is answered alone; the others in its batch still decode
            assert isinstance(answer, TranscriptionError) and "not a readable image" in str(answer)
            continue
        [alone] = engine.generate([Image.open(io.BytesIO(image)).convert("RGB")],
                                  DecodeParams(decoder=decoder, max_new_tokens=MAX_TOKENS))
        assert answer.token_ids == alone.token_ids and answer.text == alone.text
        assert answer.stats["params"]["decoder"] == decoder
    assert max(answer.stats["batch_size"] for answer in answers if not isinstance(answer, Exception)) > 1

    assert metric_delta(before, after, "nv_inference_request_success", **labels) == len(requests)
    # Triton grouped them into fewer executions.
    assert metric_delta(before, after, "nv_inference_exec_count", **labels) < len(requests)
    # Continuous batching counts each decoded page once, with the rows decoding when it ended.
    batches = {decoder: metric_delta(before, after, "docmarkup_batch_pages_count", model="docmarkup", decoder=decoder)
               for decoder in ("ar", "sdb")}
    assert batches == {"ar": 3, "sdb": 3}


def test_a_burst_past_the_queue_is_refused_at_once_and_every_accepted_page_is_answered(triton, client, registry):
    """48 requests at once against 8 decoding rows and 32 waiting (the template's admission limit):
    the excess is refused at once with the reason while the rest decode, every accepted page is
    answered with its own reading, and the server answers normally right after."""
    pages = [png(generate_page(seed)[1]) for seed in range(40, 48)]
    burst = 48
    start = threading.Barrier(burst + 1)
    outcomes: list = [None] * burst

    def send(index: int) -> None:
        start.wait()
        sent = time.perf_counter()
        try:
            answer = client.transcribe(pages[index % len(pages)], max_new_tokens=256)
        except TranscriptionError as exc:
            answer = exc
        outcomes[index] = (answer, time.perf_counter() - sent)

    with ThreadPoolExecutor(burst) as pool:
        for index in range(burst):
            pool.submit(send, index)
        start.wait()
    refused = [(answer, seconds) for answer, seconds in outcomes if isinstance(answer, Exception)]
    accepted = [answer for answer, _ in outcomes if not isinstance(answer, Exception)]
    print(f"\nburst of {burst}: {len(accepted)} accepted, {len(refused)} refused; slowest refusal "
          f"{max((t for _, t in refused), default=0) * 1000:.0f} ms, slowest answer "
          f"{max(t for a, t in outcomes if not isinstance(a, Exception)):.1f} s")
    assert refused and all(isinstance(answer, ServerBusyError) for answer, _ in refused), refused[:3]
    assert all("queue" in str(answer).lower() for answer, _ in refused)
    assert max(seconds for _, seconds in refused) < 2.0  # told at once, not after the queue drained
    assert len(accepted) + len(refused) == burst and len(accepted) >= 32
    engine = DecodingEngine.from_pretrained(registry["folders"]["2"])
    for index in (0, 1, 2):  # accepted pages carry their own reading, not a neighbour's
        answer = outcomes[index][0]
        if isinstance(answer, Exception):
            continue
        [alone] = engine.generate([Image.open(io.BytesIO(pages[index])).convert("RGB")], DecodeParams(max_new_tokens=256))
        assert answer.token_ids == alone.token_ids
    assert client.ready()
    assert client.transcribe(pages[0], max_new_tokens=MAX_TOKENS).token_ids


def _dense_page(seeds: tuple[int, ...]) -> bytes:
    """Several standard synthetic pages stacked into one tall page."""
    from components.data.synthetic import SyntheticConfig

    parts = [generate_page(seed, cfg=SyntheticConfig.preset("standard"))[1] for seed in seeds]
    page = Image.new("RGB", (max(p.width for p in parts), sum(p.height for p in parts)), "white")
    top = 0
    for part in parts:
        page.paste(part, (0, top))
        top += part.height
    return png(page)


@pytest.mark.services
def test_concurrent_element_pages_are_all_admitted_and_each_answered_with_its_own_reading(triton, client, registry):
    """Twelve tall pages at once in element mode (three pages stacked in each): admission counts
    pages, not the crops they queue for rows, so none is refused below the 32 waiting pages, and each
    answer is its own page's reading (one checked against the engine reading it alone). That the
    scheduler never counts an accepted page's pieces: tests/test_scheduler.py."""
    from components.parsing import ParseSettings, read_pages

    pages = [_dense_page((seed, seed + 1, seed + 2)) for seed in range(60, 72)]
    start = threading.Barrier(len(pages))

    def send(image: bytes):
        start.wait()
        try:
            return client.transcribe(image, parse="elements", max_new_tokens=8)
        except TranscriptionError as exc:
            return exc

    with ThreadPoolExecutor(len(pages)) as pool:
        answers = list(pool.map(send, pages))
    refused = [answer for answer in answers if isinstance(answer, Exception)]
    assert not refused, refused[:2]
    assert all(answer.stats["parse"] == "elements" for answer in answers)
    engine = DecodingEngine.from_pretrained(registry["folders"]["2"])
    [alone] = read_pages(engine, [Image.open(io.BytesIO(pages[0])).convert("RGB")], DecodeParams(max_new_tokens=8),
                         ParseSettings("elements", "rapid-layout"))
    assert answers[0].text == alone.text


def test_a_page_past_its_own_timeout_is_answered_504_and_the_rows_ahead_are_not_disturbed(client, registry):
    """Eight long pages fill the rows; a ninth that allows itself 0.2 s ends waiting, told why."""
    pages = [png(generate_page(seed)[1]) for seed in range(60, 68)]
    with ThreadPoolExecutor(8) as pool:
        longs = [pool.submit(client.transcribe, page, max_new_tokens=256) for page in pages]
        time.sleep(0.3)
        with pytest.raises(TranscriptionError, match="timed out") as refused:
            client.transcribe(pages[0], max_new_tokens=256, timeout_s=0.2)
        answers = [future.result() for future in longs]
    assert refused.value.status == "504"
    alone = [client.transcribe(page, max_new_tokens=256) for page in pages]
    assert [answer.token_ids for answer in answers] == [answer.token_ids for answer in alone]
    assert client.transcribe(pages[0], max_new_tokens=256).token_ids == alone[0].token_ids  # it serves on


def test_transcribe_many_keeps_order_and_reports_a_bad_page_in_its_place(client, page):
    pages = [page, b"not an image", png(generate_page(51)[1])]
    results = client.transcribe_many(pages, return_exceptions=True, decoder="sdb", max_new_tokens=MAX_TOKENS)
    assert isinstance(results[1], TranscriptionError) and "not a readable image" in str(results[1])
    for image, result in zip(pages[::2], results[::2], strict=True):
        assert result.token_ids == client.transcribe(image, decoder="sdb", max_new_tokens=MAX_TOKENS).token_ids
    with pytest.raises(TranscriptionError, match="not a readable image"):
        client.transcribe_many(pages, decoder="sdb", max_new_tokens=MAX_TOKENS)


def test_concurrent_streams_share_a_batch_and_a_cancelled_one_leaves_the_others_intact(triton, client, registry):
    pages = [png(generate_page(seed)[1]) for seed in (41, 42, 43)]
    requests = [(pages[0], "ar", False), (pages[1], "ar", True), (pages[2], "ar", False), (pages[2], "sdb", False)]
    labels = {"model": "docmarkup_stream", "version": "1"}
    before = parse_samples(triton.metrics_text())
    start = threading.Barrier(len(requests))

    def stream(image: bytes, decoder: str, cancel: bool):
        start.wait()
        with client.stream_transcribe(image, decoder=decoder, max_new_tokens=MAX_TOKENS) as page_stream:
            for _chunk in page_stream:
                if cancel:
                    page_stream.cancel()
        return page_stream

    with ThreadPoolExecutor(len(requests)) as pool:
        streams = list(pool.map(lambda request: stream(*request), requests))
    engine = DecodingEngine.from_pretrained(registry["folders"]["2"])
    for (image, decoder, cancel), page_stream in zip(requests, streams, strict=True):
        if cancel:
            assert page_stream.stats is None and len(page_stream.chunks) == 1
            continue
        [alone] = engine.generate([Image.open(io.BytesIO(image)).convert("RGB")],
                                  DecodeParams(decoder=decoder, max_new_tokens=MAX_TOKENS))
        assert page_stream.text == alone.text
        assert [t for chunk in page_stream.chunks for t in chunk.token_ids] == alone.token_ids
        assert page_stream.stats["forward_passes"] == alone.stats.forward_passes
    assert max(s.stats["batch_size"] for s in streams if s.stats) > 1
    after = parse_samples(triton.metrics_text())
    assert metric_delta(before, after, "nv_inference_exec_count", **labels) < len(requests)


def test_cancelling_a_stream_stops_decoding_on_the_server(triton, client, page):
    before = parse_samples(triton.metrics_text())
    budget = 400
    with client.stream_transcribe(page, decoder="ar", max_new_tokens=budget) as stream:
        for count, _chunk in enumerate(stream, start=1):
            if count == 2:
                stream.cancel()
    labels = {"model": "docmarkup_stream", "decoder": "ar"}
    deadline = time.monotonic() + 60
    cancelled = 0.0
    while time.monotonic() < deadline:
        after = parse_samples(triton.metrics_text())
        cancelled = metric_delta(before, after, "docmarkup_requests_total", outcome="cancelled", **labels)
        if cancelled:
            break
        time.sleep(0.5)
    assert cancelled == 1
    forwards = metric_delta(before, after, "docmarkup_forward_passes_total", **labels)
    assert 2 <= forwards < budget
    assert client.transcribe(page, max_new_tokens=4).text  # the instance is free again


def test_metrics_endpoint_has_backend_and_triton_metrics(triton, client, page):
    labels = {"model": "docmarkup", "decoder": "ppc"}
    before = parse_samples(triton.metrics_text())

    def delta(after, name, **extra):
        return metric_delta(before, after, name, **labels, **extra)

    result = client.transcribe(page, decoder="ppc", span=4, max_new_tokens=12)
    after = parse_samples(triton.metrics_text())
    stats = result.stats
    assert delta(after, "docmarkup_requests_total", outcome="truncated" if stats["truncated"] else "ok") == 1
    assert delta(after, "docmarkup_request_latency_seconds_count") == 1
    assert delta(after, "docmarkup_request_latency_seconds_sum") == pytest.approx(stats["latency_s"])
    assert delta(after, "docmarkup_tokens_per_forward_sum") == pytest.approx(stats["tokens_per_forward"])
    assert delta(after, "docmarkup_acceptance_length_count") == stats["forward_passes"]
    assert delta(after, "docmarkup_acceptance_length_sum") == sum(stats["accepted_lengths"])
    assert delta(after, "docmarkup_mean_confidence_sum") == pytest.approx(stats["mean_confidence"], rel=1e-6)
    assert delta(after, "docmarkup_generated_tokens_total") == stats["new_tokens"]
    assert delta(after, "docmarkup_forward_passes_total") == stats["forward_passes"]
    assert delta(after, "docmarkup_acceptance_length_bucket", le="+Inf") == stats["forward_passes"]
    # Triton's own per-model metrics are on the same endpoint, counting the same request.
    triton_labels = {"model": "docmarkup", "version": "1"}
    successes = [sample_value(samples, "nv_inference_request_success", **triton_labels) for samples in (before, after)]
    assert successes[1] - successes[0] == 1
    assert sample_value(after, "nv_inference_request_failure", reason="BACKEND", **triton_labels) is not None
    assert sample_value(after, "nv_inference_compute_infer_duration_us", **triton_labels) > 0
    assert sample_value(after, "nv_cpu_utilization") is not None


def test_element_mode_runs_layout_in_the_backend_and_answers_every_element(triton, client, registry, page):
    """``PARSE=elements``: the same parse as the engine's locally, per-element metrics, a stream
    that concatenates to the unary text, and an unknown mode refused with a 400."""
    from components.parsing import make_layout, parse

    engine = DecodingEngine.from_pretrained(registry["folders"]["2"])
    local = parse(Image.open(io.BytesIO(page)), engine, make_layout("rapid-layout"), DecodeParams(max_new_tokens=12))
    assert local.decoded, "rapid-layout should find regions on this page"
    before = parse_samples(triton.metrics_text())
    served = client.transcribe(page, parse="elements", max_new_tokens=12)
    after = parse_samples(triton.metrics_text())
    assert served.stats["parse"] == "elements"
    assert [e["markup"] for e in served.stats["elements"]] == [e.markup for e in local.elements]
    assert served.text == local.markup and served.token_ids == [t for e in local.decoded for t in e.token_ids]
    decoded = sum(metric_delta(before, after, "docmarkup_elements_total", model="docmarkup", decoder="ar",
                               category=category, outcome="decoded")
                  for category in {e.category for e in local.decoded})
    assert decoded == len(local.decoded)
    with client.stream_transcribe(page, parse="elements", max_new_tokens=12) as stream:
        chunks = list(stream)
    assert "".join(chunk.text for chunk in chunks) == served.text
    # Both answers are logged with the served boxes (what a page sent back for review shows).
    logged = [e for e in RequestLog(registry["root"] / "requests").entries() if e.page_id == RequestLog.page_id_for(page)]
    boxes = [[round(v, 1) for v in e.box] for e in local.elements if not e.error]
    assert len(logged) >= 2 and all([e["box"] for e in entry.elements] == boxes for entry in logged[-2:])
    with pytest.raises(TranscriptionError) as refused:
        client.transcribe(page, parse="columns")
    assert refused.value.status == "400" and "PARSE must be one of page, elements" in str(refused.value)


def test_served_pages_are_logged_for_drift_checks_and_feedback(client, registry):
    image = png(generate_page(77)[1])
    unary = client.transcribe(image, decoder="sdb", max_new_tokens=MAX_TOKENS)
    with client.stream_transcribe(image, decoder="ar", max_new_tokens=MAX_TOKENS) as stream:
        streamed = "".join(chunk.text for chunk in stream)
    log = RequestLog(registry["root"] / "requests")
    entries = [e for e in log.entries() if e.page_id == RequestLog.page_id_for(image)]
    assert [(e.decoder, e.text) for e in entries] == [("sdb", unary.text), ("ar", streamed)]
    assert entries[0].new_tokens == unary.stats["new_tokens"] and entries[0].model_version == "2"
    assert entries[0].mean_confidence == pytest.approx(unary.stats["mean_confidence"], rel=1e-6)
    if entries[0].mean_confidence < log.keep_images_below:  # an untrained model is unsure: its page is kept
        assert log.image_path(entries[0]).read_bytes() == image


@pytest.mark.slow
def test_promoting_another_version_and_reloading_serves_it(triton, client, registry, page):
    from mlflow import MlflowClient

    registry_client = MlflowClient(tracking_uri=registry["tracking_uri"], registry_uri=registry["tracking_uri"])
    registry_client.set_registered_model_alias(REGISTERED_NAME, "champion", "1")
    try:
        triton.reload_models()
        result = client.transcribe(page, decoder="ar", max_new_tokens=MAX_TOKENS)
        with client.stream_transcribe(page, decoder="ar", max_new_tokens=MAX_TOKENS) as stream:
            streamed = "".join(chunk.text for chunk in stream)
    finally:
        registry_client.set_registered_model_alias(REGISTERED_NAME, "champion", "2")
    assert result.stats["model"]["version"] == "1" and stream.stats["model"]["version"] == "1"
    image = Image.open(io.BytesIO(page)).convert("RGB")
    [expected] = DecodingEngine.from_pretrained(registry["folders"]["1"]).generate(
        [image], DecodeParams(decoder="ar", max_new_tokens=MAX_TOKENS))
    assert result.text == streamed == expected.text


@pytest.mark.slow
def test_a_missing_alias_fails_start_up_with_the_reason(registry):
    name = f"triton-bad-{os.getpid()}"
    try:
        with pytest.raises(ServiceError, match="alias nonexistent not found"):
            start_triton(
                f"models:/{REGISTERED_NAME}@nonexistent", ports=TritonPorts.free(), name=name,
                tracking_uri=registry["tracking_uri"], repository_dir=registry["root"] / "bad_repository",
                model_cache_dir=registry["root"] / "model_cache",
            )
    finally:
        shutil.rmtree(VAR_DIR / "services" / name, ignore_errors=True)

