"""Prefect flow: Stage 1 → consistency mining → Stage 2 (hard examples) → DARL fine-tune, on DeepSpeed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task, unmapped

from components.data.page_store import PageDataset
from components.pipeline import PipelineConfig
from flows._common import DEFAULT_CONFIG, SERVICE_TASK, TASK_DEFAULTS, resolve, run_flow_cli
from lifecycle import curation
from lifecycle.stage_check import check_stage
from lifecycle.stages import run_stage, starting_checkpoint

stage_task = task(run_stage, name="train-stage", **TASK_DEFAULTS)
mine_shard = task(curation.mine_shard, name="mine-shard", **TASK_DEFAULTS)
collect_hard = task(curation.collect_hard_examples, name="collect-hard-examples", **TASK_DEFAULTS)
queue = task(curation.queue_for_annotation, name="queue-hard-examples", **SERVICE_TASK)
version = task(curation.version_data, name="dvc-version", **TASK_DEFAULTS)
check_task = task(check_stage, name="check-stage", **TASK_DEFAULTS)


def _continue_from(cfg, stage: str, input_model, output_model, summary: dict):
    """The model the chain goes on from: the stage's output, or its input when the stage ended
    below it (``training.keep_better``); the check lands in the summary either way."""
    if input_model is None or cfg.training.check_pages == 0:
        return output_model
    check = check_task(cfg, stage, input_model, output_model)
    summary.setdefault("stage_checks", []).append(check.as_dict())
    return Path(check.kept)


@flow(name="train", log_prints=True)
def train(config: str | PipelineConfig = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None) -> dict:
    """The configured stages in their declared order; each resumes from its own last checkpoint.
    A stage continues the chain's model so far; one with ``hard_examples`` first mines that model
    on the training split; one ``beside_chain`` trains from the start and is not continued."""
    cfg = resolve(config, overrides)
    logger = get_run_logger()
    train_dir = cfg.split_dir("train")
    if not PageDataset(train_dir).exists():
        raise FileNotFoundError(f"no training split at {train_dir}; run the curate flow first")
    data_version = curation.current_data_version(cfg)
    start = starting_checkpoint(cfg)
    summary: dict[str, Any] = {"data_version": data_version.to_json() if data_version else None,
                               "start_model": str(start or "")}
    model_dir, last = None, None  # the chain's model so far, and the stage that made it
    for stage, section in cfg.training.stages.items():
        md5 = data_version.md5 if data_version else None
        if section.beside_chain:
            result = stage_task(cfg, stage, dataset_dir=train_dir, data_version=md5)
            summary[stage] = result.summary
            summary["element_model_dir"] = str(result.model_dir)
            continue
        hard_dir = None
        if section.hard_examples:
            units = curation.mining_units(cfg)  # one per shard of the training split's store
            mined = mine_shard.map(unmapped(cfg), unmapped(model_dir), unmapped(f"{last}:{model_dir}"),
                                   units).result()
            summary["mining"], hard_predictions = collect_hard(cfg, model_dir, mined)
            if cfg.curation.label_studio.enabled and hard_predictions:
                summary["hard_queue"] = queue(cfg, PageDataset(cfg.hard_dir), hard_predictions, f"{last}-consistency")
            data_version = version(cfg, "train: consistency scores and hard examples")
            summary["data_version"] = data_version.to_json()
            md5 = data_version.md5
            hard_dir = cfg.hard_dir if len(PageDataset(cfg.hard_dir)) else None
        result = stage_task(cfg, stage, dataset_dir=train_dir, init_from=model_dir, hard_dir=hard_dir, data_version=md5)
        summary[stage] = result.summary
        model_dir, last = _continue_from(cfg, stage, model_dir or start, result.model_dir, summary), stage
    summary["model_dir"] = str(model_dir)
    summary["changed"] = start is None or Path(model_dir).resolve() != Path(start).resolve()
    if summary["changed"]:
        logger.info("training done: model %s", model_dir)
    else:
        logger.info("training done: every stage ended below its input; the model is still %s (nothing new)", model_dir)
    return summary


if __name__ == "__main__":
    raise SystemExit(run_flow_cli(train, __doc__))
