"""Page- and dataset-level end-to-end scores with OmniDocBench v1.5's definitions.

A page is scored as the official ``End2EndDataset`` + ``End2EndEval`` (quick_match) do:

- the prediction is split with ``extract_elements``; the ground truth is a list of OmniDocBench
  elements (``gt_elements_from_markup`` for our markup, ``gt_elements_from_page`` for the
  official JSON, which also merges blocks related as ``truncated``);
- **tables**: ground-truth tables are matched to predicted HTML tables (or LaTeX tables, when a
  page has more of those) by Hungarian assignment on the raw strings; extra predicted tables are
  dropped, and when the page has ground-truth tables their plain cells join the text pool;
  each pair scores TEDS / TEDS-S / edit distance after ``normalize_table_html`` (a LaTeX table
  scores 0: converting it needs LaTeXML, which we do not run);
- **text and display formulas** are matched together by ``quick_match``; prediction-only
  entries are dropped, ignored categories (headers, captions, ...) are not scored, and a
  ground-truth formula whose match is a text block is scored as text (its LaTeX rendered to
  Unicode);
- each entry's edit distance is Levenshtein over the normalized strings; a page's **text
  edit** (and formula edit) is Σ edits / Σ max-lengths over its entries;
- **reading order**: the ground-truth orders of the page's text entries, sorted as the
  prediction has them, against the sorted ground-truth orders (normalized edit distance);
- **TEDS** of a page is the mean over its tables.

Dataset values are means over the pages that have the metric (page-level, as v1.5 reports) and
**Overall** = ((1 − text edit)·100 + TEDS·100 + formula)/3 with formula = CDM·100 when the formulas
are scored with CDM (``formula_metric="cdm"``: the mean CDM F1 over the formula pairs, a pair whose
ground truth does not render left out, as the official CDM code does), else
(1 − formula edit)·100 — the documented fallback where pdflatex is missing; a missing term counts 0.
Which one was used is ``formula_metric`` in every result.
Definitions follow OmniDocBench at commit 7bd6c2e (mirror ``pichiu/OmniDocBench``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from bs4 import BeautifulSoup

from components.data.markup import parse_markup, render_block
from components.metrics.cdm import cdm_available, cdm_scores
from components.metrics.extraction import HTML_TABLE, LATEX_TABLE, TEXT, PredictedElement, extract_elements
from components.metrics.matching import (
    FORMULA_CATEGORY,
    IGNORED_CATEGORIES,
    TABLE_CATEGORY,
    TEXT_CATEGORIES,
    Element,
    Match,
    quick_match,
    simple_match,
)
from components.metrics.table import normalize_table_html, teds_normalized
from components.metrics.text import clean_text, edit_distance, latex_to_unicode

SCORED_GROUPS = ("text", "table", "formula")
FORMULA_METRICS = ("cdm", "edit")
# Every block category our markup can hold, as OmniDocBench's ground-truth category (a fenced code
# listing is OmniDocBench's ``code_txt``, which it scores in the text group).
_GT_CATEGORY_OF_BLOCK = {"title": "title", "text": "text_block", "formula": FORMULA_CATEGORY, "table": TABLE_CATEGORY,
                         "code": "code_txt"}
_GROUP_OF_GT_CATEGORY = {FORMULA_CATEGORY: "formula", TABLE_CATEGORY: "table"} | {c: "text" for c in TEXT_CATEGORIES}
_FORMULA_PRED_KINDS = ("equation_inline", "equation_isolated", "")
_CDOT_RE = re.compile(r"\$\\cdot\$")


# --- ground truth ---------------------------------------------------------------------------------

def gt_elements_from_markup(markup: str) -> list[Element]:
    """Our page markup as OmniDocBench ground truth: title, text_block, equation_isolated, table, order 1.."""
    return [Element(_GT_CATEGORY_OF_BLOCK[block.category], _gt_content(block), order)
            for order, block in enumerate(parse_markup(markup or ""), start=1)]


def _gt_content(block) -> str:
    """A block's ground-truth text. A code listing's is the text OmniDocBench's extraction reads from
    its fence (the official filter drops the closing fence, so the language word stays), which
    makes a verbatim prediction score exactly 0 edits."""
    if block.category != "code":
        return block.content
    return "\n".join(e.content for e in extract_elements(render_block(block.category, block.content)))


def gt_elements_from_page(page: dict) -> list[Element]:
    """One page of OmniDocBench.json (``layout_dets``) as elements; ``truncated`` relations are merged."""
    dets = {det.get("anno_id"): det for det in page.get("layout_dets", [])}
    groups: list[list] = []
    for relation in page.get("extra", {}).get("relation", []):
        if relation.get("relation_type") != "truncated":
            continue
        ids = [relation["source_anno_id"], relation["target_anno_id"]]
        for group in groups:
            if ids[0] in group or ids[1] in group:
                group.extend(ids)
                break
        else:
            groups.append(ids)
    truncated = {anno_id for group in groups for anno_id in group}
    elements = [_gt_element(det) for det in page.get("layout_dets", []) if det.get("anno_id") not in truncated]
    for group in groups:
        parts = sorted((dets[anno_id] for anno_id in group if anno_id in dets), key=lambda det: det["order"])
        if parts:
            first = parts[0]
            elements.append(Element(first["category_type"], "".join(det.get("text", "") for det in parts),
                                    first.get("order") or "", attribute=first.get("attribute", {})))
    return elements


def _gt_element(det: dict) -> Element:
    category = det.get("category_type", "")
    content = det.get("latex", "") if category == FORMULA_CATEGORY else det.get("html", "") if category == TABLE_CATEGORY else det.get("text", "")
    return Element(category, str(content or ""), det.get("order") or "", attribute=det.get("attribute", {}) or {})


def _by_order(elements: list[Element]) -> list[Element]:
    return sorted(elements, key=lambda element: element.position or 0)


# --- scored samples -------------------------------------------------------------------------------

@dataclass(frozen=True)
class EditSample:
    """One scored entry for an edit-distance metric: the edit count and max(len(pred), len(gt))."""

    gt: str
    pred: str
    edits: int
    upper_len: int
    gt_attributes: tuple = ()

    @classmethod
    def of(cls, norm_gt: str, gt: str, norm_pred: str, pred: str, attributes: Iterable[dict] = ()) -> EditSample:
        # As the official metric: the normalized string when it is non-empty, else the raw one.
        gt_used, pred_used = norm_gt or gt, norm_pred or pred
        return cls(gt_used, pred_used, edit_distance(pred_used, gt_used), max(len(pred_used), len(gt_used)),
                   tuple(attributes))

    @property
    def edit(self) -> float | None:
        return self.edits / self.upper_len if self.upper_len else None


@dataclass(frozen=True)
class TableSample:
    gt: str
    pred: str
    teds: float
    teds_s: float
    edit: EditSample


@dataclass
class PageScores:
    """Scores of one page; a metric is None when the page has nothing to score for it."""

    text_edit: float | None
    table_teds: float | None
    table_teds_s: float | None
    formula_edit: float | None
    reading_order_edit: float | None
    overall: float | None
    text_samples: list[EditSample] = field(default_factory=list)
    formula_as_text: list[EditSample] = field(default_factory=list)
    formula_samples: list[EditSample] = field(default_factory=list)
    table_samples: list[TableSample] = field(default_factory=list)
    reading_order: EditSample | None = None
    gt_counts: dict[str, int] = field(default_factory=dict)
    pred_counts: dict[str, int] = field(default_factory=dict)
    page_attributes: dict = field(default_factory=dict)


def page_edit(samples: Iterable[EditSample]) -> float | None:
    """Σ edits / Σ max-lengths of a page's entries (None when there is nothing to compare)."""
    samples = [s for s in samples if s.upper_len]
    return sum(s.edits for s in samples) / sum(s.upper_len for s in samples) if samples else None


