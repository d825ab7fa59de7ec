"""What every flow module shares: config loading and the task defaults."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from prefect.cache_policies import NONE
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.task_runners import ThreadPoolTaskRunner

from components.pipeline import PipelineConfig, PipelineConfigError, load_pipeline_config
from components.services.tracking import ensure_prefect_server
from components.training.config import TrainConfigError
from lifecycle.stages import validate_stages

DEFAULT_CONFIG = "configs/pipeline/default.yaml"
DEMO_CONFIG = "configs/pipeline/demo.yaml"

# Results are small dicts and live in memory only; nothing is cached between runs, because
# every step is idempotent on its own (journals, DVC, Label Studio page ids) instead.
TASK_DEFAULTS: dict[str, Any] = {"cache_policy": NONE, "persist_result": False}
# Steps that talk to a service (Label Studio, Triton, MLflow server) retry transient failures.
SERVICE_TASK: dict[str, Any] = {**TASK_DEFAULTS, "retries": 3, "retry_delay_seconds": [5, 15, 30]}


def resolve(config: str | PipelineConfig, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """The validated pipeline config, every training stage's config included. A config already
    resolved passes through: a chain resolves once and hands the object to each flow."""
    if isinstance(config, PipelineConfig):
        if overrides:
            raise ValueError("overrides apply when a config is resolved; this one already is")
        return config
    cfg = load_pipeline_config(config, overrides)
    validate_stages(cfg)
    return cfg


def config_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean "fix the config", reported as one line by the flows' command lines."""

    return PipelineConfigError, TrainConfigError


def task_runner_for(cfg: PipelineConfig):
    """Threads in the flow process by default; a Dask cluster (local or remote) to scale out."""
    if cfg.execution.task_runner == "dask":
        # deferred: optional: the Dask task runner only when configured
        from prefect_dask import DaskTaskRunner

        if cfg.execution.dask_address:
            return DaskTaskRunner(address=cfg.execution.dask_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": cfg.execution.workers, "threads_per_worker": 1,
                                              "processes": True, "dashboard_address": None})
    return ThreadPoolTaskRunner(max_workers=cfg.execution.workers)


@contextlib.contextmanager
def project_prefect_server(port: int | None = None):
    """Run the flows against ``PREFECT_API_URL`` if set, else the project's Prefect server on ``port``
    (``execution.prefect_port``; started if needed): every run shows in its UI, and a killed flow
    leaves no temporary server behind."""

    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return

    url = ensure_prefect_server(port) if port else ensure_prefect_server()
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs as config overrides (JSON values where they parse as JSON)."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value) if value[:1] in "[{0123456789-tfn" else value
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def flow_arguments(description: str | None, default_config: str | None = DEFAULT_CONFIG) -> argparse.ArgumentParser:
    """The command line every flow shares: ``--config YAML`` and ``--set KEY=VALUE``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=default_config, help=f"pipeline YAML (default {default_config or DEFAULT_CONFIG})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key (dotted path), e.g. --set training.steps=20")
    return parser


def checked_config(config: str, overrides: dict[str, Any] | None) -> PipelineConfig | None:
    """The resolved config, or None after one line on stderr when it (or a stage config) is invalid."""
    try:
        return resolve(config, overrides or None)
    except config_errors() as exc:
        print(f"config error: {' '.join(str(exc).split())}", file=sys.stderr)
        return None


def run_flow_cli(flow_fn, description: str | None, argv: list[str] | None = None,
                 extra: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """A flow module's ``__main__``: parse ``--config``/``--set`` (plus the flow's own arguments),
    validate the config, then run the flow against the project's Prefect server."""
    parser = flow_arguments(description)
    if extra:
        extra(parser)
    args = vars(parser.parse_args(argv))
    config, overrides = args.pop("config"), parse_overrides(args.pop("overrides")) or None
    cfg = checked_config(config, overrides)
    if cfg is None:
        return 2
    with project_prefect_server(cfg.execution.prefect_port):
        flow_fn(config=cfg, **args)
    return 0
