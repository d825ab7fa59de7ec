"""OmniDocBench-style metrics (v1.5 definitions) in plain Python: text, table, formula, layout, page."""

from components.metrics.consistency import (
    CONSISTENCY_KINDS,
    page_similarity,
    pairwise_consistency,
    similarity,
)
from components.metrics.formula import (
    formula_edit_distance,
    normalize_latex,
    normalize_latex_tokens,
    tokenize_latex,
)
from components.metrics.layout import BoxMatch, box_iou, layout_similarity, match_boxes
from components.metrics.page import (
    BlockMatch,
    DatasetScores,
    PageScores,
    aggregate_scores,
    overall_score,
    score_dataset,
    score_page,
)
from components.metrics.table import teds, teds_pair, teds_structure
from components.metrics.text import edit_distance, normalize_text, normalized_edit_distance

__all__ = [
    "CONSISTENCY_KINDS",
    "BlockMatch",
    "BoxMatch",
    "DatasetScores",
    "PageScores",
    "aggregate_scores",
    "box_iou",
    "edit_distance",
    "formula_edit_distance",
    "layout_similarity",
    "match_boxes",
    "normalize_latex",
    "normalize_latex_tokens",
    "normalize_text",
    "normalized_edit_distance",
    "overall_score",
    "page_similarity",
    "pairwise_consistency",
    "score_dataset",
    "score_page",
    "similarity",
    "teds",
    "teds_pair",
    "teds_structure",
    "tokenize_latex",
]
