"""One page through the front end: layout regions, text lines from a line source, blocks in
reading order, and what the consumers need from them (elements, markup, confidence)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from PIL import Image

from components.data.markup import BLOCK_CATEGORIES, MarkupBlock, render_markup
from components.data.pages import LayoutElement
from components.parsing.frontend.blocks import Block, Blocks, FrontEndConfig
from components.parsing.frontend.detector import TextLineDetector
from components.parsing.frontend.sources import LineSource
from components.parsing.layout import LayoutRegion, RapidLayoutModel


@dataclass
class FrontEndPage:
    width: int
    height: int
    blocks: list[Block] = field(default_factory=list)  # in reading order
    regions: list[LayoutRegion] = field(default_factory=list)
    seconds: float = 0.0

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
        """The kept lines' scores weighted by their characters (0 on a page without text)."""
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
        started = time.perf_counter()
        lines = source.read(image, self.detector)
        regions = self.layout.regions(image) if self.layout is not None and lines else []
        blocks = self.blocks.build(lines, image.size, regions, image)
        return FrontEndPage(image.width, image.height, blocks, regions, time.perf_counter() - started)


@functools.cache
def shared_front_end() -> PageFrontEnd:
    """One front end per process with the default settings (its ONNX sessions load once)."""
    return PageFrontEnd()
