"""MLflow tracking and model registry: log evaluation runs, register versions, gate the champion alias.

It knows metrics and artifact folders, not how an evaluation is computed or drawn (that is
``components.evaluation``, which calls this module), so the registry never imports evaluation.

MLflow 3 deprecated stages, so promotion is an alias (``champion``) moved only when gates pass.
Metrics are logged on the run that produced the version, which is where the registry UI and
``get_model_version`` look for them (a recurring complaint when they are logged elsewhere).
The default store is SQLite under ``var/mlflow``; a tracking server URL works the same.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from components.services.process import VAR_DIR

DEFAULT_MODEL_NAME = "docmarkup"
CHAMPION_ALIAS = "champion"


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a SQLite file under ``var/mlflow``."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    folder = VAR_DIR / "mlflow"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}"


# MLflow 3's UI opens an experiment without this tag on its GenAI overview ("No data available");
# tagged as model development it opens on the runs, where training and evaluation log.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def configure(tracking_uri: str | None = None, experiment: str = "docmarkup") -> str:
    """Point MLflow at the store and make sure the experiment exists; returns its id.

    With a SQLite store, artifacts go to ``var/mlflow/artifacts`` instead of ``./mlruns``
    relative to whatever directory the process happens to run in.
    """
    uri = tracking_uri or default_tracking_uri()
    mlflow.set_tracking_uri(uri)
    existing = mlflow.get_experiment_by_name(experiment)
    if existing is not None:
        experiment_id = existing.experiment_id
        if existing.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
            MlflowClient().set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    else:
        location = None
        if uri.startswith("sqlite:///"):
            location = (Path(uri.removeprefix("sqlite:///")).parent / "artifacts").resolve().as_uri()
        experiment_id = mlflow.create_experiment(experiment, artifact_location=location,
                                                 tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


@dataclass(frozen=True)
class Gates:
    """What a candidate must show before it becomes champion.

    ``min_improvement``: how many points of the gated score a candidate must gain over the incumbent
    (strictly more than this; 0: strictly better). Each promotion is a reload in production, so a
    candidate that ties its incumbent is not promoted, unless it is faster: at least
    ``tie_speed_gain`` times the incumbent's tokens/s with the score decoder, measured in the same run,
    and then no more than ``max_score_drop`` points below it.
    ``min_speedup``: the speed ratio over AR, measured in the same run, of ``speed_decoder``.
    ``min_overall``: an absolute floor, so a first model cannot be champion just by existing.
    ``score_metric``: ``overall`` (OmniDocBench's, a missing term counting 0), ``overall_present``
    (the mean of the terms the test set has), or ``auto``: ``overall`` when the test set has text,
    tables and formulas, else ``overall_present`` (a prose-only set's Overall can never pass 33.3).
    """

    max_score_drop: float = 0.0
    min_improvement: float = 0.0
    tie_speed_gain: float = 1.2
    min_speedup: float = 1.0
    speed_decoder: str = "sdb"
    speed_metric: str = "forward_reduction"
    score_decoder: str = "ar"
    min_overall: float = 0.0
    score_metric: str = "auto"


def score_key_for(candidate: dict[str, float], gates: Gates) -> str:
    """The metric the score gates read: ``<decoder>.overall`` or ``<decoder>.overall_present``."""
    metric = gates.score_metric
    if metric == "auto":
        terms = candidate.get(f"{gates.score_decoder}.overall_terms")
        metric = "overall" if terms is None or terms >= 3 else "overall_present"
    if metric not in ("overall", "overall_present"):
        raise ValueError(f"score_metric must be overall, overall_present or auto, not {gates.score_metric!r}")
    return f"{gates.score_decoder}.{metric}"


@dataclass
class PromotionDecision:
    passed: bool
    version: str
    reasons: list[str] = field(default_factory=list)
    previous_champion: str | None = None
    score_metric: str | None = None  # the metric the score gates read (named in every report)
    baseline: str | None = None  # what the challenger was compared with on its own pages, if anything


def log_evaluation(
    metrics: dict[str, float], model_dir: str | Path, *, write_artifacts: Callable[[Path], None] | None = None,
    params: dict | None = None, data_version: str | None = None, run_name: str = "evaluate", tags: dict | None = None,
    started_at: float | None = None, experiment_id: str | None = None,
) -> str:
    """Log one evaluation as a run: metrics, the files ``write_artifacts`` writes, the model folder.
    ``started_at`` (epoch seconds, with ``experiment_id``): when the evaluation began, so the run's
    duration spans the evaluation rather than the logging."""
    run_id = None
    if started_at is not None and experiment_id is not None:
        run_id = MlflowClient().create_run(experiment_id, run_name=run_name, start_time=int(started_at * 1000)).info.run_id
    with mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name) as run:
        mlflow.log_params({k: str(v)[:500] for k, v in (params or {}).items()})
        mlflow.set_tags({"data_version": data_version or "unversioned", **(tags or {})})
        mlflow.log_metrics(metrics)
        if write_artifacts is not None:
            with tempfile.TemporaryDirectory() as tmp:
                write_artifacts(Path(tmp))
                mlflow.log_artifacts(tmp, artifact_path="evaluation")
        mlflow.log_artifacts(str(model_dir), artifact_path="model")
        return run.info.run_id


def register_version(run_id: str, name: str = DEFAULT_MODEL_NAME, description: str = "") -> str:
    """Register the run's ``model/`` folder as a new version of ``name``; returns the version."""
    client = MlflowClient()
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="Page image to markup models (docmarkup-ops)")
    run = client.get_run(run_id)
    # MLflow's registry records no user for a version (its "Created by" stays blank without the auth
    # app): the run's user goes into a tag, shown on the version's page.
    version = client.create_model_version(
        name, source=f"{run.info.artifact_uri}/model", run_id=run_id, description=description,
        tags={"created_by": run.info.user_id or "unknown"},
    )
    return str(version.version)


def champion(name: str = DEFAULT_MODEL_NAME, alias: str = CHAMPION_ALIAS):
    """The model version holding the alias, or None."""
    try:
        return MlflowClient().get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def version_metrics(name: str, version: str) -> dict[str, float]:
    client = MlflowClient()
    model_version = client.get_model_version(name, version)
    return dict(client.get_run(model_version.run_id).data.metrics)


def check_gates(candidate: dict[str, float], incumbent: dict[str, float] | None, gates: Gates,
                incumbent_label: str = "the champion's", incumbent_serves: bool = True) -> list[str]:
    """Reasons the candidate fails (empty list = passes). Pure, so it is tested without MLflow.
    ``incumbent_serves``: the incumbent is a served champion, so a tie would only cost a reload (a first
    champion, compared with the checkpoint training started from, may be within ``max_score_drop``)."""
    failures = []
    score_key = score_key_for(candidate, gates)
    speed_key = f"{gates.speed_decoder}.{gates.speed_metric}"
    score = candidate.get(score_key)
    if score is None:
        failures.append(f"candidate has no {score_key} metric")
    elif score < gates.min_overall:
        failures.append(f"{score_key}={score:.2f} is below the floor {gates.min_overall:.2f}")
    if incumbent is not None and score is not None and score_key in incumbent:
        if incumbent_serves:
            failures += _against_incumbent(candidate, incumbent, score_key, gates, incumbent_label)
        elif score < incumbent[score_key] - gates.max_score_drop:
            failures.append(f"{score_key}={score:.2f} is below {incumbent_label} {incumbent[score_key]:.2f} - {gates.max_score_drop}")
    speed = candidate.get(speed_key)
    if speed is None:
        failures.append(f"candidate has no {speed_key} metric")
    elif speed < gates.min_speedup:
        failures.append(f"{speed_key}={speed:.2f} is below the required {gates.min_speedup:.2f}x")
    return failures


def _against_incumbent(candidate: dict[str, float], incumbent: dict[str, float], score_key: str, gates: Gates,
                       incumbent_label: str) -> list[str]:
    """Better than the incumbent by more than ``min_improvement``, or as good (within
    ``max_score_drop``) and faster by ``tie_speed_gain``; else the reason, with both numbers."""
    score, held = candidate[score_key], incumbent[score_key]
    if score - held > gates.min_improvement:
        return []
    if score < held - gates.max_score_drop:
        return [f"{score_key}={score:.2f} is below {incumbent_label} {held:.2f} - {gates.max_score_drop}"]
    speed_key = f"{gates.score_decoder}.tokens_per_second"
    ratio = _ratio_of(candidate.get(speed_key), incumbent.get(speed_key))
    if ratio is not None and ratio >= gates.tie_speed_gain:
        return []
    speed = "no speed of the incumbent to compare" if ratio is None else f"{ratio:.2f}x its tokens/s"
    return [f"{score_key}={score:.2f} does not improve on {incumbent_label} {held:.2f} by more than "
            f"{gates.min_improvement:g} (min_improvement) and reads at {speed} (tie_speed_gain "
            f"{gates.tie_speed_gain:g}x): a tie is not promoted"]


def _ratio_of(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else float(numerator) / float(denominator)


def gates_description(candidate: dict[str, float], incumbent: dict[str, float] | None, gates: Gates,
                      decision: PromotionDecision) -> str:
    """The registered version's description: each gate, its threshold and this version's value."""
    score_key = decision.score_metric or score_key_for(candidate, gates)
    speed_key = f"{gates.speed_decoder}.{gates.speed_metric}"

    def value(metrics: dict[str, float] | None, key: str) -> str:
        return "missing" if not metrics or key not in metrics else f"{metrics[key]:.2f}"

    lines = [f"{'PROMOTED to' if decision.passed else 'NOT promoted to'} {CHAMPION_ALIAS} "
             f"(previous holder: {decision.previous_champion or 'none'}).",
             f"- {score_key} = {value(candidate, score_key)} >= floor {gates.min_overall:.2f}"]
    if incumbent is not None:
        against = decision.baseline or "the champion's stored score"
        if decision.previous_champion is None:  # a first champion: nothing served to reload
            lines.append(f"- {score_key} >= {value(incumbent, score_key)} ({against}) - {gates.max_score_drop}")
        else:
            lines.append(f"- {score_key} > {value(incumbent, score_key)} ({against}) + {gates.min_improvement:g}, or within "
                         f"{gates.max_score_drop:g} of it at {gates.tie_speed_gain:g}x its tokens/s")
    lines.append(f"- {speed_key} = {value(candidate, speed_key)} >= {gates.min_speedup:.2f}")
    lines += [f"- failed: {reason}" for reason in decision.reasons]
    return "\n".join(lines)


def promote_if_passing(name: str, version: str, gates: Gates, alias: str = CHAMPION_ALIAS,
                       baseline: dict[str, float] | None = None, baseline_label: str | None = None) -> PromotionDecision:
    """Move ``alias`` to ``version`` only if it passes ``gates`` against the current holder.

    ``baseline``: the incumbent's metrics measured in this run on the challenger's own pages with
    the same decoders (or, on a first run, those of the checkpoint training started from). When
    given it is what the challenger must not fall below; otherwise the holder's stored metrics,
    measured on whatever pages its own run had, are used.
    """
    current = champion(name, alias)
    incumbent = None
    if baseline is not None:
        incumbent = baseline
    elif current is not None and str(current.version) != str(version):
        incumbent = version_metrics(name, str(current.version))
    metrics = version_metrics(name, version)
    label = f"{baseline_label} (same pages, this run)" if baseline is not None and baseline_label else "the champion's"
    reasons = check_gates(metrics, incumbent, gates, incumbent_label=label, incumbent_serves=current is not None)
    decision = PromotionDecision(
        passed=not reasons, version=str(version), reasons=reasons,
        previous_champion=None if current is None else str(current.version), score_metric=score_key_for(metrics, gates),
        baseline=baseline_label,
    )
    client = MlflowClient()
    client.set_model_version_tag(name, version, "gates", json.dumps({"passed": decision.passed, "score_metric_used": decision.score_metric,
                                                                 "reasons": reasons, **asdict(gates)}))
    client.update_model_version(name, version, description=gates_description(metrics, incumbent, gates, decision))
    if decision.passed:
        client.set_registered_model_alias(name, alias, version)
    return decision


def download_model(uri: str, dst: str | Path | None = None) -> Path:
    """Fetch a model folder from ``models:/name@alias``, ``models:/name/3``, ``runs:/...`` or a path."""
    if Path(uri).is_dir():
        return Path(uri)
    target = Path(dst) if dst else Path(tempfile.mkdtemp(prefix="docmarkup-model-"))
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(target))
    except MlflowException as exc:
        raise LookupError(f"cannot resolve model {uri!r} in MLflow at {mlflow.get_tracking_uri()}: {exc}") from exc
    return Path(local)
