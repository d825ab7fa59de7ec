"""Page-level end-to-end scoring of predicted markup against ground truth, OmniDocBench v1.5 style.

Both markups are split into blocks with ``parse_markup`` and grouped: **text** (text + title
blocks), **table** and **formula**. Inside each group, predicted blocks are matched one-to-one to
ground-truth blocks by ``scipy.optimize.linear_sum_assignment`` on normalized edit distance
(OmniDocBench's matching). Then:

- **text_edit** (per page): the normalized edit distance between the ground-truth text blocks
  concatenated in reading order and, in the same order, the predicted blocks matched to them
  (an unmatched gt block contributes nothing on the prediction side), followed by the unmatched
  predicted text blocks. Missing and hallucinated text both cost. Text is normalized with
  ``normalize_text`` first. Dataset value: mean over pages whose ground truth has text.
- **table_teds / table_teds_s**: TEDS and TEDS-S of each ground-truth table against its matched
  prediction (0 when unmatched). Extra predicted tables are not scored (no gt to compare).
  Dataset value: mean over all ground-truth tables (element level, as OmniDocBench reports TEDS).
- **formula_edit**: normalized LaTeX-token edit distance per formula pair; an unmatched gt
  formula scores 1, and so does each unmatched predicted formula. Dataset value: mean over all
  pairs. This stands in for CDM, which needs LaTeX + node + ImageMagick to render formulas.
- **reading_order_edit** (per page): take the matched pairs that share any content (text or
  formula distance < 1, table TEDS > 0), list their gt indices in gt order and in predicted
  order, and take the normalized edit distance between the two lists. Dataset value: mean over
  pages that have at least one such pair.
- **overall** = ((1 − text_edit)·100 + table_teds·100 + (1 − formula_edit)·100) / 3, with the
  formula term from the edit distance instead of CDM. When a component is absent (no tables in
  the ground truth, say) the mean is over the components present; None when none is.

A category that the ground truth of a page does not contain is not scored on that page (None, not
0 or 1), even if the prediction contains it; dataset means run only over where it exists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from rapidfuzz import process
from rapidfuzz.distance import Levenshtein
from scipy.optimize import linear_sum_assignment

from components.data.markup import MarkupBlock, parse_markup
from components.metrics.formula import normalize_latex_tokens
from components.metrics.table import teds_pair
from components.metrics.text import normalize_text, normalized_edit_distance

SCORED_GROUPS = ("text", "table", "formula")
_GROUP_OF_CATEGORY = {"text": "text", "title": "text", "table": "table", "formula": "formula"}


@dataclass(frozen=True)
class BlockMatch:
    """One scored pair; an index is None on the side where the block is missing.

    ``score`` is a normalized edit distance for text/formula blocks and TEDS for tables.
    """

    group: str
    gt_index: int | None
    pred_index: int | None
    score: float


@dataclass
class PageScores:
    """Scores of one page; a metric is None when the ground truth has no block of that kind."""

    text_edit: float | None
    table_teds: float | None
    table_teds_s: float | None
    formula_edit: float | None
    reading_order_edit: float | None
    overall: float | None
    table_scores: list[tuple[float, float]] = field(default_factory=list)
    formula_edits: list[float] = field(default_factory=list)
    gt_counts: dict[str, int] = field(default_factory=dict)
    pred_counts: dict[str, int] = field(default_factory=dict)
    matches: list[BlockMatch] = field(default_factory=list)


@dataclass
class DatasetScores:
    """Scores aggregated over pages; metrics are None when no page had the category."""

    n_pages: int
    text_edit: float | None
    table_teds: float | None
    table_teds_s: float | None
    formula_edit: float | None
    reading_order_edit: float | None
    overall: float | None
    n_pages_with_text: int = 0
    n_pages_with_reading_order: int = 0
    n_tables: int = 0
    n_formula_pairs: int = 0
    gt_counts: dict[str, int] = field(default_factory=dict)
    pred_counts: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        """Flat float metrics for MLflow; metrics that are None are left out (MLflow cannot log None)."""
        metrics: dict[str, float | None] = {
            "text_edit": self.text_edit,
            "table_teds": self.table_teds,
            "table_teds_s": self.table_teds_s,
            "formula_edit": self.formula_edit,
            "reading_order_edit": self.reading_order_edit,
            "overall": self.overall,
        }
        flat = {name: float(value) for name, value in metrics.items() if value is not None}
        flat["n_pages"] = float(self.n_pages)
        flat["n_pages_with_text"] = float(self.n_pages_with_text)
        flat["n_pages_with_reading_order"] = float(self.n_pages_with_reading_order)
        flat["n_tables"] = float(self.n_tables)
        flat["n_formula_pairs"] = float(self.n_formula_pairs)
        for group in SCORED_GROUPS:
            flat[f"n_gt_{group}"] = float(self.gt_counts.get(group, 0))
            flat[f"n_pred_{group}"] = float(self.pred_counts.get(group, 0))
        return flat


def overall_score(text_edit: float | None, table_teds: float | None, formula_edit: float | None) -> float | None:
    """OmniDocBench Overall on a 0–100 scale, averaged over the components that are present."""
    terms = []
    if text_edit is not None:
        terms.append((1.0 - text_edit) * 100.0)
    if table_teds is not None:
        terms.append(table_teds * 100.0)
    if formula_edit is not None:
        terms.append((1.0 - formula_edit) * 100.0)
    return sum(terms) / len(terms) if terms else None


def group_blocks(blocks: list[MarkupBlock]) -> dict[str, list[tuple[int, MarkupBlock]]]:
    """Blocks by scored group (text+title, table, formula), each kept with its index on the page."""
    groups: dict[str, list[tuple[int, MarkupBlock]]] = {group: [] for group in SCORED_GROUPS}
    for index, block in enumerate(blocks):
        group = _GROUP_OF_CATEGORY.get(block.category)
        if group is not None:
            groups[group].append((index, block))
    return groups


def assign_by_edit_distance(pred_items: list, gt_items: list) -> list[tuple[int, int]]:
    """Hungarian matching on normalized edit distance; returns (pred position, gt position) pairs."""
    if not pred_items or not gt_items:
        return []
    cost = process.cdist(pred_items, gt_items, scorer=Levenshtein.normalized_distance, dtype=np.float64, workers=1)
    rows, cols = linear_sum_assignment(cost)
    return [(int(r), int(c)) for r, c in zip(rows, cols, strict=True)]


def _score_text(pred: list[tuple[int, MarkupBlock]], gt: list[tuple[int, MarkupBlock]]) -> tuple[float, list[BlockMatch]]:
    pred_text = [normalize_text(block.content) for _, block in pred]
    gt_text = [normalize_text(block.content) for _, block in gt]
    pred_for_gt: dict[int, int] = {g: p for p, g in assign_by_edit_distance(pred_text, gt_text)}
    matches: list[BlockMatch] = []
    pred_concat: list[str] = []
    for g, text in enumerate(gt_text):
        p = pred_for_gt.get(g)
        predicted = pred_text[p] if p is not None else ""
        pred_concat.append(predicted)
        matches.append(BlockMatch("text", gt[g][0], pred[p][0] if p is not None else None,
                                  normalized_edit_distance(predicted, text)))
    matched_pred = set(pred_for_gt.values())
    for p, text in enumerate(pred_text):
        if p not in matched_pred:
            pred_concat.append(text)
            matches.append(BlockMatch("text", None, pred[p][0], 1.0 if text else 0.0))
    return normalized_edit_distance("".join(pred_concat), "".join(gt_text)), matches


def _score_formulas(pred: list[tuple[int, MarkupBlock]], gt: list[tuple[int, MarkupBlock]]) -> list[BlockMatch]:
    pred_tokens = [normalize_latex_tokens(block.content) for _, block in pred]
    gt_tokens = [normalize_latex_tokens(block.content) for _, block in gt]
    pred_for_gt = {g: p for p, g in assign_by_edit_distance(pred_tokens, gt_tokens)}
    matches = []
    for g, tokens in enumerate(gt_tokens):
        p = pred_for_gt.get(g)
        distance = normalized_edit_distance(pred_tokens[p], tokens) if p is not None else 1.0
        matches.append(BlockMatch("formula", gt[g][0], pred[p][0] if p is not None else None, distance))
    matched_pred = set(pred_for_gt.values())
    matches.extend(BlockMatch("formula", None, pred[p][0], 1.0) for p in range(len(pred)) if p not in matched_pred)
    return matches


def _score_tables(pred: list[tuple[int, MarkupBlock]], gt: list[tuple[int, MarkupBlock]]) -> tuple[list[BlockMatch], list[tuple[float, float]]]:
    # Matching on the HTML string is cheap; the APTED tree distance then runs once per matched pair.
    pred_html = [" ".join(block.content.split()) for _, block in pred]
    gt_html = [" ".join(block.content.split()) for _, block in gt]
    pred_for_gt = {g: p for p, g in assign_by_edit_distance(pred_html, gt_html)}
    matches, scores = [], []
    for g in range(len(gt)):
        p = pred_for_gt.get(g)
        pair = teds_pair(pred[p][1].content, gt[g][1].content) if p is not None else (0.0, 0.0)
        scores.append(pair)
        matches.append(BlockMatch("table", gt[g][0], pred[p][0] if p is not None else None, pair[0]))
    return matches, scores


def _reading_order_edit(matches: list[BlockMatch]) -> float | None:
    def shares_content(match: BlockMatch) -> bool:
        return match.score > 0.0 if match.group == "table" else match.score < 1.0

    pairs = [m for m in matches if m.gt_index is not None and m.pred_index is not None and shares_content(m)]
    if not pairs:
        return None
    gt_order = [m.gt_index for m in sorted(pairs, key=lambda m: m.gt_index)]
    pred_order = [m.gt_index for m in sorted(pairs, key=lambda m: m.pred_index)]
    return normalized_edit_distance(pred_order, gt_order)


def score_page(pred_markup: str, gt_markup: str) -> PageScores:
    """Score one predicted page markup against its ground truth (see the module docstring)."""
    pred_groups = group_blocks(parse_markup(pred_markup or ""))
    gt_groups = group_blocks(parse_markup(gt_markup or ""))
    matches: list[BlockMatch] = []

    text_edit = None
    if gt_groups["text"]:
        text_edit, text_matches = _score_text(pred_groups["text"], gt_groups["text"])
        matches.extend(text_matches)

    table_scores: list[tuple[float, float]] = []
    if gt_groups["table"]:
        table_matches, table_scores = _score_tables(pred_groups["table"], gt_groups["table"])
        matches.extend(table_matches)
    table_teds = float(np.mean([s[0] for s in table_scores])) if table_scores else None
    table_teds_s = float(np.mean([s[1] for s in table_scores])) if table_scores else None

    formula_edits: list[float] = []
    if gt_groups["formula"]:
        formula_matches = _score_formulas(pred_groups["formula"], gt_groups["formula"])
        formula_edits = [m.score for m in formula_matches]
        matches.extend(formula_matches)
    formula_edit = float(np.mean(formula_edits)) if formula_edits else None

    return PageScores(
        text_edit=text_edit,
        table_teds=table_teds,
        table_teds_s=table_teds_s,
        formula_edit=formula_edit,
        reading_order_edit=_reading_order_edit(matches),
        overall=overall_score(text_edit, table_teds, formula_edit),
        table_scores=table_scores,
        formula_edits=formula_edits,
        gt_counts={group: len(blocks) for group, blocks in gt_groups.items()},
        pred_counts={group: len(blocks) for group, blocks in pred_groups.items()},
        matches=matches,
    )


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def aggregate_scores(pages: Iterable[PageScores]) -> DatasetScores:
    """Combine page scores: text and reading order averaged over pages, tables and formulas over elements."""
    pages = list(pages)
    text = [p.text_edit for p in pages if p.text_edit is not None]
    order = [p.reading_order_edit for p in pages if p.reading_order_edit is not None]
    tables = [score for p in pages for score in p.table_scores]
    formulas = [edit for p in pages for edit in p.formula_edits]
    text_edit = _mean(text)
    table_teds = _mean([s[0] for s in tables])
    formula_edit = _mean(formulas)
    return DatasetScores(
        n_pages=len(pages),
        text_edit=text_edit,
        table_teds=table_teds,
        table_teds_s=_mean([s[1] for s in tables]),
        formula_edit=formula_edit,
        reading_order_edit=_mean(order),
        overall=overall_score(text_edit, table_teds, formula_edit),
        n_pages_with_text=len(text),
        n_pages_with_reading_order=len(order),
        n_tables=len(tables),
        n_formula_pairs=len(formulas),
        gt_counts={g: sum(p.gt_counts.get(g, 0) for p in pages) for g in SCORED_GROUPS},
        pred_counts={g: sum(p.pred_counts.get(g, 0) for p in pages) for g in SCORED_GROUPS},
    )


def score_dataset(pairs: Iterable[tuple[str, str]]) -> DatasetScores:
    """Score ``(pred_markup, gt_markup)`` pairs and aggregate them (see ``aggregate_scores``)."""
    return aggregate_scores(score_page(pred, gt) for pred, gt in pairs)
