"""Timing contenders against each other on one machine: page by page in rotating order, repeated.

A contender is a callable ``image -> (token ids, seconds, forward passes)``. Running every contender
on a page before moving on, with the order rotated per page and per repeat, makes machine load
(other processes, thermal state) hit all of them alike, so the per-repeat ratios are what to quote.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

Totals = tuple[int, float, int]  # tokens, seconds, forward passes of one repeat over all pages
Contender = Callable[[Any], tuple[list[int], float, int]]


def interleave(contenders: dict[str, Contender], images: Sequence[Any], repeats: int
               ) -> tuple[dict[str, list[Totals]], list[dict[str, list[list[int]]]]]:
    """(per contender: totals of each repeat, per repeat: each contender's output ids page by page)."""
    names = list(contenders)
    totals: dict[str, list[Totals]] = {name: [] for name in names}
    outputs: list[dict[str, list[list[int]]]] = []
    for repeat in range(repeats):
        sums = {name: [0, 0.0, 0] for name in names}
        pages: dict[str, list[list[int]]] = {name: [] for name in names}
        for page_index, image in enumerate(images):
            shift = (page_index + repeat) % len(names)
            for name in names[shift:] + names[:shift]:
                ids, seconds, forwards = contenders[name](image)
                sums[name][0] += len(ids)
                sums[name][1] += seconds
                sums[name][2] += forwards
                pages[name].append(ids)
        for name in names:
            totals[name].append(tuple(sums[name]))
        outputs.append(pages)
    return totals, outputs


def summary(per_repeat: list[Totals], peer: list[Totals] | None) -> dict:
    """Median tokens/s over the repeats (min-max), tokens per forward, and the median per-repeat ratio
    to ``peer``'s tokens/s."""
    rates = [tokens / seconds for tokens, seconds, _ in per_repeat]
    row = {
        "tokens_per_second": statistics.median(rates), "min": min(rates), "max": max(rates),
        "tokens_per_forward": per_repeat[0][0] / max(1, per_repeat[0][2]),
    }
    if peer is not None:
        ratios = [(t / s) / (pt / ps) for (t, s, _), (pt, ps, _) in zip(per_repeat, peer, strict=True)]
        row |= {"vs_generate": statistics.median(ratios), "vs_generate_min": min(ratios), "vs_generate_max": max(ratios)}
    return row
