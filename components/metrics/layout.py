"""Box IoU and one-to-one matching of predicted to ground-truth layout boxes.

``layout_similarity`` (mean IoU of an optimal one-to-one match, unmatched boxes on either side
counting as 0) is both a layout score and the similarity used to mine consistency between
stochastic decodes. Boxes are ``(x0, y0, x1, y1)`` in pixels, or objects with ``.bbox`` and
``.category`` (e.g. ``LayoutElement``); with categories, boxes only match inside a category.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class BoxMatch:
    """A matched pair: indices into the predicted and ground-truth lists and their IoU."""

    pred_index: int
    gt_index: int
    iou: float


def _box_and_label(item: Any) -> tuple[Box, str | None]:
    raw = getattr(item, "bbox", item)
    label = getattr(item, "category", None)
    try:
        x0, y0, x1, y1 = (float(v) for v in raw)
    except (TypeError, ValueError) as error:
        raise ValueError(f"a box must be four numbers (x0, y0, x1, y1), got {item!r}") from error
    return (x0, y0, x1, y1), label


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``(x0, y0, x1, y1)`` boxes.

    Inverted coordinates count as zero extent. Two degenerate (zero-area) boxes score 1.0 only
    when they are the same box, so identical outputs always compare as identical.
    """
    (ax0, ay0, ax1, ay1), _ = _box_and_label(a)
    (bx0, by0, bx1, by1), _ = _box_and_label(b)
    inter_w = max(0.0, min(ax1, bx1) - max(ax0, bx0))
    inter_h = max(0.0, min(ay1, by1) - max(ay0, by0))
    intersection = inter_w * inter_h
    union = max(0.0, ax1 - ax0) * max(0.0, ay1 - ay0) + max(0.0, bx1 - bx0) * max(0.0, by1 - by0) - intersection
    if union <= 0.0:
        return 1.0 if (ax0, ay0, ax1, ay1) == (bx0, by0, bx1, by1) else 0.0
    return intersection / union


def iou_matrix(pred: Sequence[Any], gt: Sequence[Any]) -> np.ndarray:
    """IoU of every predicted box (rows) with every ground-truth box (columns); 0 across categories."""
    matrix = np.zeros((len(pred), len(gt)), dtype=np.float64)
    gt_parsed = [_box_and_label(item) for item in gt]
    for i, item in enumerate(pred):
        box, label = _box_and_label(item)
        for j, (gt_box, gt_label) in enumerate(gt_parsed):
            if label is not None and gt_label is not None and label != gt_label:
                continue
            matrix[i, j] = box_iou(box, gt_box)
    return matrix


def match_boxes(pred: Sequence[Any], gt: Sequence[Any]) -> list[BoxMatch]:
    """Optimal one-to-one assignment maximizing total IoU; pairs that do not overlap are left unmatched."""
    if not pred or not gt:
        return []
    matrix = iou_matrix(pred, gt)
    rows, cols = linear_sum_assignment(matrix, maximize=True)
    return [BoxMatch(int(r), int(c), float(matrix[r, c])) for r, c in zip(rows, cols, strict=True) if matrix[r, c] > 0.0]


def layout_similarity(pred: Sequence[Any], gt: Sequence[Any]) -> float:
    """Sum of matched IoUs / max(len(pred), len(gt)): mean IoU with unmatched boxes counted as 0.

    Two empty layouts are identical (1.0); one empty against a non-empty one scores 0.0.
    """
    denominator = max(len(pred), len(gt))
    if denominator == 0:
        return 1.0
    return sum(match.iou for match in match_boxes(pred, gt)) / denominator
