"""Prefect flow: ingest pages, pre-annotate (sharded), queue for annotators, import corrections, split, version."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task, unmapped

from components.data.page_store import PageDataset
from components.pipeline import PipelineConfig
from flows._common import DEFAULT_CONFIG, SERVICE_TASK, TASK_DEFAULTS, resolve, run_flow_cli, task_runner_for
from lifecycle import curation

ingest = task(curation.ingest_pages, name="ingest-pages", **TASK_DEFAULTS)
preannotate_shard = task(curation.preannotate_shard, name="pre-annotate-shard", **TASK_DEFAULTS)
merge = task(curation.merge_preannotations, name="merge-pre-annotations", **TASK_DEFAULTS)
queue = task(curation.queue_for_annotation, name="queue-label-studio", **SERVICE_TASK)
corrections = task(curation.import_corrections, name="import-corrections", **SERVICE_TASK)
split = task(curation.split_pages, name="split", **TASK_DEFAULTS)
version = task(curation.version_data, name="dvc-version", **TASK_DEFAULTS)


@flow(name="curate", log_prints=True)
def curate_flow(config: str | PipelineConfig = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None) -> dict:
    cfg = resolve(config, overrides)
    logger = get_run_logger()
    summary: dict[str, Any] = {"ingest": ingest(cfg)}
    units = curation.preannotation_units(cfg)  # one per page-store shard
    summary["preannotation"] = preannotate_shard.map(unmapped(cfg), units).result()  # parallel
    annotator_version = merge(cfg, summary["preannotation"])
    if cfg.curation.label_studio.enabled:
        summary["corrections"] = corrections(cfg)
        pages = PageDataset(cfg.pages_dir)
        summary["queue"] = queue(cfg, pages, curation.preannotated_candidates(pages), annotator_version)
    summary["splits"] = split(cfg)
    summary["data_version"] = version(cfg, "curate: pages, pre-annotations, corrections, splits").to_json()
    logger.info("curation done: %s", summary)
    return summary


def curate(config: str | PipelineConfig = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None) -> dict:
    """Run the flow on the task runner its config asks for (threads, or Dask to scale out)."""
    cfg = resolve(config, overrides)
    return curate_flow.with_options(task_runner=task_runner_for(cfg))(cfg)


if __name__ == "__main__":
    raise SystemExit(run_flow_cli(curate, __doc__))
