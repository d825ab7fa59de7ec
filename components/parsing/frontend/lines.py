"""A text line of a page as the front end sees it: its text, how sure its source is, its box, and
the detected boxes it is made of (a visual line the detector found in pieces).

Every line source fills the same record (the recogniser's boxes, the reader's readings of the
detector's boxes), so the blocks built from them do not depend on who read the words.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from components.decoding.types import DecodeResult

Box = tuple[float, float, float, float]


@dataclass
class LineBox:
    text: str
    score: float
    x0: float
    y0: float
    x1: float
    y1: float
    parts: list[LineBox] = field(default_factory=list)  # the detected boxes a visual line is made of
    decoded: DecodeResult | None = field(default=None, repr=False)  # a model's decode of this box (its tokens, speed)

    @property
    def height(self) -> float:
        return self.y1 - self.y0

    @property
    def center_y(self) -> float:
        return (self.y0 + self.y1) / 2

    @property
    def box(self) -> Box:
        return (self.x0, self.y0, self.x1, self.y1)

    @property
    def pieces(self) -> list[LineBox]:
        """The detected boxes this line is made of (itself when it is one)."""
        return self.parts or [self]

    @property
    def char_width(self) -> float:
        return (self.x1 - self.x0) / max(1, len(self.text))


def merge_lines(boxes: list[LineBox]) -> list[LineBox]:
    """Boxes merged into visual lines (boxes that overlap vertically by half), top to bottom; a
    line's score is its parts' character-weighted mean."""
    lines: list[list[LineBox]] = []
    for box in sorted(boxes, key=lambda b: (b.center_y, b.x0)):
        if lines:
            current = lines[-1]
            top, bottom = min(b.y0 for b in current), max(b.y1 for b in current)
            overlap = min(bottom, box.y1) - max(top, box.y0)
            if overlap >= 0.5 * min(box.height, bottom - top):
                current.append(box)
                continue
        lines.append([box])
    merged = []
    for parts in lines:
        parts.sort(key=lambda b: b.x0)
        chars = [max(1, len(p.text)) for p in parts]
        score = sum(p.score * n for p, n in zip(parts, chars, strict=True)) / sum(chars)
        merged.append(LineBox(" ".join(p.text for p in parts), score, min(p.x0 for p in parts),
                              min(p.y0 for p in parts), max(p.x1 for p in parts), max(p.y1 for p in parts), parts))
    return merged
