"""Prefect flow: serve the `champion` on Triton (start or reload) and smoke-test HTTP and gRPC streaming."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from components.pipeline import PipelineConfig
from flows._common import DEFAULT_CONFIG, SERVICE_TASK, resolve, run_flow_cli
from lifecycle.deployment import ensure_serving, smoke_test

serve = task(ensure_serving, name="triton-serve-champion", **SERVICE_TASK)
smoke = task(smoke_test, name="triton-smoke-test", **SERVICE_TASK)


@flow(name="deploy", log_prints=True)
def deploy(config: str | PipelineConfig = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None) -> dict:
    cfg = resolve(config, overrides)
    if not cfg.deploy.enabled:
        return {"deployed": False}
    server = serve(cfg)
    result = {"deployed": True, **smoke(cfg, server)}
    get_run_logger().info("Triton serving: %s", result)
    return result


if __name__ == "__main__":
    raise SystemExit(run_flow_cli(deploy, __doc__))
