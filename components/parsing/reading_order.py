"""Reading order of a page's blocks, one column after the other on two-column pages.

OCR boxes carry no order; sorting them top to bottom interleaves the two columns of a paper
line by line. A gutter is a vertical strip near the middle of the page that almost no box
crosses while both sides hold a good share of the text; blocks that cross it (titles, wide
tables, abstracts) cut the page into bands, and inside a band the left column is read before
the right one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

Box = tuple[float, float, float, float]


class HasBox(Protocol):
    @property
    def box(self) -> Box: ...


T = TypeVar("T", bound=HasBox)


def find_gutter(boxes: Sequence[Box], page_width: float, max_crossing: float = 0.1, min_side: float = 0.25,
                left: float = 0.0) -> float | None:
    """The x of a column gutter between ``left`` and ``left + page_width``, or None (one column).

    Candidates lie in the middle 30 % of that width; the best one is crossed by the fewest boxes.
    It counts only when at most ``max_crossing`` of the boxes cross it and each side holds at
    least ``min_side`` of them.
    """
    if len(boxes) < 8:
        return None
    best: tuple[int, float] | None = None
    steps = 60
    for i in range(steps + 1):
        x = left + page_width * (0.35 + 0.30 * i / steps)
        crossing = sum(b[0] < x < b[2] for b in boxes)
        if best is None or crossing < best[0]:
            best = (crossing, x)
    assert best is not None
    crossing, x = best
    left = sum(b[2] <= x for b in boxes)
    right = sum(b[0] >= x for b in boxes)
    n = len(boxes)
    if crossing > max_crossing * n or left < min_side * n or right < min_side * n:
        return None
    # centre the gutter in the empty strip around x, so boxes that nearly touch it still fall on their side
    lo = max((b[2] for b in boxes if b[2] <= x), default=x)
    hi = min((b[0] for b in boxes if b[0] >= x), default=x)
    return (lo + hi) / 2 if lo <= hi else x


def side(box: Box, gutter: float | None) -> int:
    """0: left column (or the only one), 1: right column, -1: crosses the gutter."""
    if gutter is None:
        return 0
    if box[2] <= gutter:
        return 0
    if box[0] >= gutter:
        return 1
    return -1


def _level(a: Box, b: Box) -> bool:
    """Whether two boxes sit side by side (overlap vertically by half the smaller height)."""
    overlap = min(a[3], b[3]) - max(a[1], b[1])
    return overlap >= 0.5 * min(a[3] - a[1], b[3] - b[1])


def top_down(blocks: Sequence[T]) -> list[T]:
    """Top to bottom; of blocks side by side, the left one first (even when it starts lower)."""
    remaining = sorted(blocks, key=lambda b: (b.box[1], b.box[0]))
    ordered: list[T] = []
    while remaining:
        first = remaining[0]
        beside = [b for b in remaining if b.box[2] <= first.box[0] and _level(b.box, first.box)]
        pick = min(beside, key=lambda b: b.box[0]) if beside else first
        ordered.append(pick)
        remaining.remove(pick)
    return ordered


def reading_order(blocks: Sequence[T], gutter: float | None) -> list[T]:
    """``blocks`` in reading order: top to bottom, and column by column between spanning blocks."""
    by_top = top_down(blocks)
    if gutter is None:
        return by_top
    ordered: list[T] = []
    band: list[T] = []

    def flush() -> None:
        ordered.extend(sorted(band, key=lambda b: (side(b.box, gutter), b.box[1], b.box[0])))
        band.clear()

    for block in by_top:
        if side(block.box, gutter) == -1:
            flush()
            ordered.append(block)
        else:
            band.append(block)
    flush()
    return ordered
