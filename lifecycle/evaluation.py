"""Evaluate a trained model on the held-out split, log it to MLflow, register it, gate the champion."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import mlflow

from components.data.page_store import PageDataset
from components.data.provenance import describe_truth, model_lineage, truth_kinds
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.evaluate import (
    EvaluationReport,
    assert_held_out,
    evaluate_decoders,
    merge_reports,
    plot_score_vs_speed,
    token_budget,
    write_category_tables,
)
from components.evaluation.parse_modes import compare_parse_modes, table
from components.evaluation.reference import ocr_reference_scores
from components.parsing import ParseSettings, resolve_parse
from components.pipeline import PipelineConfig
from components.registry import mlflow_registry as registry
from lifecycle.stages import starting_checkpoint
from models.loading import model_fingerprint
from monitoring.drift import save_reference

DRIFT_REFERENCE_ARTIFACT = "evaluation/drift_reference.json"


def log_report(report: EvaluationReport, model_dir: str | Path, **run_info) -> str:
    """Log an evaluation report to MLflow: its flat metrics, JSON, table, plot and per-page tables."""

    def write(folder: Path) -> None:
        report.write_json(folder / "report.json")
        (folder / "table.txt").write_text(report.table() + "\n")
        plot_score_vs_speed(report, folder / "score_vs_speed.png")
        write_category_tables(report, folder / "pages")

    return registry.log_evaluation(report.flat_metrics(), model_dir, write_artifacts=write, **run_info)


def decoder_params(cfg: PipelineConfig, max_new_tokens: int | None = None) -> list[DecodeParams]:
    """The configured decoders; ``max_new_tokens`` is the resolved budget when the config says "auto"."""
    section = cfg.evaluation
    budget = section.max_new_tokens if max_new_tokens is None else max_new_tokens
    if budget == "auto":
        raise ValueError("evaluation.max_new_tokens is 'auto': resolve it with evaluation_units first")
    return [DecodeParams(decoder=name, max_new_tokens=budget, threshold=section.threshold, window=section.window)
            for name in section.decoders]


def parse_settings(cfg: PipelineConfig, model_dir: Path) -> ParseSettings:
    """How ``model_dir`` reads the evaluation pages (``evaluation.parse``; "auto": as it was trained)."""
    return ParseSettings(resolve_parse(cfg.evaluation.parse, model_dir), cfg.evaluation.layout)


def evaluation_lineage(cfg: PipelineConfig, model_dir: Path) -> set[str]:
    """Weights whose pre-annotations cannot grade ``model_dir``: its own, its ancestors', and those
    of the checkpoint the chain started from (the first challenger's baseline)."""

    return model_lineage(model_dir) | model_lineage(starting_checkpoint(cfg))


def evaluation_units(cfg: PipelineConfig, model_dir: Path) -> list[dict]:
    """One unit per shard of the evaluation store (the first ``max_pages`` pages), once the store is
    known to hold no page the model was trained on."""
    dataset = PageDataset(cfg.evaluation_dir)
    assert_held_out(model_dir, dataset)
    units = dataset.shard_units(cfg.evaluation.max_pages)
    if cfg.evaluation.max_new_tokens == "auto":  # one budget for every shard, so their reports merge
        pages = [page for unit in units for page in dataset.unit_pages(unit) if page.markup.strip()]
        budget = token_budget(DecodingEngine.from_pretrained(model_dir), pages)
        print(f"[evaluate] token budget: {budget.describe()}", flush=True)
        units = [{**unit, "max_new_tokens": budget.max_new_tokens} for unit in units]
    return units


def evaluate_shard(cfg: PipelineConfig, model_dir: Path, unit: dict) -> EvaluationReport:
    """Every configured decoder on the pages of one store shard."""
    dataset = PageDataset(cfg.evaluation_dir)
    pages = dataset.unit_pages(unit)
    return evaluate_decoders(DecodingEngine.from_pretrained(model_dir), dataset,
                             decoder_params(cfg, unit.get("max_new_tokens")), pages=pages,
                             parsing=parse_settings(cfg, model_dir), formula_metric=cfg.evaluation.formula_metric,
                             lineage=evaluation_lineage(cfg, model_dir))


def evaluate_model(cfg: PipelineConfig, model_dir: Path, reports: list[EvaluationReport] | None = None) -> EvaluationReport:
    """One report over every shard (``reports``: the shards of :func:`evaluation_units` already
    evaluated, e.g. by parallel flow tasks; otherwise they are evaluated here one after another)."""
    if reports is None:
        reports = [evaluate_shard(cfg, model_dir, unit) for unit in evaluation_units(cfg, model_dir)]
    return merge_reports(reports)


def sample_page(report: EvaluationReport, dataset: PageDataset) -> dict:
    """One held-out page's ground truth next to every decoder's output (for people to read)."""
    page = dataset.get(next(iter(report.decoders["ar"].texts)))
    return {"page_id": page.page_id, "ground_truth": page.markup,
            "outputs": {name: ev.texts.get(page.page_id, "") for name, ev in report.decoders.items()}}


def evaluate_and_register(cfg: PipelineConfig, model_dir: Path, *, data_version: dict | None = None,
                          training: dict | None = None, reports: list[EvaluationReport] | None = None) -> dict:
    """The evaluation flow's body: one MLflow run, one registered version, an alias only if gates pass."""
    experiment_id = registry.configure(experiment=f"{cfg.name}-evaluation")
    report = evaluate_model(cfg, model_dir, reports)
    params = {"model_dir": str(model_dir), "parse": parse_settings(cfg, model_dir).mode,
              "refused_own_output": report.refused_own_output,
              **{f"truth.{kind}": n for kind, n in truth_kinds(report.truth).items()},
              "layout": cfg.evaluation.layout, "split": cfg.evaluation.pages_dir or cfg.evaluation.split, "n_pages": report.n_pages,
              "refused_no_truth": report.refused_no_truth,
              "formula_metric": next(iter(report.decoders.values())).formula_metric,
              **{f"decoder.{name}": ev.params for name, ev in report.decoders.items()},
              **{f"train.{k}": v for k, v in (training or {}).items()}}
    tags = {f"data.{k}": str(v) for k, v in (data_version or {}).items()} | {"truth": describe_truth(report.truth)}
    # The decoders ran before this step (in per-shard tasks): the run starts when they started.
    started_at = time.time() - sum(ev.wall_seconds for ev in report.decoders.values())
    run_id = log_report(report, model_dir, params=params, data_version=(data_version or {}).get("md5"), tags=tags,
                        started_at=started_at, experiment_id=experiment_id)
    with tempfile.TemporaryDirectory() as tmp, mlflow.start_run(run_id=run_id):
        reference = save_reference(report.decoders["ar"].pages, Path(tmp) / "drift_reference.json")
        mlflow.log_artifact(str(reference), artifact_path="evaluation")
    gates = registry.Gates(**cfg.evaluation.gates.model_dump())
    truth = describe_truth(report.truth)
    dataset = PageDataset(cfg.evaluation_dir)
    common = {"run_id": run_id, "model_name": cfg.evaluation.model_name, "refused_no_truth": report.refused_no_truth,
              "refused_own_output": report.refused_own_output, "truth": report.truth, "truth_line": report.truth_line,
              "table": report.table(), "ratios": report.ratios(), "tracking_uri": mlflow.get_tracking_uri(),
              "sample": sample_page(report, dataset)}
    ocr_reference = None
    if cfg.evaluation.ocr_reference:  # what the free OCR reads on the same pages, beside both models
        ev = report.decoders.get(gates.score_decoder) or next(iter(report.decoders.values()))
        ocr_reference = ocr_reference_scores(cfg.evaluation.ocr_reference, dataset,
                                             list(dataset.iter_pages(page_ids=[row["page_id"] for row in ev.pages])),
                                             ev.formula_metric)
        print(f"[evaluate] reference {ocr_reference['name']}: Overall {ocr_reference['overall']} (terms present "
              f"{ocr_reference['overall_present']}), text edit {ocr_reference['text_edit']} on the same "
              f"{ocr_reference['pages']} pages", flush=True)
        with mlflow.start_run(run_id=run_id):
            mlflow.log_metrics({f"reference.{ocr_reference['name']}.{key}": float(value) for key, value
                                in ocr_reference.items() if key in ("overall", "overall_present", "text_edit", "seconds_per_page")
                                and value is not None})
    common["ocr_reference"] = ocr_reference
    same_as = unchanged_from(cfg, model_dir)
    if same_as is not None:  # no stage kept a change: nothing to register, promote or deploy
        reason = f"nothing new to promote: the weights are those of {same_as}"
        print(f"[evaluate] {reason}; no version registered", flush=True)
        with mlflow.start_run(run_id=run_id):
            mlflow.set_tag("unchanged_from", same_as)
        return {**common, "version": None, "promoted": False, "unchanged": True, "gate_failures": [reason],
                "previous_champion": None, "gate_metric": None, "baseline": same_as, "baseline_score": None,
                "score": None}
    baseline_label, baseline = baseline_metrics(cfg, report, gates.score_decoder)
    if baseline is not None:  # both scores side by side on the challenger's run
        with mlflow.start_run(run_id=run_id):
            mlflow.log_metrics({f"baseline.{key}": value for key, value in baseline.items()})
            mlflow.set_tag("baseline", baseline_label)
    version = registry.register_version(run_id, cfg.evaluation.model_name,
                                        description=f"evaluated on {report.n_pages} pages; truth: {truth}")
    decision = registry.promote_if_passing(cfg.evaluation.model_name, version, gates, baseline=baseline,
                                           baseline_label=baseline_label)
    return {
        **common, "version": version, "promoted": decision.passed, "unchanged": False,
        "gate_failures": decision.reasons, "previous_champion": decision.previous_champion,
        "gate_metric": decision.score_metric,
        "baseline": baseline_label, "baseline_score": (baseline or {}).get(decision.score_metric or ""),
        "score": report.flat_metrics().get(decision.score_metric or ""),
    }


def unchanged_from(cfg: PipelineConfig, model_dir: Path) -> str | None:
    """The incumbent whose weights ``model_dir`` holds byte for byte (the champion, else the
    checkpoint the chain started from), or None when the weights are new."""

    fingerprint = model_fingerprint(model_dir)
    holder = registry.champion(cfg.evaluation.model_name)
    if holder is not None:
        folder = registry.download_model(f"models:/{cfg.evaluation.model_name}/{holder.version}")
        if model_fingerprint(folder) == fingerprint:
            return f"champion v{holder.version}"
    start = starting_checkpoint(cfg)
    if start is not None and model_fingerprint(start) == fingerprint:
        return f"starting checkpoint {start}"
    return None


def baseline_metrics(cfg: PipelineConfig, report: EvaluationReport, decoder: str) -> tuple[str | None, dict | None]:
    """The incumbent scored now, on the challenger's own pages with the same decoder settings: the
    champion, or on a first run the checkpoint training started from. (None, None) when there is
    neither (a model trained from scratch with no champion yet)."""

    holder = registry.champion(cfg.evaluation.model_name)
    if holder is not None:
        label = f"champion v{holder.version}"
        folder = registry.download_model(f"models:/{cfg.evaluation.model_name}/{holder.version}")
    else:
        folder = starting_checkpoint(cfg)
        if folder is None:
            return None, None
        label = f"starting checkpoint {folder}"
    dataset = PageDataset(cfg.evaluation_dir)
    page_ids = [row["page_id"] for row in report.decoders[decoder].pages]
    params = [DecodeParams(**report.decoders[decoder].params)]  # exactly the challenger's settings
    baseline = evaluate_decoders(DecodingEngine.from_pretrained(folder), dataset, params,
                                 pages=list(dataset.iter_pages(page_ids=page_ids)),
                                 parsing=parse_settings(cfg, folder),  # each model read as it was trained
                                 formula_metric=report.decoders[decoder].formula_metric)
    print(f"[evaluate] baseline {label}: {decoder} Overall {baseline.decoders[decoder].overall:.2f} on the same "
          f"{baseline.n_pages} pages", flush=True)
    return label, {key: value for key, value in baseline.flat_metrics().items() if key.startswith(f"{decoder}.")}


def parse_mode_comparison(cfg: PipelineConfig, page_model_dir: Path, element_model_dir: Path) -> dict:
    """The chain's page model beside the element model trained from the same start, on the same
    test pages, AR and SDB, interleaved (:mod:`components.evaluation.parse_modes`)."""

    dataset = PageDataset(cfg.evaluation_dir)
    for folder in (page_model_dir, element_model_dir):
        assert_held_out(folder, dataset)
    pages = [page for page in dataset.iter_pages(page_ids=dataset.ids(limit=cfg.evaluation.max_pages))
             if page.markup.strip()]
    budget = cfg.evaluation.max_new_tokens
    if budget == "auto":
        budget = token_budget(DecodingEngine.from_pretrained(page_model_dir), pages).max_new_tokens
    decoders = [DecodeParams(decoder=name, max_new_tokens=budget, threshold=cfg.evaluation.threshold,
                             window=cfg.evaluation.window) for name in ("ar", "sdb")]
    report = compare_parse_modes(DecodingEngine.from_pretrained(page_model_dir),
                                 DecodingEngine.from_pretrained(element_model_dir), pages,
                                 [dataset.load_image(p) for p in pages], decoders,
                                 formula_metric=cfg.evaluation.formula_metric)
    return {**report, "table": table(report), "page_model": str(page_model_dir),
            "element_model": str(element_model_dir)}


def drift_reference_of(model_name: str, alias: str = registry.CHAMPION_ALIAS) -> Path:
    """The drift reference saved by the evaluation that produced the alias holder."""
    holder = registry.champion(model_name, alias)
    if holder is None:
        raise LookupError(f"no model version of {model_name!r} holds alias {alias!r} yet")
    return Path(mlflow.artifacts.download_artifacts(run_id=holder.run_id, artifact_path=DRIFT_REFERENCE_ARTIFACT))
