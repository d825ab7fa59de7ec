"""Redeploying into a running Triton (the weekly path of scheduled retraining), on the real server.

Model A, then model B (another registered name, as a second pipeline config would register),
are deployed into one running server ten times while a client keeps sending unary and streamed
requests. Each time the repository is rewritten for the model to serve and reloaded through the
admin API; both endpoints must then answer with that model's registered version, and the
metrics endpoint must answer. Before each instance's metrics carried their own ``load`` label, a
reload under traffic crashed the server with ``Signal (11)`` (a new instance shared, then wrote,
the metric objects the old instance had freed).
"""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import requests

from components.data.synthetic import generate_page
from components.services.process import VAR_DIR
from deploy.triton.client import DocMarkupClient
from deploy.triton.model_source import expected_model
from deploy.triton.repository import materialize_repository
from deploy.triton.server import TritonPorts, probe_key_file, start_triton
from lifecycle.deployment import served_model
from models.loading import save_markup_model
from tests.test_triton_server import chaotic_model, png, register_folder, throwaway_registry

pytestmark = [pytest.mark.services, pytest.mark.slow]

NAMES = ("redeploy-model-a", "redeploy-model-b")


@pytest.fixture(scope="module")
def two_registered_models(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("redeploy")
    client, experiment, tracking_uri = throwaway_registry(root, "redeploy")
    for seed, name in enumerate(NAMES, start=1):
        client.create_registered_model(name)
        folder = save_markup_model(chaotic_model(tokenizer, seed), tokenizer, root / name)
        client.set_registered_model_alias(name, "champion", register_folder(client, experiment, name, folder))
    return {"tracking_uri": tracking_uri, "root": root}


def test_deploying_a_then_b_ten_times_into_one_running_server_serves_each(two_registered_models):
    root, tracking_uri = two_registered_models["root"], two_registered_models["tracking_uri"]
    options = {"tracking_uri": tracking_uri, "model_cache_dir": root / "cache", "request_log_dir": root / "requests"}
    repository = root / "model_repository"
    name = f"triton-redeploy-{os.getpid()}"
    server = start_triton(f"models:/{NAMES[0]}@champion", ports=TritonPorts.free(), name=name,
                          repository_dir=repository, **options)
    page = png(generate_page(21)[1])
    stop, failures, answered = threading.Event(), [], [0]

    def traffic() -> None:  # product traffic that keeps flowing while the model is swapped
        client = DocMarkupClient(server.http_url, server.grpc_url, timeout_s=60)
        while not stop.is_set():
            try:
                client.transcribe(page, decoder="sdb", max_new_tokens=12)
                with client.stream_transcribe(page, decoder="ar", max_new_tokens=12) as stream:
                    "".join(chunk.text for chunk in stream)
                answered[0] += 1
            except Exception as exc:  # a request caught mid-swap may fail; the server must not
                failures.append(str(exc))

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    try:
        for deploy in range(10):
            model = NAMES[(deploy + 1) % 2]
            uri = f"models:/{model}@champion"
            materialize_repository(uri, repository, probe_key_file=probe_key_file(name), **options)
            server.reload_models()
            served = served_model(server, expected_model(uri, tracking_uri), timeout_s=60)
            assert served["registered_name"] == model, f"deploy {deploy}: serving {served}"
            assert requests.get(server.metrics_url, timeout=10).status_code == 200, f"deploy {deploy}: metrics"
            assert server.service.running(), f"deploy {deploy}: server died\n{server.tail_log(30)}"
    finally:
        stop.set()
        worker.join(timeout=120)
        log = server.service.log_file.read_text(errors="replace")
        server.stop()
        shutil.rmtree(VAR_DIR / "services" / name, ignore_errors=True)
    assert "Signal (11)" not in log
    assert answered[0] > 0, f"no request answered during the redeploys: {failures[:3]}"
