"""The monitoring pass: drift of served pages against the champion's evaluation, then feedback."""

from __future__ import annotations

import logging

import mlflow

from components.data.page_store import PageDataset
from components.pipeline import PipelineConfig
from components.registry import mlflow_registry as registry
from lifecycle.curation import label_studio
from lifecycle.evaluation import drift_reference_of
from monitoring.drift import MIN_VERDICT_PAGES, SIGNALS, check_drift, load_reference
from monitoring.feedback import push_low_confidence_pages
from monitoring.request_log import RequestLog

logger = logging.getLogger(__name__)


def production_signals(log: RequestLog, since: float | None = None) -> dict[str, list[float]]:
    entries = log.entries(since=since)
    return {name: [float(getattr(e, name)) for e in entries] for name in SIGNALS}


def check_production_drift(cfg: PipelineConfig, log: RequestLog, since: float | None = None) -> dict:
    """Drift of the request log against the champion's evaluation split, logged to MLflow."""

    registry.configure(experiment=f"{cfg.name}-monitoring")
    production = production_signals(log, since)
    n = len(production["mean_confidence"])
    needed = max(cfg.monitoring.min_production_pages, MIN_VERDICT_PAGES)
    if n < needed:
        return {"checked": False, "verdict": None, "reason": f"not enough production pages: {n} < {needed}"}
    reference = load_reference(drift_reference_of(cfg.evaluation.model_name))
    report = check_drift(reference, production, psi_threshold=cfg.monitoring.psi_threshold,
                         pvalue_threshold=cfg.monitoring.ks_pvalue_threshold,
                         min_production=cfg.monitoring.min_production_pages)
    with mlflow.start_run(run_name="drift-check"):
        mlflow.log_metrics(report.flat_metrics())
        mlflow.log_dict(report.as_dict(), "drift.json")
    return {"checked": True, **report.as_dict()}


def send_low_confidence_to_annotators(cfg: PipelineConfig, log: RequestLog, since: float | None = None) -> dict:
    if not cfg.curation.label_studio.enabled:
        return {"queued": 0, "reason": "label studio disabled"}
    holder = registry.champion(cfg.evaluation.model_name)
    model_version = f"{cfg.evaluation.model_name}-v{holder.version}" if holder else "unregistered"
    handle = label_studio(cfg)
    result = push_low_confidence_pages(handle.client, handle.project_id, log, PageDataset(cfg.production_dir),
                                       cfg.monitoring.low_confidence, model_version, since=since, view=handle.view)
    return {"candidates": result.candidates, "queued": len(result.queue.queued) if result.queue else 0,
            "label_studio": handle.url}
