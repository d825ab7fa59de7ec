"""Prefect flow: drift check of served pages, and low-confidence pages back to Label Studio."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from components.pipeline import PipelineConfig
from flows._common import DEFAULT_CONFIG, SERVICE_TASK, TASK_DEFAULTS, resolve, run_flow_cli
from lifecycle.monitoring import check_production_drift, send_low_confidence_to_annotators
from monitoring.request_log import RequestLog

drift = task(check_production_drift, name="drift-check", **TASK_DEFAULTS)
feedback = task(send_low_confidence_to_annotators, name="feedback-to-label-studio", **SERVICE_TASK)


@flow(name="monitor", log_prints=True)
def monitor(config: str | PipelineConfig = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None, since: float | None = None) -> dict:
    cfg = resolve(config, overrides)
    log = RequestLog(max_image_mb=cfg.monitoring.max_image_mb, image_retention_days=cfg.monitoring.image_retention_days)
    pruned = log.prune_images()
    result = {"drift": drift(cfg, log, since), "feedback": feedback(cfg, log, since), "pruned_images": len(pruned)}
    get_run_logger().info("monitoring: %s", result)
    return result


if __name__ == "__main__":
    raise SystemExit(run_flow_cli(monitor, __doc__))
