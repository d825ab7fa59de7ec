"""OmniDocBench v1.5 end-to-end metrics (commit 7bd6c2e definitions) in plain Python: text,
table, formula, layout, page, plus consistency between sampled decodes."""

from components.metrics.consistency import (
    CONSISTENCY_KINDS,
    page_similarity,
    pairwise_consistency,
    similarity,
)
from components.metrics.extraction import PredictedElement, extract_elements
from components.metrics.formula import formula_edit_distance, normalize_formula
from components.metrics.layout import BoxMatch, box_iou, layout_similarity, match_boxes
from components.metrics.matching import Element, Match, quick_match
from components.metrics.page import (
    FORMULA_METRICS,
    DatasetScores,
    EditSample,
    PageScores,
    aggregate_scores,
    gt_elements_from_markup,
    gt_elements_from_page,
    overall_score,
    present_terms,
    reported_overall,
    resolve_formula_metric,
    score_dataset,
    score_page,
    score_page_elements,
)
from components.metrics.table import normalize_table_html, teds, teds_pair, teds_structure
from components.metrics.text import clean_text, edit_distance, normalize_text, normalized_edit_distance

__all__ = [
    "CONSISTENCY_KINDS",
    "FORMULA_METRICS",
    "BoxMatch",
    "DatasetScores",
    "EditSample",
    "Element",
    "Match",
    "PageScores",
    "PredictedElement",
    "aggregate_scores",
    "box_iou",
    "clean_text",
    "edit_distance",
    "extract_elements",
    "formula_edit_distance",
    "gt_elements_from_markup",
    "gt_elements_from_page",
    "layout_similarity",
    "match_boxes",
    "normalize_formula",
    "normalize_table_html",
    "normalize_text",
    "normalized_edit_distance",
    "overall_score",
    "page_similarity",
    "pairwise_consistency",
    "present_terms",
    "quick_match",
    "reported_overall",
    "resolve_formula_metric",
    "score_dataset",
    "score_page",
    "score_page_elements",
    "similarity",
    "teds",
    "teds_pair",
    "teds_structure",
]
