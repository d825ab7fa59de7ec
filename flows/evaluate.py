"""Prefect flow: score every decoder on the held-out split, log to MLflow, register, gate `champion`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task, unmapped

from components.pipeline import PipelineConfig
from flows._common import DEFAULT_CONFIG, TASK_DEFAULTS, resolve, run_flow_cli
from lifecycle.curation import current_data_version
from lifecycle.evaluation import evaluate_and_register, evaluate_shard, evaluation_units

shard_task = task(evaluate_shard, name="evaluate-shard", **TASK_DEFAULTS)
evaluate_task = task(evaluate_and_register, name="evaluate-register-gate", **TASK_DEFAULTS)


@flow(name="evaluate", log_prints=True)
def evaluate(model_dir: str, config: str | PipelineConfig = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None,
             training: dict | None = None) -> dict:
    cfg = resolve(config, overrides)
    data_version = current_data_version(cfg)
    # One task per shard of the evaluation store (on a Dask cluster, one worker each), then one
    # report pooled from their page-level scores: the same numbers as evaluating all pages at once.
    reports = shard_task.map(unmapped(cfg), unmapped(Path(model_dir)), evaluation_units(cfg, Path(model_dir))).result()
    result = evaluate_task(cfg, Path(model_dir), data_version=data_version.to_json() if data_version else None,
                           training=training, reports=reports)
    logger = get_run_logger()
    logger.info("\n%s", result["table"])
    if result.get("unchanged"):
        logger.info("%s: %s; no version registered", result["model_name"], result["gate_failures"][0])
    else:
        verdict = "promoted to champion" if result["promoted"] else f"NOT promoted: {'; '.join(result['gate_failures'])}"
        logger.info("%s version %s %s", result["model_name"], result["version"], verdict)
    return result


def _model_dir_argument(parser) -> None:
    parser.add_argument("--model-dir", required=True, help="the trained model folder to evaluate")


if __name__ == "__main__":
    raise SystemExit(run_flow_cli(evaluate, __doc__, extra=_model_dir_argument))
