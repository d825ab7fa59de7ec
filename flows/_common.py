"""What every flow module shares: config loading and the task defaults."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from prefect.cache_policies import NONE

from components.pipeline import PipelineConfig, load_pipeline_config

DEFAULT_CONFIG = "configs/pipeline/default.yaml"
DEMO_CONFIG = "configs/pipeline/demo.yaml"

# Results are small dicts and live in memory only; nothing is cached between runs, because
# every step is idempotent on its own (journals, DVC, Label Studio page ids) instead.
TASK_DEFAULTS: dict[str, Any] = {"cache_policy": NONE, "persist_result": False}
# Steps that talk to a service (Label Studio, Triton, MLflow server) retry transient failures.
SERVICE_TASK: dict[str, Any] = {**TASK_DEFAULTS, "retries": 3, "retry_delay_seconds": [5, 15, 30]}


def resolve(config: str | PipelineConfig, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """The validated pipeline config, every training stage's config included."""
    if isinstance(config, PipelineConfig):
        return config
    cfg = load_pipeline_config(config, overrides)
    from components.training.stages import validate_stages

    validate_stages(cfg)
    return cfg


def config_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean "fix the config", reported as one line by the flows' command lines."""
    from components.pipeline import PipelineConfigError
    from components.training.config import TrainConfigError

    return PipelineConfigError, TrainConfigError


def task_runner_for(cfg: PipelineConfig):
    """Threads in the flow process by default; a Dask cluster (local or remote) to scale out."""
    if cfg.execution.task_runner == "dask":
        from prefect_dask import DaskTaskRunner

        if cfg.execution.dask_address:
            return DaskTaskRunner(address=cfg.execution.dask_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": cfg.execution.workers, "threads_per_worker": 1,
                                              "processes": True, "dashboard_address": None})
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=cfg.execution.workers)


@contextlib.contextmanager
def project_prefect_server():
    """Run the flows against ``PREFECT_API_URL`` if set, else the project's Prefect server (started if
    needed): every run shows in its UI, and a killed flow leaves no temporary server behind."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    from components.services.tracking import ensure_prefect_server

    url = ensure_prefect_server()
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url


def run_flow_cli(flow_fn, *args) -> None:
    """A flow module's ``__main__``: the flow against the project's Prefect server."""
    with project_prefect_server():
        flow_fn(*args)
