"""One page through the front end: layout regions, text lines from a line source, blocks in
reading order, and what the consumers need from them (elements, markup, confidence)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from PIL import Image

from components.data.markup import BLOCK_CATEGORIES, MarkupBlock, render_markup
from components.data.pages import LayoutElement
from components.parsing.frontend.blocks import Block, Blocks, FrontEndConfig
from components.parsing.frontend.detector import TextLineDetector
from components.parsing.frontend.lines import Box, LineBox
from components.parsing.frontend.normalise import NormalisedPage, normalise_page
from components.parsing.frontend.orientation import upright
from components.parsing.frontend.sources import LineSource
from components.parsing.layout import LayoutRegion, RapidLayoutModel


@dataclass
class FrontEndPage:
    width: int
    height: int
    blocks: list[Block] = field(default_factory=list)  # in reading order
    regions: list[LayoutRegion] = field(default_factory=list)
    seconds: float = 0.0
    normalised: list[str] = field(default_factory=list)  # what was done to a scan before detection
    # Set when the page carries ink a person would read but the front end read (nearly) nothing:
    # the page then has confidence 0 (first in the annotators' queue) and this says why.
    empty_reason: str | None = None

    @property
    def content_blocks(self) -> list[Block]:
        """Blocks that carry markup (not furniture or figures)."""
        return [b for b in self.blocks if b.category in BLOCK_CATEGORIES]

    @property
    def elements(self) -> list[LayoutElement]:
        return [LayoutElement(b.category, b.box, (b.content or "") if b.category in BLOCK_CATEGORIES else "")
                for b in self.blocks]

    @property
    def markup(self) -> str:
        return render_markup([MarkupBlock(b.category, b.content or "") for b in self.content_blocks])

    @property
    def read_lines(self) -> list:
        return [line for block in self.content_blocks for line in block.lines]

    @property
    def confidence(self) -> float:
        """The kept lines' scores weighted by their characters (0 on a page without text, and on a
        page with ink read as empty)."""
        if self.empty_reason:
            return 0.0
        lines = self.read_lines
        chars = sum(len(line.text) for line in lines)
        return sum(line.score * len(line.text) for line in lines) / chars if chars else 0.0

    @property
    def table_makers(self) -> list[str | None]:
        return [b.made_by for b in self.blocks if b.category == "table"]


class PageFrontEnd:
    """Page -> layout regions (rapid-layout) -> text lines (PP-OCR's detector, read by a line
    source; lines outside every region are kept) -> blocks -> reading order."""

    def __init__(self, config: FrontEndConfig | None = None):
        self.config = config = config or FrontEndConfig()
        self.detector = TextLineDetector(text_score=config.text_score, threads=config.threads,
                                         det_max_side=config.det_max_side,
                                         use_angle_classifier=config.use_angle_classifier)
        self.layout = RapidLayoutModel(config.layout_min_score, config.threads) if config.layout_model else None
        self.blocks = Blocks(config)

    def read(self, image: Image.Image, source: LineSource) -> FrontEndPage:
        """The page's blocks in its own pixels; a scan is read from its normalised image."""
        started = time.perf_counter()
        turned_page, back, turned = upright(image) if self.config.upright_pages else (image, None, 0)
        normalised = normalise_page(turned_page) if self.config.normalise_scans else NormalisedPage(turned_page)
        work = normalised.image
        lines = source.read(work, self.detector)
        regions = self.layout.regions(work) if self.layout is not None and lines else []
        blocks = self.blocks.build(lines, work.size, regions, work)
        if normalised.scale != 1.0:
            scale = normalised.scale
            blocks, regions = _in_page_pixels(blocks, regions, lambda box: tuple(v / scale for v in box))
        if back is not None:
            blocks, regions = _in_page_pixels(blocks, regions, back)
        steps = [f"turned upright (its text was turned {turned}° counter-clockwise)"] * bool(turned) + normalised.steps
        page = FrontEndPage(image.width, image.height, blocks, regions, time.perf_counter() - started,
                            normalised=steps)
        page.empty_reason = empty_page_reason(page, normalised)
        return page


MIN_INK_SHARE = 0.004  # of the page's area: a page with this much ink has something to read
MIN_READ_CHARACTERS = 20  # fewer characters read from such a page is reading nothing


def empty_page_reason(page: FrontEndPage, normalised: NormalisedPage) -> str | None:
    """Why a page with ink was read as (nearly) empty, or None. A page of figures and tables only
    is not empty: their regions hold its ink."""
    characters = sum(len(line.text) for line in page.read_lines)
    if normalised.ink_share < MIN_INK_SHARE or characters >= MIN_READ_CHARACTERS:
        return None
    if any(b.category in ("figure", "table") for b in page.blocks) or any(
            r.category in ("figure", "table") for r in page.regions):
        return None
    done = f" after {', '.join(normalised.steps)}" if normalised.steps else ""
    return (f"ink covers {normalised.ink_share:.1%} of the page but {characters} characters were read{done}: "
            "the text is too small, faint or noisy for the detector; read this page by hand")


def _in_page_pixels(blocks: list[Block], regions: list[LayoutRegion], to_page: Callable[[Box], Box]
                    ) -> tuple[list[Block], list[LayoutRegion]]:
    """Blocks and regions found on an upscaled or turned page, in the given page's own pixels."""
    def line(box: LineBox) -> LineBox:
        x0, y0, x1, y1 = to_page(box.box)
        return replace(box, x0=x0, y0=y0, x1=x1, y1=y1, parts=[line(part) for part in box.parts])

    return ([replace(block, lines=[line(x) for x in block.lines]) for block in blocks],
            [replace(region, box=to_page(region.box)) for region in regions])


@functools.cache
def shared_front_end() -> PageFrontEnd:
    """One front end per process with the default settings (its ONNX sessions load once)."""
    return PageFrontEnd()