def overall_score(text_edit: float | None, table_teds: float | None, formula_edit: float | None,
                  formula_cdm: float | None = None) -> float:
    """OmniDocBench v1.5 Overall (0–100); CDM when given, else the formula edit fallback; missing terms 0."""
    text_term = (1.0 - text_edit) * 100.0 if text_edit is not None else 0.0
    table_term = table_teds * 100.0 if table_teds is not None else 0.0
    if formula_cdm is not None:
        formula_term = formula_cdm * 100.0
    else:
        formula_term = (1.0 - formula_edit) * 100.0 if formula_edit is not None else 0.0
    return (text_term + table_term + formula_term) / 3.0


def _table_cells_as_text(table: PredictedElement) -> list[PredictedElement]:
    """Plain cells of an unmatched predicted table, which the official code adds to the text pool."""
    soup = BeautifulSoup(table.content, "html.parser")
    return [PredictedElement(TEXT, _CDOT_RE.sub("", cell.string).strip(), table.position, table.fine_category)
            for cell in soup.find_all("td") if cell.string]


def _reading_order(text_matches: list[Match]) -> EditSample | None:
    with_gt = [m for m in text_matches if m.gt_positions != [""]]
    paired = [m for m in with_gt if m.pred_position is not None]
    pred = [p for m in sorted(paired, key=lambda m: m.pred_position) for p in m.gt_positions if p]
    gt = sorted(p for m in with_gt for p in m.gt_positions if p)
    if not pred and not gt:
        return None
    return EditSample(str(gt), str(pred), edit_distance(pred, gt), max(len(pred), len(gt)))


