"""What both annotation loops write: the table (median over seeds, min-max), the plot and the MLflow runs."""

from __future__ import annotations

import statistics
from pathlib import Path

import mlflow
import numpy as np

from components.registry.mlflow_registry import configure

EXPERIMENT = "annotation-loop"


def summary_table(curves: dict[str, dict[int, list[float]]], budget: int, digits: int = 2) -> str:
    """One row per policy, one column per round: median over seeds (min-max)."""
    rounds = len(next(iter(next(iter(curves.values())).values())))
    lines = ["| policy | " + " | ".join(f"{r * budget} pages" for r in range(rounds)) + " |",
             "|---|" + "---:|" * rounds]
    for policy, by_seed in curves.items():
        cells = []
        for r in range(rounds):
            values = [curve[r] for curve in by_seed.values()]
            cells.append(f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(curves: dict[str, dict[int, list[float]]], budget: int, path: Path, ylabel: str) -> None:
    import matplotlib  # deferred: plotting only, with the Agg backend chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: plotting only, with the Agg backend chosen first

    figure, axis = plt.subplots(figsize=(6, 4))
    for policy, by_seed in curves.items():
        rounds = np.arange(len(next(iter(by_seed.values())))) * budget
        values = np.array(list(by_seed.values()))
        axis.plot(rounds, np.median(values, axis=0), marker="o", label=policy)
        axis.fill_between(rounds, values.min(axis=0), values.max(axis=0), alpha=0.15)
    axis.set_xlabel("pages annotated")
    axis.set_ylabel(ylabel)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def log_curve(run_name: str, params: dict, metrics_by_round: list[dict[str, float]], budget: int) -> None:
    """One MLflow run of experiment ``annotation-loop``: the settings, and every metric by pages annotated."""
    configure(experiment=EXPERIMENT)
    with mlflow.start_run(run_name=run_name):
        mlflow.log_params(params)
        for round_index, metrics in enumerate(metrics_by_round):
            mlflow.log_metrics(metrics, step=round_index * budget)
