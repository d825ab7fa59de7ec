"""Prefect flow chaining the whole life cycle: curate → train → evaluate → deploy → monitor.

    ./run demo                                  # the chain on a tiny synthetic set, embedded defaults
    python -m flows.retrain --config configs/pipeline/default.yaml
    python -m flows.deployments                 # the same on a cron schedule
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

from components.metrics import reported_overall
from components.pipeline import PipelineConfig
from components.registry.mlflow_registry import champion, configure, default_tracking_uri
from flows._common import (
    DEFAULT_CONFIG,
    DEMO_CONFIG,
    SERVICE_TASK,
    TASK_DEFAULTS,
    checked_config,
    flow_arguments,
    parse_overrides,
    project_prefect_server,
    resolve,
)
from flows.curate import curate
from flows.deploy import deploy
from flows.evaluate import evaluate
from flows.monitor import monitor
from flows.train import train
from lifecycle.deployment import replay_pages
from lifecycle.evaluation import parse_mode_comparison
from lifecycle.services import running_url

replay = task(replay_pages, name="replay-traffic", **SERVICE_TASK)
compare_modes = task(parse_mode_comparison, name="compare-parse-modes", **TASK_DEFAULTS)


@flow(name="retrain", log_prints=True)
def retrain(config: str | PipelineConfig = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None, replay_traffic: bool = False) -> dict:
    """Curate, train every stage, evaluate and gate, deploy the champion, then monitor it."""
    cfg = resolve(config, overrides)  # once: every flow below gets this object
    started = time.time()
    summary: dict[str, Any] = {"curate": curate(cfg)}
    summary["train"] = train(cfg)
    summary["evaluate"] = evaluate(summary["train"]["model_dir"], cfg, training={"model_dir": summary["train"]["model_dir"]})
    if summary["train"].get("element_model_dir"):  # page vs element mode, the same test pages
        summary["parse_modes"] = compare_modes(cfg, Path(summary["train"]["model_dir"]),
                                               Path(summary["train"]["element_model_dir"]))
    if summary["evaluate"].get("unchanged"):  # no stage kept a change: the served model stays as it is
        get_run_logger().info("%s; nothing deployed, the served model is monitored", summary["evaluate"]["gate_failures"][0])
    elif cfg.deploy.enabled and (summary["evaluate"]["promoted"] or _has_champion(cfg)):
        summary["deploy"] = deploy(cfg)
        if replay_traffic:
            summary["replayed_pages"] = replay(cfg, limit=cfg.monitoring.min_production_pages + 8)
    # Whatever the gate decided: a scheduled retrain is also the scheduled monitoring of what is served.
    summary["monitor"] = monitor(cfg, since=started if summary.get("replayed_pages") else None)
    summary["seconds"] = round(time.time() - started, 1)
    get_run_logger().info("retrain finished in %.0fs", summary["seconds"])
    return summary


def _has_champion(cfg) -> bool:
    configure(experiment=f"{cfg.name}-evaluation")
    return champion(cfg.evaluation.model_name) is not None


def where_things_are(summary: dict) -> str:
    """The closing message: where each result lives and how to look at it."""

    evaluation = summary["evaluate"]
    lines = [
        "",
        "=" * 78,
        f"docmarkup life cycle finished in {summary['seconds']:.0f}s",
        "",
        evaluation["table"],
        "",
        *sample_lines(evaluation.get("sample")),
        f"Truth       {evaluation.get('truth_line', 'truth: unknown')}",
        f"MLflow      {default_tracking_uri()}  run {evaluation['run_id']}",
        (f"            {evaluation['gate_failures'][0]}: no version registered, nothing deployed"
         if evaluation.get("unchanged") else
         f"            model {evaluation['model_name']} v{evaluation['version']}: "
         + ("alias 'champion'" if evaluation["promoted"] else f"not promoted ({'; '.join(evaluation['gate_failures'])})")
         + f"; gated on {evaluation.get('gate_metric')}"),
        *baseline_lines(evaluation),
        f"            browse: {running_url('mlflow') or './run services start mlflow [--port N], then http://127.0.0.1:N'}",
        _data_line(summary["train"].get("data_version")),
    ]
    lines += stage_lines(summary["train"].get("stage_checks") or [])
    modes = summary.get("parse_modes")
    if modes:
        lines += ["", f"Page vs element mode ({modes['n_pages']} test pages; page model: the chain's, element model: "
                  "trained on element crops from the same start):", modes["table"], ""]
    queue = summary["curate"].get("queue") or {}
    if queue.get("url"):
        lines.append(f"Label Studio {queue['url']}  (project {queue.get('project_id')}, "
                     f"{queue.get('queued', 0)} new tasks; credentials in var/services/labelstudio/credentials.json)")
    deployed = summary.get("deploy") or {}
    if deployed.get("deployed"):
        lines.append(f"Triton      http {deployed['http']}  grpc {deployed['grpc']}  metrics {deployed['metrics']}")
        lines.append(f"            serving {deployed.get('served_model')} v{deployed.get('served_version')} "
                     f"({deployed.get('deploy_mode')}; both endpoints checked against the registry)")
        lines.append(f"            smoke test: {deployed['stream_equals_unary']}/{deployed['pages']} pages streamed == unary, "
                     f"{deployed['mean_latency_s'] * 1000:.0f} ms mean latency (SDB)")
    monitor_result = summary.get("monitor") or {}
    if monitor_result:
        drift = monitor_result["drift"]
        verdict = drift["summary"] if drift.get("checked") else f"no verdict ({drift.get('reason')})"
        lines.append(f"Monitoring  drift: {verdict}")
        lines.append(f"            {monitor_result['feedback'].get('queued', 0)} low-confidence pages sent to Label Studio")
    if summary.get("prefect_ui"):
        lines.append(f"Prefect     {summary['prefect_ui']}  (flow runs of this life cycle)")
    lines += ["Stop services: ./run services stop --all", "=" * 78]
    return "\n".join(lines)


def stage_lines(checks: list[dict]) -> list[str]:
    """Start -> each stage, AR Overall on the same validation pages, and which model the chain kept."""
    if not checks:
        return []
    first = checks[0]
    lines = ["", f"Stages (greedy AR {first.get('metric', 'Overall')}, the same {first['pages']} validation pages; "
                 f"truth: {first.get('truth') or 'unknown'}):",
             f"  start         {first['input_overall']:.2f}  {first['input_model']}"]
    for check in checks:
        if check["kept"] == check["output_model"]:
            kept = "kept"
        elif check.get("tied"):
            kept = "TIED its input: not an improvement, the chain went on from the input"
        else:
            kept = "BELOW its input: the chain went on from the input"
        lines.append(f"  {check['stage']:<13} {check['output_overall']:.2f}  ({kept})")
    return lines


def baseline_lines(evaluation: dict) -> list[str]:
    """The challenger beside what it was compared with on the same pages, in this run."""
    lines = []
    if evaluation.get("baseline") and evaluation.get("baseline_score") is not None and evaluation.get("score") is not None:
        lines.append(f"            {evaluation['score']:.2f} here vs {evaluation['baseline_score']:.2f} for "
                     f"{evaluation['baseline']} on the same pages")
    reference = evaluation.get("ocr_reference")
    if reference:  # the same Overall as the table's, whatever the gate decided
        overall, label = reported_overall(reference)
        if overall is not None:
            lines.append(f"            {overall:.2f} for {reference['name']} (the free OCR, not gated; {label}), "
                         f"text edit {reference['text_edit']}, on the same {reference['pages']} pages")
    return lines


def _data_line(version: dict | None) -> str:
    if not version:
        return "Data (DVC)  not versioned"
    return f"Data (DVC)  {version['path']}.dvc md5 {version['md5']}"


def sample_lines(sample: dict | None, width: int = 300) -> list[str]:
    """One held-out page: ground truth, then each decoder's output (cut to ``width`` characters)."""
    if not sample:
        return []

    def cut(text: str) -> str:
        flat = text.replace("\n", " ⏎ ")
        return flat if len(flat) <= width else flat[:width] + " …"

    lines = [f"Held-out page {sample['page_id']}:", f"  ground truth  {cut(sample['ground_truth'])}"]
    lines += [f"  {name:<13} {cut(text)}" for name, text in sample["outputs"].items()]
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = flow_arguments(__doc__, default_config=None)
    parser.add_argument("--demo", action="store_true",
                        help=f"tiny synthetic run on embedded defaults ({DEMO_CONFIG} unless --config), replaying traffic")
    args = parser.parse_args(argv)
    config = args.config or (DEMO_CONFIG if args.demo else DEFAULT_CONFIG)
    overrides = parse_overrides(args.overrides) or None
    cfg = checked_config(config, overrides)  # every config error before any work, in one message
    if cfg is None:
        return 2
    with project_prefect_server(cfg.execution.prefect_port) as prefect_url:
        print(f"Prefect UI: {prefect_url.removesuffix('/api')} (this run's flows and tasks)", flush=True)
        summary = retrain(cfg, replay_traffic=args.demo)
    summary["prefect_ui"] = prefect_url.removesuffix("/api")
    print(where_things_are(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
