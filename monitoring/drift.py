"""Drift checks: do served pages still look like the evaluation split?

Two signals need no labels: the model's mean token confidence and its output length. Each is
compared between the evaluation split (reference) and a window of production requests with a
two-sample Kolmogorov-Smirnov test and the Population Stability Index (PSI, on reference
quantile bins). Drift is declared when PSI exceeds its threshold *and* the KS test rejects, so a
small window does not page anyone on noise alone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy import stats

SIGNALS = ("mean_confidence", "new_tokens")


@dataclass
class SignalDrift:
    signal: str
    reference_mean: float
    production_mean: float
    psi: float
    ks_statistic: float
    ks_pvalue: float
    drifted: bool


@dataclass
class DriftReport:
    n_reference: int
    n_production: int
    signals: list[SignalDrift]

    @property
    def drifted(self) -> bool:
        return any(s.drifted for s in self.signals)

    def as_dict(self) -> dict:
        return {"n_reference": self.n_reference, "n_production": self.n_production, "drifted": self.drifted,
                "signals": [asdict(s) for s in self.signals]}

    def flat_metrics(self) -> dict[str, float]:
        metrics = {"drift.any": float(self.drifted), "drift.n_production": float(self.n_production)}
        for s in self.signals:
            metrics |= {f"drift.{s.signal}.psi": s.psi, f"drift.{s.signal}.ks_pvalue": s.ks_pvalue,
                        f"drift.{s.signal}.production_mean": s.production_mean}
        return metrics


def population_stability_index(reference: np.ndarray, production: np.ndarray, bins: int = 10) -> float:
    """PSI over the reference's quantile bins; 0 = same distribution, > 0.2 is the usual alarm."""
    edges = np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1)))
    if len(edges) < 2:  # a constant reference: compare "equal to it" vs not
        same_ref, same_prod = 1.0, float(np.mean(production == reference[0]))
        ref_frac, prod_frac = np.array([same_ref, 0.0]), np.array([same_prod, 1 - same_prod])
    else:
        edges[0], edges[-1] = -np.inf, np.inf
        ref_frac = np.histogram(reference, edges)[0] / len(reference)
        prod_frac = np.histogram(production, edges)[0] / len(production)
    eps = 1e-4
    ref_frac, prod_frac = np.clip(ref_frac, eps, None), np.clip(prod_frac, eps, None)
    return float(np.sum((prod_frac - ref_frac) * np.log(prod_frac / ref_frac)))


def check_drift(
    reference: dict[str, list[float]], production: dict[str, list[float]], psi_threshold: float = 0.2,
    pvalue_threshold: float = 0.01, min_production: int = 20,
) -> DriftReport:
    """Compare each signal; needs ``min_production`` served pages to say anything."""
    signals = []
    n_ref = len(next(iter(reference.values()), []))
    n_prod = len(next(iter(production.values()), []))
    if n_prod < min_production:
        raise ValueError(f"drift check needs at least {min_production} production pages, got {n_prod}")
    for name in SIGNALS:
        ref = np.asarray(reference.get(name, []), dtype=float)
        prod = np.asarray(production.get(name, []), dtype=float)
        if ref.size == 0:
            raise ValueError(f"reference has no values for {name!r}")
        psi = population_stability_index(ref, prod)
        ks = stats.ks_2samp(ref, prod)
        signals.append(SignalDrift(
            signal=name, reference_mean=float(ref.mean()), production_mean=float(prod.mean()), psi=psi,
            ks_statistic=float(ks.statistic), ks_pvalue=float(ks.pvalue),
            drifted=bool(psi > psi_threshold and ks.pvalue < pvalue_threshold),
        ))
    return DriftReport(n_reference=n_ref, n_production=n_prod, signals=signals)


def reference_from_evaluation(pages: list[dict]) -> dict[str, list[float]]:
    """Reference signals from an evaluation's per-page rows (``DecoderEvaluation.pages``)."""
    return {name: [float(row[name]) for row in pages] for name in SIGNALS}


def save_reference(pages: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(reference_from_evaluation(pages)))
    return path


def load_reference(path: str | Path) -> dict[str, list[float]]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no drift reference at {path}; the evaluation flow writes it next to the model")
    return json.loads(path.read_text())
