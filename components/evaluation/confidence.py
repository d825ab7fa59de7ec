"""Does a confidence mean something? Rank, budget and calibration checks against measured errors.

The annotator queue takes the least confident pages first and mining the least consistent ones,
so a confidence is worth what it tells about errors: how well it ranks them (Spearman), what share
of all errors a small review budget over the least confident items would catch, and whether a
stated confidence of 0.9 reads about 90 % of the characters right (a reliability table).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def rank_correlation(confidences: Sequence[float], errors: Sequence[float]) -> float | None:
    """Spearman's rho between confidence and error (-1: the least confident are the worst read);
    None when undefined (under 3 items, or either side constant)."""
    from scipy.stats import spearmanr  # deferred: only this statistic needs SciPy

    if len(confidences) < 3 or len(set(confidences)) < 2 or len(set(errors)) < 2:
        return None
    return round(float(spearmanr(confidences, errors).statistic), 3)


def least_confident_share(confidences: Sequence[float], errors: Sequence[float], fraction: float = 0.1) -> float | None:
    """The share of all errors held by the ``fraction`` least confident items (at least one item;
    ties broken by the order given); None when there is no error at all."""
    total = float(sum(errors))
    if not confidences or total <= 0:
        return None
    count = max(1, math.ceil(fraction * len(confidences)))
    order = sorted(range(len(confidences)), key=lambda i: confidences[i])[:count]
    return round(sum(errors[i] for i in order) / total, 4)


def reliability_table(confidences: Sequence[float], errors: Sequence[int], lengths: Sequence[int],
                      bins: int = 5) -> list[dict]:
    """Items in ``bins`` groups of equal count by confidence; per group its confidence range, the
    mean confidence and the character accuracy (1 - pooled errors / characters): calibrated when
    the two agree."""
    order = sorted(range(len(confidences)), key=lambda i: confidences[i])
    table = []
    for b in range(bins):
        group = order[b * len(order) // bins:(b + 1) * len(order) // bins]
        if not group:
            continue
        chars = sum(lengths[i] for i in group)
        table.append({"confidence_range": [round(confidences[group[0]], 4), round(confidences[group[-1]], 4)],
                      "items": len(group), "mean_confidence": round(sum(confidences[i] for i in group) / len(group), 4),
                      "character_accuracy": round(1.0 - sum(errors[i] for i in group) / max(1, chars), 4)})
    return table
