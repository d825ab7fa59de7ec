"""Two-stage parsing: crops, layout, per-element decoding in one batch, assembly, failures kept local."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from components.data.markup import render_block
from components.data.pages import LayoutElement, Page
from components.data.synthetic import generate_page
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.parsing import ParseSettings, make_layout, parse, parse_pages, read_pages
from components.parsing.assembly import element_markup, order_elements
from components.parsing.crops import BLANK, DEGENERATE, OUTSIDE, CropSettings, crop_region
from components.parsing.layout import LayoutRegion
from components.parsing.parse import LAYOUT_ONLY, NO_REGIONS
from components.parsing.prompts import style_for_model, task_prompt

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "models" / "pretrained" / "docmarkup-base"


def _page_with_ink(width: int = 200, height: int = 100) -> Image.Image:
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).text((20, 20), "some words", fill="black")
    return image


def test_crops_keep_native_pixels_clip_boxes_and_say_why_a_region_is_skipped():
    image = _page_with_ink()
    inside = crop_region(image, (18, 18, 90, 34), CropSettings(margin=2))
    assert inside.skipped is None and inside.image.size == (76, 20)  # native size plus the margin, no scaling
    clipped = crop_region(image, (-50, 10, 120, 40))
    assert clipped.skipped is None and clipped.box == (0.0, 10.0, 120.0, 40.0)
    assert crop_region(image, (300, 10, 400, 40)).skipped == OUTSIDE
    assert crop_region(image, (20, 20, 21, 60)).skipped == DEGENERATE
    assert crop_region(image, (10, 10, 5, 40)).skipped == DEGENERATE
    assert crop_region(image, (150, 60, 195, 95)).skipped == BLANK
    capped = crop_region(image, (0, 0, 200, 100), CropSettings(max_pixels=5000))
    assert capped.image.width * capped.image.height <= 5000


def test_family_prompt_styles_follow_how_each_family_was_trained():
    assert task_prompt("paddleocr_vl", "table") == "Table Recognition:"
    assert task_prompt("paddleocr_vl", "text") == "OCR:"
    assert task_prompt("mineru", "formula") == "Formula Recognition:"
    assert task_prompt("mineru", "caption") == "Text Recognition:"
    assert task_prompt("none", "table") is None


def test_outputs_become_page_markup_in_reading_order():
    assert element_markup("formula", "x^2") == render_block("formula", "x^2")
    assert element_markup("formula", "$$\nx\n$$") == "$$\nx\n$$"
    assert element_markup("title", "Intro") == "# Intro"
    assert element_markup("title", "Intro", native=False) == "Intro"  # a prompt-free model's own form stands
    left = LayoutRegion("text", (10, 100, 90, 110), 1)
    right = LayoutRegion("text", (110, 10, 190, 20), 1)
    top = LayoutRegion("title", (10, 0, 190, 8), 1)
    regions = [right, left, top] + [LayoutRegion("text", (10, y, 90, y + 8), 1) for y in (20, 40, 60, 80, 120)] + \
              [LayoutRegion("text", (110, y, 190, y + 8), 1) for y in (40, 60, 80, 100, 120)]
    ordered = order_elements(regions, 200, detected=True)
    assert ordered[0] is top
    assert ordered.index(left) < ordered.index(right)  # left column first, though it starts lower
    assert order_elements(regions, 200, detected=False) == regions  # a page record's order is kept


@pytest.fixture(scope="module")
def base_engine() -> DecodingEngine:
    return DecodingEngine.from_pretrained(BASE)


@pytest.fixture(scope="module")
def synthetic_pages() -> list[tuple[Page, Image.Image]]:
    return [generate_page(seed) for seed in (960_001, 960_002)]


def test_every_element_of_every_page_is_one_batch_and_sdb_equals_ar_per_element(base_engine, synthetic_pages):
    pages, images = [p for p, _ in synthetic_pages], [i for _, i in synthetic_pages]
    calls = []
    original = base_engine.generate

    def counting(crops, params, prompts=None):
        calls.append(len(crops))
        return original(crops, params, prompts=prompts)

    base_engine.generate = counting
    try:
        layout = make_layout("ground-truth")
        ar = parse_pages(images, base_engine, layout, DecodeParams(decoder="ar", max_new_tokens=48), pages)
        sdb = parse_pages(images, base_engine, layout, DecodeParams(decoder="sdb", max_new_tokens=48), pages)
    finally:
        del base_engine.generate
    body = [sum(e.category in ("title", "text", "table", "formula") for e in p.elements) for p in pages]
    assert calls == [sum(body), sum(body)]  # one engine call holds all elements of both pages
    for page, a, s in zip(pages, ar, sdb, strict=True):
        assert [e.token_ids for e in s.decoded] == [e.token_ids for e in a.decoded]
        assert len(a.decoded) == sum(e.category in ("title", "text", "table", "formula") for e in page.elements)
        assert all(e.skipped == LAYOUT_ONLY for e in a.elements if e.category in ("header", "footer"))
        assert a.markup == "\n\n".join(e.markup for e in a.decoded if e.markup.strip())
    assert sum(e.stats.forward_passes for p in sdb for e in p.decoded) < sum(
        e.stats.forward_passes for p in ar for e in p.decoded)


def test_a_page_where_layout_finds_nothing_returns_an_empty_parse_with_a_reason(base_engine):
    blank = Image.new("RGB", (320, 416), "white")
    result = parse(blank, base_engine, make_layout("ground-truth"), page=Page("blank", "x.png", 320, 416))
    assert result.elements == [] and result.reason == NO_REGIONS and result.markup == ""


def test_a_box_outside_the_image_is_clipped_and_a_failing_element_is_reported_alone(base_engine, synthetic_pages):
    page, image = synthetic_pages[0]
    body = [e for e in page.elements if e.category in ("title", "text")]
    wide = LayoutElement(body[0].category, (body[0].bbox[0] - 40, body[0].bbox[1], body[0].bbox[2] + 500, body[0].bbox[3]))
    outside = LayoutElement("text", (1000, 1000, 1100, 1040))
    record = Page("p", "x.png", image.width, image.height, [wide, *body[1:], outside])
    failing_width = image.width  # the clipped wide element spans the whole page width

    class OneElementFails:
        """The real engine, except that a batch holding the whole-width crop fails (as a decode can)."""

        model, tokenizer = base_engine.model, base_engine.tokenizer

        def generate(self, crops, params, prompts=None):
            if any(c.width == failing_width for c in crops):
                raise RuntimeError("decode failed on this crop")
            return base_engine.generate(crops, params)

    result = parse(image, OneElementFails(), make_layout("ground-truth"), DecodeParams(max_new_tokens=32), record)
    first, *rest, last = result.elements
    assert first.box[0] == 0 and first.box[2] == image.width and first.error and "decode failed" in first.error
    assert last.skipped == OUTSIDE
    assert rest and all(e.error is None and e.stats is not None for e in rest)
    assert result.markup  # the rest of the page still comes back


def test_read_pages_in_page_mode_is_the_engine_and_in_element_mode_carries_the_parse(base_engine, synthetic_pages):
    page, image = synthetic_pages[1]
    params = DecodeParams(max_new_tokens=32)
    [whole] = read_pages(base_engine, [image], params)
    assert whole.parse is None
    [elements] = read_pages(base_engine, [image], params, ParseSettings("elements", "ground-truth"), [page])
    assert elements.parse is not None and elements.text == elements.parse.markup
    assert elements.token_ids == [t for e in elements.parse.decoded for t in e.token_ids]
    assert elements.stats.forward_passes == sum(e.stats.forward_passes for e in elements.parse.decoded)


def test_a_prompt_free_model_refuses_a_prompt_style(base_engine):
    assert style_for_model(base_engine.model) == "none"
    with pytest.raises(ValueError, match="takes no task prompts"):
        style_for_model(base_engine.model, "paddleocr_vl")
    with pytest.raises(ValueError, match="takes no task prompts"):
        base_engine.generate([Image.new("RGB", (32, 32), "white")], DecodeParams(max_new_tokens=2), prompts=["OCR:"])
