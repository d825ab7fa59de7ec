"""Drift checks: do served pages still look like the evaluation split?

Two signals need no labels: the model's mean token confidence and its output length. Each is
compared between the evaluation split (reference) and a window of production requests with a
two-sample Kolmogorov-Smirnov test and the Population Stability Index (PSI, on reference
quantile bins). Each signal gets a verdict that follows both tests and their thresholds:
``drift`` when PSI exceeds its threshold *and* the KS test rejects, ``none`` when neither does, and
``inconclusive`` when they disagree (a PSI of 4 with a KS p of 0.2 is not "no drift"). Below
:data:`MIN_VERDICT_PAGES` served pages there is no verdict at all: "not enough production pages".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy import stats

SIGNALS = ("mean_confidence", "new_tokens")
# Fewer served pages than this give no verdict: with 4 pages a KS test cannot reject anything and
# PSI over 10 bins is noise (a drift of 4.3 PSI was once called "none" on 4 pages).
MIN_VERDICT_PAGES = 20
PSI_THRESHOLD = 0.2
KS_PVALUE_THRESHOLD = 0.01


class NotEnoughPagesError(ValueError):
    """Too few production pages for a drift verdict."""


@dataclass
class SignalDrift:
    signal: str
    reference_mean: float
    production_mean: float
    psi: float
    ks_statistic: float
    ks_pvalue: float
    verdict: str  # drift | none | inconclusive

    @property
    def drifted(self) -> bool:
        return self.verdict == "drift"


def signal_verdict(psi: float, ks_pvalue: float, psi_threshold: float, pvalue_threshold: float) -> str:
    """``drift`` when both tests say so, ``none`` when neither does, else ``inconclusive``."""
    psi_says, ks_says = psi > psi_threshold, ks_pvalue < pvalue_threshold
    if psi_says and ks_says:
        return "drift"
    return "inconclusive" if psi_says or ks_says else "none"


@dataclass
class DriftReport:
    n_reference: int
    n_production: int
    signals: list[SignalDrift]
    psi_threshold: float = PSI_THRESHOLD
    pvalue_threshold: float = KS_PVALUE_THRESHOLD

    @property
    def drifted(self) -> bool:
        return any(s.drifted for s in self.signals)

    @property
    def verdict(self) -> str:
        verdicts = {s.verdict for s in self.signals}
        return "drift" if "drift" in verdicts else "inconclusive" if "inconclusive" in verdicts else "none"

    def summary(self) -> str:
        """One line: the verdict, then each signal's PSI and KS p beside their thresholds."""
        parts = [f"{s.signal} PSI {s.psi:.2f} {'>' if s.psi > self.psi_threshold else '<='} {self.psi_threshold:g}, "
                 f"KS p {s.ks_pvalue:.3f} {'<' if s.ks_pvalue < self.pvalue_threshold else '>='} {self.pvalue_threshold:g}"
                 f": {s.verdict}" for s in self.signals]
        return (f"{self.verdict.upper() if self.verdict == 'drift' else self.verdict} on {self.n_production} served pages "
                f"vs {self.n_reference} reference ({'; '.join(parts)})")

    def as_dict(self) -> dict:
        return {"n_reference": self.n_reference, "n_production": self.n_production, "drifted": self.drifted,
                "verdict": self.verdict, "psi_threshold": self.psi_threshold,
                "pvalue_threshold": self.pvalue_threshold, "summary": self.summary(),
                "signals": [asdict(s) | {"drifted": s.drifted} for s in self.signals]}

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
    reference: dict[str, list[float]], production: dict[str, list[float]], psi_threshold: float = PSI_THRESHOLD,
    pvalue_threshold: float = KS_PVALUE_THRESHOLD, min_production: int = MIN_VERDICT_PAGES,
) -> DriftReport:
    """Compare each signal; needs ``min_production`` (never fewer than :data:`MIN_VERDICT_PAGES`)
    served pages to say anything."""
    signals = []
    n_ref = len(next(iter(reference.values()), []))
    n_prod = len(next(iter(production.values()), []))
    needed = max(min_production, MIN_VERDICT_PAGES)
    if n_prod < needed:
        raise NotEnoughPagesError(f"not enough production pages: {n_prod} < {needed}")
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
            verdict=signal_verdict(psi, float(ks.pvalue), psi_threshold, pvalue_threshold),
        ))
    return DriftReport(n_reference=n_ref, n_production=n_prod, signals=signals, psi_threshold=psi_threshold,
                       pvalue_threshold=pvalue_threshold)


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
