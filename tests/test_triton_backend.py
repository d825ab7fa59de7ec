"""The Triton deployment's plain-Python parts, without a server: wire protocol, repository,
stream accounting, runtime layout and client-side errors."""

from __future__ import annotations

import io
import subprocess

import numpy as np
import pytest
from PIL import Image

from components.data.pages import InvalidPageError
from components.data.synthetic import generate_page
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.services.process import free_port
from deploy.triton import protocol
from deploy.triton.client import DocMarkupClient, TritonUnavailableError, request_values
from deploy.triton.model_source import ModelSourceError, resolve_model
from deploy.triton.repository import MODEL_NAMES, materialize_repository, read_parameters, set_parameters
from deploy.triton.server import TritonDistribution, prepare_runtime, remove_shared_memory
from models.loading import new_tiny_model, save_markup_model
from monitoring.backend_metrics import parse_samples, sample_value


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    save_markup_model(new_tiny_model(tokenizer), tokenizer, path)
    return path


# ----- request parsing ----------------------------------------------------------------------------
def test_params_default_to_the_deployment_decoder_and_engine_defaults():
    params = protocol.decode_params_from_inputs({"IMAGE": np.array([b"x"], dtype=object)}, default_decoder="sdb")
    assert params == DecodeParams(decoder="sdb")


def test_params_come_from_typed_one_element_inputs():
    inputs = request_values(
        b"png", decoder="block", threshold=0.75, window=5, block_length=8, span=4, max_new_tokens=77,
        temperature=0.5, top_k=3, seed=9,
    )
    params = protocol.decode_params_from_inputs(inputs)
    assert params == DecodeParams(decoder="block", threshold=0.75, window=5, block_length=8, span=4,
                                  max_new_tokens=77, temperature=0.5, top_k=3, seed=9)
    assert inputs["THRESHOLD"].dtype == np.float32 and inputs["SEED"].dtype == np.int64


@pytest.mark.parametrize(("inputs", "message"), [
    ({"DECODER": np.array([b"beam"], dtype=object)}, "DECODER must be one of ar, sdb, block, ppc"),
    ({"THRESHOLD": np.array([1.5], dtype=np.float32)}, "threshold must be in"),
    ({"THRESHOLD": np.array([np.nan], dtype=np.float32)}, "THRESHOLD must be a finite number"),
    ({"WINDOW": np.array([1, 2], dtype=np.int32)}, "WINDOW must hold exactly one value"),
    ({"MAX_NEW_TOKENS": np.array([5000], dtype=np.int32)}, "exceeds this deployment's limit 2048"),
    ({"SPAN": np.array([0], dtype=np.int32)}, "span must be >= 1"),
])
def test_bad_parameters_are_request_errors_with_the_reason(inputs, message):
    with pytest.raises(protocol.RequestError, match=message):
        protocol.decode_params_from_inputs(inputs)


def test_image_input_decodes_pages_and_rejects_corrupt_ones():
    _, page = generate_page(1)
    image = protocol.image_from_input(np.array([png_bytes(page)], dtype=object))
    assert image.size == page.size
    with pytest.raises(InvalidPageError, match="not a readable image"):
        protocol.image_from_input(np.array([b"\x89PNG\r\n\x1a\n truncated"], dtype=object))
    with pytest.raises(InvalidPageError):
        protocol.image_from_input(np.array([b""], dtype=object))
    with pytest.raises(protocol.RequestError, match="IMAGE is required"):
        protocol.image_from_input(None)
    from tests.test_pdf_loader import bomb_png

    with pytest.raises(InvalidPageError, match="over the 80M-pixel limit"):  # an INVALID_ARG answer (400)
        protocol.image_from_input(np.array([bomb_png()], dtype=object))


def test_client_rejects_unknown_options_before_sending():
    with pytest.raises(TypeError, match="unknown decoding options"):
        request_values(b"png", beam_width=4)


# ----- stream accounting matches the engine's own -------------------------------------------------
@pytest.mark.parametrize("decoder", ["ar", "sdb", "ppc", "block"])
def test_stream_accounting_rebuilds_the_engine_stats(model_dir, decoder):
    engine = DecodingEngine.from_pretrained(model_dir)
    image = generate_page(4)[1]
    params = DecodeParams(decoder=decoder, max_new_tokens=24)
    [result] = engine.generate([image], params)
    accounting = protocol.StreamAccounting()
    text = ""
    for event in engine.stream([image], params):
        accounting.add(event)
        text += event.text
    assert text == result.text
    assert accounting.forward_passes == result.stats.forward_passes
    assert accounting.new_tokens == result.stats.new_tokens
    assert accounting.accepted_lengths == result.stats.accepted_lengths  # one event per forward, exact
    assert accounting.mean_confidence == pytest.approx(result.stats.mean_confidence)
    assert (accounting.finished, accounting.truncated) == (result.finished, result.truncated)