def _as_element(pred: PredictedElement) -> Element:
    return Element(pred.category, pred.content, pred.position, pred.fine_category)


def score_page_elements(pred_markdown: str, gt_elements: list[Element], page_attributes: dict | None = None) -> PageScores:
    """Score one predicted page against OmniDocBench ground-truth elements (module docstring)."""
    predicted = extract_elements(pred_markdown or "")
    by_category: dict[str, list[PredictedElement]] = {}
    for element in predicted:
        by_category.setdefault(element.category, []).append(element)
    pool = [e for category, elements in by_category.items() if category not in (HTML_TABLE, LATEX_TABLE) for e in elements]

    gt_tables = _by_order([e for e in gt_elements if e.category == TABLE_CATEGORY])
    table_samples: list[TableSample] = []
    if gt_tables:
        html_tables, latex_tables = by_category.get(HTML_TABLE, []), by_category.get(LATEX_TABLE, [])
        use_latex = len(latex_tables) > len(html_tables)
        candidates = latex_tables if use_latex else html_tables
        gt_kept = [t for t in gt_tables if t.content]
        pred_kept = [t for t in candidates if t.content]
        pairs, unmatched = simple_match([t.content for t in gt_kept], [t.content for t in pred_kept])
        for gt_index, pred_index in pairs:
            pred_html = "" if use_latex or pred_index is None else pred_kept[pred_index].content
            gt_norm, pred_norm = normalize_table_html(gt_kept[gt_index].content), normalize_table_html(pred_html)
            scores = teds_normalized(pred_norm or pred_html, gt_norm or gt_kept[gt_index].content)
            table_samples.append(TableSample(gt_kept[gt_index].content, pred_html, *scores,
                                             EditSample.of(gt_norm, gt_kept[gt_index].content, pred_norm, pred_html)))
        if not use_latex:
            for pred_index in unmatched:
                pool.extend(_table_cells_as_text(pred_kept[pred_index]))

    text_gt = _by_order([e for category in (*TEXT_CATEGORIES, FORMULA_CATEGORY) for e in gt_elements if e.category == category])
    matches = quick_match(text_gt, [_as_element(p) for p in pool])
    text_matches = [m for m in matches if m.gt_category in TEXT_CATEGORIES and m.gt_category not in IGNORED_CATEGORIES]
    formula_matches = [m for m in matches if m.gt_category == FORMULA_CATEGORY and m.gt_indices]

    text_samples = [EditSample.of(m.norm_gt, m.gt, m.norm_pred, m.pred, m.gt_attributes) for m in text_matches]
    formula_samples, formula_as_text = [], []
    for m in formula_matches:
        if m.pred_category in _FORMULA_PRED_KINDS:
            formula_samples.append(EditSample.of(m.norm_gt, m.gt, m.norm_pred, m.pred, m.gt_attributes))
        else:  # matched to a text block: scored as text, the LaTeX rendered to Unicode
            try:
                rendered = latex_to_unicode(m.gt)
            except Exception:  # pylatexenc fails on some malformed LaTeX; keep the source then
                rendered = m.gt
            formula_as_text.append(EditSample.of(clean_text(rendered), rendered, m.norm_pred, m.pred, m.gt_attributes))

    return _page_scores(
        text_samples, formula_as_text, formula_samples, table_samples, _reading_order(text_matches),
        gt_counts={g: sum(1 for e in gt_elements if _GROUP_OF_GT_CATEGORY.get(e.category) == g) for g in SCORED_GROUPS},
        pred_counts={"text": sum(1 for e in predicted if e.category == TEXT),
                     "table": sum(1 for e in predicted if e.category in (HTML_TABLE, LATEX_TABLE)),
                     "formula": sum(1 for e in predicted if e.kind == "equation_isolated")},
        page_attributes=page_attributes or {},
    )


