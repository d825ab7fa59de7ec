"""The page front end (components/parsing/frontend): PP-OCR's detector on a real page, line
sources, and blocks that keep every line the detector found."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from components.parsing.frontend import Blocks, FrontEndConfig, LineBox, PageFrontEnd, RecogniserLines
from components.parsing.layout import LayoutRegion

PAGE = Path(__file__).parent / "fixtures" / "real_pages" / "rintro-10.png"


@pytest.fixture(scope="module")
def front_end() -> PageFrontEnd:
    return PageFrontEnd()


def test_the_recogniser_still_reads_after_a_detect_only_call(front_end):
    """RapidOCR keeps the flags of its previous call: a detect-only call (the reader's source) must
    not leave the recogniser source without text."""
    page = Image.open(PAGE).convert("RGB")
    boxes = front_end.detector.detect(page)
    lines = front_end.detector.recognise(page)
    assert len(boxes) >= 30 and len(lines) >= 30
    assert any("help.search" in line.text for line in lines)


def test_lines_outside_every_layout_region_are_read():
    """A region the layout model misses loses nothing: lines in no region are grouped by the line
    heuristics and read like the rest."""
    lines = [LineBox(f"paragraph line number {i} of the page", 0.99, 100, 100 + 30 * i, 700, 120 + 30 * i)
             for i in range(10)]
    only_the_top = [LayoutRegion("text", (90, 90, 710, 190), 0.9)]  # covers the first three lines
    blocks = Blocks(FrontEndConfig()).build(lines, (800, 1000), only_the_top)
    text = " ".join(b.content or "" for b in blocks)
    assert all(f"line number {i} " in text for i in range(10))


def test_the_recogniser_source_makes_blocks_with_their_line_scores(front_end):
    page = front_end.read(Image.open(PAGE).convert("RGB"), RecogniserLines())
    assert page.content_blocks and page.regions
    assert "example(topic)" in page.markup
    assert 0.8 < page.confidence <= 1.0
    assert {"header"} <= {b.category for b in page.blocks}  # the running head is furniture
