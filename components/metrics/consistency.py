"""Agreement between T stochastic decodes of the same page, for consistency mining.

When sampled outputs disagree the model is unsure, so the page is worth annotating; when they
agree, the output is a pseudo-label candidate. ``pairwise_consistency`` is the mean similarity
over all T·(T−1)/2 pairs, in [0, 1], with a similarity chosen per kind of output:

- ``"text"``: 1 − normalized edit distance of the normalized text;
- ``"formula"``: 1 − normalized LaTeX-token edit distance;
- ``"table"``: TEDS;
- ``"layout"``: mean matched IoU (``layout_similarity``); outputs are then lists of boxes;
- ``"page"``: ``page_similarity`` on two page markups (below).

Page similarity: both markups are split as the evaluation splits a prediction
(``extract_elements``) and grouped (text blocks, display formulas, HTML tables), each normalized
as the OmniDocBench metrics normalize it; inside each group blocks are matched one-to-one
(Hungarian on edit distance) and a matched pair scores TEDS for tables and 1 − normalized edit
distance otherwise. Unmatched blocks on either side score 0,
and every block counts once, so the result is
``sum(matched similarities) / sum over groups of max(n_a, n_b)``; two empty pages score 1.
Neither side is ground truth, so the measure is symmetric.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from typing import Any

import numpy as np
from rapidfuzz import process
from rapidfuzz.distance import Levenshtein
from scipy.optimize import linear_sum_assignment

from components.metrics.extraction import DISPLAY_FORMULA, HTML_TABLE, TEXT, extract_elements
from components.metrics.formula import formula_edit_distance, normalize_formula
from components.metrics.layout import layout_similarity
from components.metrics.table import normalize_table_html, teds
from components.metrics.text import normalize_text, normalized_edit_distance

CONSISTENCY_KINDS = ("text", "formula", "table", "layout", "page")
_SCORED_GROUPS = ("text", "table", "formula")


def _page_groups(markup: str) -> dict[str, list[str]]:
    """Text blocks, display formulas and HTML tables of a page, read as the evaluation reads them."""
    groups: dict[str, list[str]] = {group: [] for group in _SCORED_GROUPS}
    for element in extract_elements(markup or ""):
        if element.category == TEXT:
            groups["text"].append(element.content)
        elif element.kind == DISPLAY_FORMULA:
            groups["formula"].append(element.content)
        elif element.category == HTML_TABLE:
            groups["table"].append(element.content)
    return groups


def _assign(items_a: list[str], items_b: list[str]) -> list[tuple[int, int]]:
    """Hungarian matching on normalized edit distance."""
    if not items_a or not items_b:
        return []
    cost = process.cdist(items_a, items_b, scorer=Levenshtein.normalized_distance, dtype=np.float64, workers=1)
    rows, cols = linear_sum_assignment(cost)
    return [(int(r), int(c)) for r, c in zip(rows, cols, strict=True)]


def page_similarity(markup_a: str, markup_b: str) -> float:
    """Block-matched similarity of two page markups in [0, 1] (see the module docstring)."""
    groups_a, groups_b = _page_groups(markup_a), _page_groups(markup_b)
    total_blocks = sum(max(len(groups_a[g]), len(groups_b[g])) for g in _SCORED_GROUPS)
    if total_blocks == 0:
        return 1.0
    matched_similarity = 0.0
    for group in _SCORED_GROUPS:
        blocks_a, blocks_b = groups_a[group], groups_b[group]
        normalize = {"text": normalize_text, "formula": normalize_formula, "table": normalize_table_html}[group]
        items_a, items_b = [normalize(b) for b in blocks_a], [normalize(b) for b in blocks_b]
        for i, j in _assign(items_a, items_b):
            if group == "table":
                matched_similarity += 1.0 if items_a[i] == items_b[j] else teds(blocks_a[i], blocks_b[j])
            else:
                matched_similarity += 1.0 - normalized_edit_distance(items_a[i], items_b[j])
    return matched_similarity / total_blocks


def similarity(a: Any, b: Any, kind: str) -> float:
    """Similarity in [0, 1] of two outputs of the given kind (1 = the same)."""
    if kind == "layout":
        return layout_similarity(a, b)
    if not isinstance(a, str) or not isinstance(b, str):
        raise TypeError(f"kind {kind!r} compares strings, got {type(a).__name__} and {type(b).__name__}")
    if a == b:
        return 1.0
    if kind == "text":
        return 1.0 - normalized_edit_distance(normalize_text(a), normalize_text(b))
    if kind == "formula":
        return 1.0 - formula_edit_distance(a, b)
    if kind == "table":
        return teds(a, b)
    if kind == "page":
        return page_similarity(a, b)
    raise ValueError(f"unknown consistency kind {kind!r}; expected one of {CONSISTENCY_KINDS}")


def pairwise_consistency(outputs: Sequence[Any], kind: str) -> float:
    """Mean similarity over all pairs of T ≥ 2 sampled outputs; 1.0 when all outputs agree."""
    if kind not in CONSISTENCY_KINDS:
        raise ValueError(f"unknown consistency kind {kind!r}; expected one of {CONSISTENCY_KINDS}")
    if len(outputs) < 2:
        raise ValueError(f"consistency needs at least 2 sampled outputs, got {len(outputs)}")
    pairs = list(combinations(outputs, 2))
    return sum(similarity(a, b, kind) for a, b in pairs) / len(pairs)