def _page_scores(text_samples, formula_as_text, formula_samples, table_samples, reading_order, *,
                 gt_counts, pred_counts, page_attributes, formulas_join_text: bool | None = None) -> PageScores:
    # The official code moves formulas scored as text into the text samples only when the
    # evaluated set has text samples at all; for one page that is this page.
    join = bool(text_samples) if formulas_join_text is None else formulas_join_text
    all_text = text_samples + (formula_as_text if join else [])
    text_edit = page_edit(all_text)
    formula_edit = page_edit(formula_samples)
    teds = float(np.mean([t.teds for t in table_samples])) if table_samples else None
    teds_s = float(np.mean([t.teds_s for t in table_samples])) if table_samples else None
    return PageScores(
        text_edit=text_edit, table_teds=teds, table_teds_s=teds_s, formula_edit=formula_edit,
        reading_order_edit=reading_order.edit if reading_order else None,
        overall=overall_score(text_edit, teds, formula_edit),
        text_samples=text_samples, formula_as_text=formula_as_text, formula_samples=formula_samples,
        table_samples=table_samples, reading_order=reading_order, gt_counts=gt_counts, pred_counts=pred_counts,
        page_attributes=page_attributes,
    )


def score_page(pred_markdown: str, gt_markup: str) -> PageScores:
    """Score a predicted page against our ground-truth markup."""
    return score_page_elements(pred_markdown, gt_elements_from_markup(gt_markup))


# --- dataset ----------------------------------------------------------------------------------------

@dataclass
class DatasetScores:
    """Page-level means over the pages that have each metric; ``overall`` from those means."""

    n_pages: int
    text_edit: float | None
    table_teds: float | None
    table_teds_s: float | None
    formula_edit: float | None
    reading_order_edit: float | None
    overall: float | None
    table_edit: float | None = None
    # The mean of the Overall terms this set has ground truth for: a prose-only set's official Overall
    # can never exceed 33.3 (missing terms count 0), so gates on such sets use this one and say so.
    overall_present: float | None = None
    overall_terms: int = 0
    n_pages_with_text: int = 0
    n_pages_with_reading_order: int = 0
    n_tables: int = 0
    n_formula_pairs: int = 0
    gt_counts: dict[str, int] = field(default_factory=dict)
    pred_counts: dict[str, int] = field(default_factory=dict)
    pages: list[PageScores] = field(default_factory=list, repr=False)
    formula_metric: str = "edit"  # the Overall's formula term: "cdm" or the "edit" fallback
    formula_cdm: float | None = None
    overall_formula_edit: float | None = None  # the Overall with the edit fallback, whatever formula_metric is

    def as_dict(self) -> dict[str, float]:
        """Flat float metrics for MLflow; metrics that are None are left out (MLflow cannot log None)."""
        metrics: dict[str, float | None] = {
            "text_edit": self.text_edit, "table_teds": self.table_teds, "table_teds_s": self.table_teds_s,
            "table_edit": self.table_edit, "formula_edit": self.formula_edit,
            "reading_order_edit": self.reading_order_edit, "overall": self.overall,
            "overall_present": self.overall_present, "formula_cdm": self.formula_cdm,
            "overall_formula_edit": self.overall_formula_edit,
        }
        flat = {name: float(value) for name, value in metrics.items() if value is not None}
        flat["n_pages"] = float(self.n_pages)
        flat["overall_terms"] = float(self.overall_terms)
        flat["n_pages_with_text"] = float(self.n_pages_with_text)
        flat["n_pages_with_reading_order"] = float(self.n_pages_with_reading_order)
        flat["n_tables"] = float(self.n_tables)
        flat["n_formula_pairs"] = float(self.n_formula_pairs)
        flat["formula_metric_cdm"] = float(self.formula_metric == "cdm")
        for group in SCORED_GROUPS:
            flat[f"n_gt_{group}"] = float(self.gt_counts.get(group, 0))
            flat[f"n_pred_{group}"] = float(self.pred_counts.get(group, 0))
        return flat


OVERALL_TERMS = (("text", "text_edit"), ("tables", "table_teds"), ("formulas", "formula_edit"))


def present_terms(scores: Mapping[str, float | None]) -> list[str]:
    """The Overall terms a set has ground truth for (``text``, ``tables``, ``formulas``)."""
    return [name for name, key in OVERALL_TERMS if scores.get(key) is not None]


