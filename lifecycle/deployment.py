"""Deploy the champion to Triton (start, or reload in place) and prove it answers."""

from __future__ import annotations

import io
from pathlib import Path

from components.data.page_store import PageDataset
from components.data.synthetic import generate_page
from components.pipeline import PipelineConfig
from components.registry.mlflow_registry import default_tracking_uri
from components.services.process import ServiceError
from deploy.triton.client import DocMarkupClient, TranscriptionError, TritonUnavailableError
from deploy.triton.model_source import expected_model
from deploy.triton.repository import materialize_repository
from deploy.triton.server import (
    DEFAULT_SERVICE_NAME,
    TRITON_VAR,
    TritonPorts,
    TritonServer,
    probe_key_file,
    start_triton,
    triton_server,
)
from monitoring.request_log import DEFAULT_LOG_DIR

SERVICE_NAME = DEFAULT_SERVICE_NAME


def serving_budget(cfg: PipelineConfig) -> int | None:
    """Tokens the smoke test and replayed traffic ask for: the evaluation's, or (``auto``) the
    server's own limit, which the engine caps at the model's positions."""
    budget = cfg.evaluation.max_new_tokens
    return None if budget == "auto" else budget


def model_uri(cfg: PipelineConfig) -> str:
    return cfg.deploy.model_uri or f"models:/{cfg.evaluation.model_name}@champion"


def repository_options(cfg: PipelineConfig) -> dict:
    """The deploy section's serving settings, as ``materialize_repository`` keyword arguments."""
    section = cfg.deploy
    return {"device": section.device, "instance_count": section.instance_count,
            "max_batch_size": section.max_batch_size, "max_queue_size": section.max_queue_size,
            "torch_threads": section.torch_threads,
            "engine_step": section.engine_step,
            "request_log_max_image_mb": cfg.monitoring.max_image_mb,
            "request_log_retention_days": cfg.monitoring.image_retention_days}


class DeployError(RuntimeError):
    """The server does not serve what the config says it should."""


def _repository_path() -> Path:
    return TRITON_VAR / SERVICE_NAME / "model_repository"


def ensure_serving(cfg: PipelineConfig) -> TritonServer:
    """Serve the config's model on Triton: reload a running server in place, else start one.

    The repository is rewritten for this config's model (name, URI) before every reload, so a
    server started for another model never keeps serving it; the deploy then checks that both
    endpoints answer with the version the registry names now. A reload that fails, or that
    leaves the server serving anything else, falls back to a clean restart.
    """
    ports = TritonPorts(cfg.deploy.http_port, cfg.deploy.grpc_port, cfg.deploy.metrics_port)
    tracking_uri = default_tracking_uri()
    uri = model_uri(cfg)
    expected = expected_model(uri, tracking_uri)
    options = {"tracking_uri": tracking_uri, "request_log_dir": DEFAULT_LOG_DIR, **repository_options(cfg)}
    repository = _repository_path()
    if repository.is_dir():
        server = triton_server(repository, ports=ports, name=SERVICE_NAME)
        if server.service.running():
            try:
                if not server.ready():
                    raise DeployError("the running server is not ready")
                materialize_repository(uri, repository, probe_key_file=probe_key_file(SERVICE_NAME), **options)
                server.reload_models()
                served_model(server, expected, cfg.deploy.smoke_timeout_s)
                server.deploy_mode = "reloaded"
                return server
            except (ServiceError, DeployError, TranscriptionError, TritonUnavailableError) as exc:
                print(f"[deploy] reloading {uri} into the running Triton failed ({exc}); restarting it cleanly", flush=True)
                server.stop()
    server = start_triton(uri, ports=ports, name=SERVICE_NAME, repository_dir=repository, **options)
    served_model(server, expected, cfg.deploy.smoke_timeout_s)
    server.deploy_mode = "started"
    return server


def _probe_page() -> bytes:
    """A small synthetic page: enough for the server to report which model answered."""

    buffer = io.BytesIO()
    generate_page(0)[1].save(buffer, format="PNG")
    return buffer.getvalue()


def served_model(server: TritonServer, expected: dict, timeout_s: float = 120.0) -> dict:
    """Ask both endpoints (unary HTTP, gRPC stream) which model answers; raise unless it is ``expected``."""
    client = DocMarkupClient(server.http_url, server.grpc_url, timeout_s=timeout_s, probe_key=server.probe_key)
    page = _probe_page()
    unary = client.transcribe(page, decoder="ar", max_new_tokens=2, probe=True).stats["model"]
    with client.stream_transcribe(page, decoder="ar", max_new_tokens=2, probe=True) as stream:
        for _ in stream:
            pass
    streamed = (stream.stats or {}).get("model", {})
    for endpoint, model in (("unary", unary), ("stream", streamed)):
        wrong = {key: (model.get(key), value) for key, value in expected.items() if model.get(key) != value}
        if wrong:
            raise DeployError(f"the {endpoint} model serves {wrong} (served, expected)")
    return unary


def smoke_test(cfg: PipelineConfig, server: TritonServer) -> dict:
    """Send held-out pages over HTTP (SDB) and gRPC streaming (AR); both must agree (greedy).
    Reports the version both endpoints serve (the registered champion, checked by the deploy)."""
    dataset = PageDataset(cfg.split_dir(cfg.evaluation.split))
    client = DocMarkupClient(server.http_url, server.grpc_url, timeout_s=cfg.deploy.smoke_timeout_s,
                             probe_key=server.probe_key)
    pages = list(dataset.iter_pages(page_ids=dataset.ids(limit=cfg.deploy.smoke_pages)))
    agreed = 0
    latencies = []
    served: dict = {}
    for page in pages:
        buffer = io.BytesIO()
        dataset.load_image(page).save(buffer, format="PNG")
        unary = client.transcribe(buffer.getvalue(), decoder="sdb", max_new_tokens=serving_budget(cfg), probe=True)
        with client.stream_transcribe(buffer.getvalue(), decoder="ar", max_new_tokens=serving_budget(cfg),
                                      probe=True) as stream:
            streamed = "".join(chunk.text for chunk in stream)
        agreed += unary.text == streamed
        latencies.append(unary.stats["latency_s"])
        served = unary.stats["model"]
    return {"pages": len(pages), "stream_equals_unary": agreed, "mean_latency_s": sum(latencies) / max(1, len(latencies)),
            "served_model": served.get("registered_name"), "served_version": served.get("version"),
            "deploy_mode": server.deploy_mode,
            "http": server.http_url, "grpc": server.grpc_url, "metrics": server.metrics_url}


def endpoint_client(cfg: PipelineConfig) -> DocMarkupClient:
    return DocMarkupClient(f"127.0.0.1:{cfg.deploy.http_port}", f"127.0.0.1:{cfg.deploy.grpc_port}")


def replay_pages(cfg: PipelineConfig, split: str = "test", limit: int | None = None) -> int:
    """Send held-out pages through the endpoint as traffic (the demo's stand-in for product teams)."""
    dataset = PageDataset(cfg.split_dir(split))
    client = endpoint_client(cfg)
    sent = 0
    for page in dataset.iter_pages(page_ids=dataset.ids(limit=limit)):
        buffer = io.BytesIO()
        dataset.load_image(page).save(buffer, format="PNG")
        client.transcribe(buffer.getvalue(), decoder="sdb", max_new_tokens=serving_budget(cfg))
        sent += 1
    return sent
