"""Deploy the champion to Triton (start, or reload in place) and prove it answers."""

from __future__ import annotations

import io

from components.data.page_store import PageDataset
from components.pipeline import PipelineConfig
from components.registry.mlflow_registry import default_tracking_uri
from deploy.triton.client import DocMarkupClient
from deploy.triton.server import (
    DEFAULT_SERVICE_NAME,
    TRITON_VAR,
    TritonPorts,
    TritonServer,
    start_triton,
    triton_server,
)
from monitoring.request_log import DEFAULT_LOG_DIR

SERVICE_NAME = DEFAULT_SERVICE_NAME


def model_uri(cfg: PipelineConfig) -> str:
    return cfg.deploy.model_uri or f"models:/{cfg.evaluation.model_name}@champion"


def repository_options(cfg: PipelineConfig) -> dict:
    """The deploy section's serving settings, as ``materialize_repository`` keyword arguments."""
    section = cfg.deploy
    return {"device": section.device, "instance_count": section.instance_count,
            "max_batch_size": section.max_batch_size, "torch_threads": section.torch_threads,
            "request_log_max_image_mb": cfg.monitoring.max_image_mb,
            "request_log_retention_days": cfg.monitoring.image_retention_days}


def ensure_serving(cfg: PipelineConfig) -> TritonServer:
    """Start Triton on the champion, or make a running one reload it (the alias may have moved)."""
    ports = TritonPorts(cfg.deploy.http_port, cfg.deploy.grpc_port, cfg.deploy.metrics_port)
    repository = TRITON_VAR / SERVICE_NAME / "model_repository"
    if repository.is_dir():
        server = triton_server(repository, ports=ports, name=SERVICE_NAME)
        if server.service.running() and server.ready():
            server.reload_models()
            return server
    return start_triton(model_uri(cfg), ports=ports, name=SERVICE_NAME, tracking_uri=default_tracking_uri(),
                        request_log_dir=DEFAULT_LOG_DIR, **repository_options(cfg))


def smoke_test(cfg: PipelineConfig, server: TritonServer) -> dict:
    """Send held-out pages over HTTP (SDB) and gRPC streaming (AR); both must agree (greedy)."""
    dataset = PageDataset(cfg.split_dir(cfg.evaluation.split))
    client = DocMarkupClient(server.http_url, server.grpc_url)
    pages = list(dataset.iter_pages(page_ids=dataset.ids(limit=cfg.deploy.smoke_pages)))
    agreed = 0
    latencies = []
    for page in pages:
        buffer = io.BytesIO()
        dataset.load_image(page).save(buffer, format="PNG")
        unary = client.transcribe(buffer.getvalue(), decoder="sdb", max_new_tokens=cfg.evaluation.max_new_tokens)
        with client.stream_transcribe(buffer.getvalue(), decoder="ar", max_new_tokens=cfg.evaluation.max_new_tokens) as stream:
            streamed = "".join(chunk.text for chunk in stream)
        agreed += unary.text == streamed
        latencies.append(unary.stats["latency_s"])
    return {"pages": len(pages), "stream_equals_unary": agreed, "mean_latency_s": sum(latencies) / max(1, len(latencies)),
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
        client.transcribe(buffer.getvalue(), decoder="sdb", max_new_tokens=cfg.evaluation.max_new_tokens)
        sent += 1
    return sent