def reported_overall(scores: Mapping[str, float | None]) -> tuple[float | None, str]:
    """The one Overall every table, check and closing line shows, with its name: OmniDocBench's
    when the pages have text, tables and formulas; else the mean of the terms present (a prose-only
    Overall is capped at 33.3 by its missing terms), which is also what the gate reads then."""
    present = present_terms(scores)
    if len(present) == len(OVERALL_TERMS):
        return scores.get("overall"), "Overall"
    return scores.get("overall_present"), f"Overall of the terms present ({', '.join(present) or 'none'})"


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def formula_cdm(pages: Iterable[PageScores]) -> float | None:
    """Mean CDM F1 over the pages' formula pairs (None when none has a ground truth that renders)."""

    pairs = [(sample.gt, sample.pred) for page in pages for sample in page.formula_samples]
    scores = [score for score in cdm_scores(pairs) if score is not None] if pairs else []
    return float(np.mean(scores)) if scores else None


def aggregate_scores(pages: Iterable[PageScores], formula_metric: str = "edit") -> DatasetScores:
    """Combine page scores the v1.5 way: each metric per page first, then the mean over pages.
    ``formula_metric``: "cdm" (the leaderboard's, needs pdflatex) or "edit" (the fallback)."""
    if formula_metric not in FORMULA_METRICS:
        raise ValueError(f"formula_metric must be one of {FORMULA_METRICS}, not {formula_metric!r}")
    pages = list(pages)
    any_text = any(p.text_samples for p in pages)
    # Re-derive each page under the dataset's rule for formulas scored as text.
    rescored = [_page_scores(p.text_samples, p.formula_as_text, p.formula_samples, p.table_samples, p.reading_order,
                             gt_counts=p.gt_counts, pred_counts=p.pred_counts, page_attributes=p.page_attributes,
                             formulas_join_text=any_text) for p in pages]
    text_edit = _mean([p.text_edit for p in rescored])
    teds = _mean([p.table_teds for p in rescored])
    formula_edit = _mean([p.formula_edit for p in rescored])
    cdm = formula_cdm(rescored) if formula_metric == "cdm" else None
    formula_term = cdm * 100.0 if cdm is not None else (1.0 - formula_edit) * 100.0 if formula_edit is not None else None
    terms = [term for term in ((1.0 - text_edit) * 100.0 if text_edit is not None else None,
                               teds * 100.0 if teds is not None else None, formula_term) if term is not None]
    return DatasetScores(
        n_pages=len(pages),
        text_edit=text_edit,
        table_teds=teds,
        table_teds_s=_mean([p.table_teds_s for p in rescored]),
        formula_edit=formula_edit,
        reading_order_edit=_mean([p.reading_order_edit for p in rescored]),
        overall=overall_score(text_edit, teds, formula_edit, cdm) if pages else None,
        table_edit=_mean([page_edit(t.edit for t in p.table_samples) for p in rescored]),
        overall_present=float(np.mean(terms)) if terms else None,
        overall_terms=len(terms),
        n_pages_with_text=sum(1 for p in rescored if p.text_edit is not None),
        n_pages_with_reading_order=sum(1 for p in rescored if p.reading_order_edit is not None),
        n_tables=sum(len(p.table_samples) for p in rescored),
        n_formula_pairs=sum(len(p.formula_samples) for p in rescored),
        gt_counts={g: sum(p.gt_counts.get(g, 0) for p in pages) for g in SCORED_GROUPS},
        pred_counts={g: sum(p.pred_counts.get(g, 0) for p in pages) for g in SCORED_GROUPS},
        pages=rescored,
        formula_metric=formula_metric,
        formula_cdm=cdm,
        overall_formula_edit=overall_score(text_edit, teds, formula_edit) if pages else None,
    )


def score_dataset(pairs: Iterable[tuple[str, str]], formula_metric: str = "edit") -> DatasetScores:
    """Score ``(pred_markdown, gt_markup)`` pairs and aggregate them (see ``aggregate_scores``)."""
    return aggregate_scores((score_page(pred, gt) for pred, gt in pairs), formula_metric)


def resolve_formula_metric(choice: str) -> str:
    """``auto``: CDM where pdflatex and Ghostscript are installed, else the edit fallback."""
    if choice == "auto":
        return "cdm" if cdm_available() else "edit"
    if choice not in FORMULA_METRICS:
        raise ValueError(f"formula metric must be auto, cdm or edit, not {choice!r}")
    return choice
