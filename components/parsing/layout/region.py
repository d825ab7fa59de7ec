"""One region a layout backend found: what it is, where, and how sure the backend is."""

from __future__ import annotations

from dataclasses import dataclass

from components.metrics.layout import box_iou

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class LayoutRegion:
    category: str  # ours (components.data.markup.ALL_CATEGORIES) or a detector's extra, e.g. "caption"
    box: Box  # x0, y0, x1, y1 in image pixels
    score: float

    def contains(self, x: float, y: float, pad: float = 0.0) -> bool:
        x0, y0, x1, y1 = self.box
        return x0 - pad <= x <= x1 + pad and y0 - pad <= y <= y1 + pad

    def covers(self, box: Box, fraction: float = 0.6) -> bool:
        """Whether at least ``fraction`` of ``box``'s area lies inside this region."""
        width = min(self.box[2], box[2]) - max(self.box[0], box[0])
        height = min(self.box[3], box[3]) - max(self.box[1], box[1])
        area = max(1e-6, (box[2] - box[0]) * (box[3] - box[1]))
        return width > 0 and height > 0 and width * height >= fraction * area


def without_duplicates(regions: list[LayoutRegion], iou: float = 0.6) -> list[LayoutRegion]:
    """Regions minus those that repeat a more confident one (a detector's overlapping guesses of
    one block as title *and* text would otherwise be read twice)."""
    kept: list[LayoutRegion] = []
    for region in sorted(regions, key=lambda r: -r.score):
        if all(box_iou(region.box, other.box) < iou for other in kept):
            kept.append(region)
    return kept