# ----- model repository ---------------------------------------------------------------------------
def test_materialized_repository_points_both_models_at_the_model(model_dir, tmp_path):
    repository = materialize_repository(
        "models:/docmarkup@champion", tmp_path / "repo", tracking_uri="sqlite:///x.db", default_decoder="sdb",
        instance_count=2, model_cache_dir=tmp_path / "cache",
    )
    for model in MODEL_NAMES:
        text = (repository / model / "config.pbtxt").read_text()
        assert read_parameters(text) == {
            "model_uri": "models:/docmarkup@champion", "mlflow_tracking_uri": "sqlite:///x.db", "device": "cpu",
            "default_decoder": "sdb", "default_parse": "auto", "layout": "rapid-layout", "max_new_tokens_limit": "2048", "model_cache_dir": str(tmp_path / "cache"),
            "torch_threads": "1", "batching": "continuous", "overlap_prefill": "true", "max_waiting": "32", "engine_step": "default", "request_log_dir": "", "request_log_max_image_mb": "1024.0",
            "request_log_retention_days": "30.0", "probe_key_file": "",
        }
        assert "count: 2" in text
        assert (repository / model / "1" / "model.py").read_text().count("deploy.triton.backend") == 1
    assert "decoupled: true" in (repository / "docmarkup_stream" / "config.pbtxt").read_text()
    local = materialize_repository(model_dir, tmp_path / "repo")  # rewritten in place
    assert read_parameters((local / "docmarkup" / "config.pbtxt").read_text())["model_uri"] == str(model_dir)


def test_a_cuda_device_gives_gpu_instances_on_that_gpu(model_dir, tmp_path):
    """``device: cuda:1`` gives KIND_GPU instances on GPU 1 (Triton then says which GPU each instance
    has, and the backend puts its engine there); an unknown device is refused before writing."""
    from deploy.triton.repository import instance_device

    repository = materialize_repository(model_dir, tmp_path / "repo", device="cuda:1", instance_count=2)
    for model in MODEL_NAMES:
        text = (repository / model / "config.pbtxt").read_text()
        assert "instance_group [ { kind: KIND_GPU count: 2 gpus: [ 1 ] } ]" in text and "KIND_CPU" not in text
        assert read_parameters(text)["device"] == "cuda:1"
    assert "KIND_CPU count: 1" in (materialize_repository(model_dir, tmp_path / "cpu") / "docmarkup" / "config.pbtxt").read_text()
    with pytest.raises(ValueError, match="not cpu, cuda or cuda:N"):
        materialize_repository(model_dir, tmp_path / "bad", device="gpu0")
    assert instance_device("cuda:1", {"model_instance_kind": "GPU", "model_instance_device_id": "1"}) == "cuda:1"
    assert instance_device("cuda", {"model_instance_kind": "GPU", "model_instance_device_id": "3"}) == "cuda:3"
    assert instance_device("cpu", {"model_instance_kind": "CPU"}) == "cpu" and instance_device(None, {}) == "cpu"


def test_repository_refuses_a_folder_without_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        materialize_repository(tmp_path, tmp_path / "repo")
    with pytest.raises(ValueError, match="default_decoder"):
        materialize_repository("models:/m@champion", tmp_path / "repo", default_decoder="beam")


def test_batch_size_is_set_on_both_models_and_zero_drops_the_batcher(tmp_path):
    batched = materialize_repository("models:/m@champion", tmp_path / "a", max_batch_size=32)
    for model in MODEL_NAMES:
        config = (batched / model / "config.pbtxt").read_text()
        assert "max_batch_size: 32" in config and "dynamic_batching" in config
    plain = materialize_repository("models:/m@champion", tmp_path / "b", max_batch_size=0)
    for model in MODEL_NAMES:
        config = (plain / model / "config.pbtxt").read_text()
        assert "max_batch_size: 0" in config and "dynamic_batching" not in config
    assert "decoupled: true" in (plain / "docmarkup_stream" / "config.pbtxt").read_text()
    assert "default_queue_policy" not in (plain / "docmarkup" / "config.pbtxt").read_text()  # the whole batcher
    with pytest.raises(ValueError, match="max_batch_size"):
        materialize_repository("models:/m@champion", tmp_path / "c", max_batch_size=-1)


def test_the_queue_limit_is_set_on_both_models_and_refuses_instead_of_queueing(tmp_path):
    limited = materialize_repository("models:/m@champion", tmp_path / "a", max_queue_size=4)
    for model in MODEL_NAMES:
        config = (limited / model / "config.pbtxt").read_text()
        assert "max_queue_size: 4" in config and "timeout_action: REJECT" in config
    default = (materialize_repository("models:/m@champion", tmp_path / "b") / "docmarkup" / "config.pbtxt").read_text()
    assert "max_queue_size: 32" in default
    with pytest.raises(ValueError, match="max_queue_size"):
        materialize_repository("models:/m@champion", tmp_path / "c", max_queue_size=-1)


def test_batch_groups_join_equal_unseeded_requests_in_arrival_order():
    ar, sdb = DecodeParams(decoder="ar"), DecodeParams(decoder="sdb", window=8)
    seeded = DecodeParams(decoder="sdb", temperature=1.0, seed=3)
    requests = [ar, sdb, None, ar, seeded, DecodeParams(decoder="ar"), seeded, sdb, ar]
    assert protocol.batch_groups(requests, max_pages=8) == [[0, 3, 5, 8], [1, 7], [4], [6]]
    assert protocol.batch_groups(requests, max_pages=2) == [[0, 3], [1, 7], [4], [5, 8], [6]]
    assert protocol.batch_groups([None, None], max_pages=4) == []
    with pytest.raises(ValueError, match="max_pages"):
        protocol.batch_groups([ar], max_pages=0)


def test_set_parameters_escapes_and_appends():
    text = set_parameters('parameters { key: "a" value: { string_value: "old" } }\n', {"a": 'say "hi"', "b": "new"})
    assert read_parameters(text) == {"a": 'say "hi"', "b": "new"}


def test_local_model_folders_resolve_in_place(model_dir):
    assert resolve_model(str(model_dir)).path == model_dir
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model("/nonexistent/model")


def test_a_missing_mlflow_store_is_an_error_not_a_new_empty_store(tmp_path):
    store = tmp_path / "absent.db"
    with pytest.raises(ModelSourceError, match=r"MLflow store sqlite:///.*absent\.db does not exist"):
        resolve_model("models:/docmarkup@champion", tracking_uri=f"sqlite:///{store}", cache_dir=tmp_path / "cache")
    assert not store.exists()


# ----- runtime layout -----------------------------------------------------------------------------
def test_stub_environment_has_numpy_1_and_the_project_packages(tmp_path):
    runtime = prepare_runtime(TritonDistribution.locate(), tmp_path / "runtime")
    assert (runtime.backend_directory / "python" / "triton_python_backend_stub").resolve().is_file()
    # The stub embeds libpython and finds "python3" on PATH: that interpreter's view is the stub's.
    probe = subprocess.run(
        [str(runtime.stub_environment / "bin" / "python3"), "-c",
         "import sys, numpy, deploy.triton.protocol; print(numpy.__version__, sys.prefix)"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    numpy_version, prefix = probe.stdout.split()
    assert numpy_version.startswith("1.")
    assert prefix == str(runtime.stub_environment)


def test_shared_memory_cleanup_only_touches_our_regions(tmp_path):
    (tmp_path / "docmarkup-x-region1").write_bytes(b"")
    (tmp_path / "other-region").write_bytes(b"")
    assert [p.name for p in remove_shared_memory("docmarkup-x-", tmp_path)] == ["docmarkup-x-region1"]
    assert (tmp_path / "other-region").exists()
    with pytest.raises(ValueError, match="foreign prefix"):
        remove_shared_memory("triton_python_backend_shm", tmp_path)


def test_metrics_parser_keeps_exposed_names_and_unescapes_labels():
    text = (
        "# TYPE nv_inference_request_success counter\n"
        'nv_inference_request_success{model="docmarkup",version="1"} 2\n'
        'docmarkup_acceptance_length_bucket{decoder="sdb",model="a\\"b",le="+Inf"} 7 1700000000\n'
        "nv_cpu_utilization 0.25\n"
    )
    samples = parse_samples(text)
    assert sample_value(samples, "nv_inference_request_success", model="docmarkup") == 2
    assert sample_value(text, "docmarkup_acceptance_length_bucket", model='a"b', le="+Inf") == 7
    assert sample_value(text, "nv_cpu_utilization") == 0.25
    assert sample_value(text, "docmarkup_requests_total") is None


def test_client_reports_a_server_that_is_down():
    port = free_port()
    client = DocMarkupClient(f"127.0.0.1:{port}", f"127.0.0.1:{port}")
    assert not client.ready()
    with pytest.raises(TritonUnavailableError, match="unreachable"):
        client.transcribe(b"png")
    with pytest.raises(TritonUnavailableError, match="unreachable"):
        list(client.stream_transcribe(b"png"))
