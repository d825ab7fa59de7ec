"""Pre-annotation from a born-digital PDF's own text layer, with OCR where a page has none.

A page imported from a PDF (:func:`components.data.pdf.import_pdfs` records ``pdf_path``,
``page_number`` and ``render_dpi``) carries every character with its box in the PDF itself: that
is exact, and independent of any model we train, so it is the best truth a page can have short of
an annotator. The elements are built as the corpus builds them (:func:`components.data.corpus.page_elements`:
titles by font size, code from monospace runs with its indentation, running heads and folios as
layout-only furniture).

Two backends:

- ``pdf-text``: the text layer only; a page without a usable one is refused with the reason.
- ``auto`` (the default for ``ingest.pdf_dir``): the text layer where it is usable, else the
  ``fallback`` OCR backend (RapidOCR by default), page by page. The reason for a fallback is
  logged and stored on the page's pre-annotation (``extra["fallback_reason"]``), and
  ``extra["source"]`` says where the page's text came from (``text-layer`` or ``ocr:<version>``).

A text layer is unusable when the page has no PDF behind it (an image), the PDF is gone, the layer
is empty or its glyphs have no Unicode (no ToUnicode map), its lines have no ink under them
(invisible text over other pixels, a layer shifted or turned by ``/Rotate``), or they cover too little
of the page's ink (a scan whose OCR layer misses text, a page of pictures).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pypdfium2 as pdfium
from PIL import Image

from components.curation.preannotate.base import PageAnnotationError, PreAnnotation, PreAnnotator
from components.data.corpus import page_elements, text_layer_problem
from components.data.pages import LayoutElement, Page
from components.data.text_layer import TextLine, page_truth, text_layer_lines
from components.parsing.layout import LayoutRegion, RapidLayoutModel
from components.parsing.tables import slanet_available, table_from_pixels

logger = logging.getLogger(__name__)

TEXT_LAYER_VERSION = "pdf-text-v1"
TEXT_LAYER_SOURCE = "text-layer"
INK_LEVEL = 128  # grey values below this are ink
BOX_PAD = 3  # pixels around a line box that still count as its ink


@dataclass
class PdfTextConfig:
    # share of the page's ink inside text-layer line boxes (figures and rules are ink without text)
    min_ink_coverage: float = 0.25
    min_inked_lines: float = 0.9  # share of text-layer lines with ink under them (the layer is drawn)
    # table regions (rapid-layout) become HTML tables: SLANet's structure from the pixels, each cell's
    # text from the layer's runs inside it (components/parsing/tables.py); False: tables stay text
    tables: bool = True
    fallback: dict | None = field(default_factory=lambda: {"backend": "rapidocr"})  # auto only
    model_version: str | None = None


def ink_mask(image: Image.Image) -> np.ndarray:
    """The page's dark pixels (computed once per page, read by both checks below)."""
    return np.asarray(image.convert("L")) < INK_LEVEL


def inked_lines(ink: np.ndarray, boxes: list[tuple[float, float, float, float]]) -> float:
    """Share of the boxes with ink under them (>= 1 % dark pixels): a layer whose text is not drawn
    (invisible OCR text over other pixels, a layer that is shifted) leaves its boxes blank."""
    height, width = ink.shape
    inked = 0
    for x0, y0, x1, y1 in boxes:
        area = ink[max(0, int(y0)):min(height, int(y1) + 1), max(0, int(x0)):min(width, int(x1) + 1)]
        inked += area.size > 0 and area.mean() >= 0.01
    return inked / len(boxes) if boxes else 0.0


def ink_coverage(ink: np.ndarray, boxes: list[tuple[float, float, float, float]]) -> float | None:
    """Share of the page's dark pixels inside the (padded) boxes; None on a page without ink."""
    total = int(ink.sum())
    if total == 0:
        return None
    covered = np.zeros_like(ink)
    height, width = ink.shape
    for x0, y0, x1, y1 in boxes:
        covered[max(0, int(y0) - BOX_PAD):min(height, int(y1) + BOX_PAD + 1),
                max(0, int(x0) - BOX_PAD):min(width, int(x1) + BOX_PAD + 1)] = True
    return float((ink & covered).sum()) / total


class TextLayerUnusable(PageAnnotationError):
    """This page's text layer cannot be its truth; the message says why."""


class PdfTextAnnotator:
    """The ``pdf-text`` backend: a page's text layer as elements and markup (confidence 1)."""

    name = "pdf-text"

    def __init__(self, config: PdfTextConfig | None = None):
        self.config = config or PdfTextConfig()
        self._layout: RapidLayoutModel | None = None

    @property
    def model_version(self) -> str:
        return self.config.model_version or TEXT_LAYER_VERSION

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        raise TextLayerUnusable(f"page {page_id}: no PDF behind a bare image")

    def annotate_page(self, page: Page, image: Image.Image) -> PreAnnotation:
        return self.text_layer_annotation(page, image)

    def text_layer_annotation(self, page: Page, image: Image.Image) -> PreAnnotation:
        """The page's text layer as a pre-annotation, or :class:`TextLayerUnusable` with the reason."""
        meta = page.meta
        if not meta.get("pdf_path") or not meta.get("page_number"):
            raise TextLayerUnusable("not imported from a PDF")
        path = Path(meta["pdf_path"])
        if not path.is_file():
            raise TextLayerUnusable(f"its PDF {path} is gone")
        dpi = float(meta.get("render_dpi") or 144)
        index = int(meta["page_number"]) - 1
        try:
            pdf = pdfium.PdfDocument(str(path))
        except pdfium.PdfiumError as exc:
            raise TextLayerUnusable(f"its PDF cannot be opened: {exc}") from exc
        try:
            if index >= len(pdf):
                raise TextLayerUnusable(f"its PDF has no page {index + 1}")
            lines = text_layer_lines(pdf[index], dpi)
            problem = text_layer_problem(lines)
            if problem:
                raise TextLayerUnusable(problem)
            boxes = [line.box for line in lines]
            ink = ink_mask(image)
            drawn = inked_lines(ink, boxes)
            if drawn < self.config.min_inked_lines:
                raise TextLayerUnusable(f"only {drawn:.0%} of its text-layer lines have ink under them "
                                        f"(< {self.config.min_inked_lines:.0%}: the layer is not what the page shows)")
            coverage = ink_coverage(ink, boxes)
            if coverage is not None and coverage < self.config.min_ink_coverage:
                raise TextLayerUnusable(f"its text layer covers {coverage:.0%} of the page's ink "
                                        f"(< {self.config.min_ink_coverage:.0%}: a scan, a rotated page or pictures)")
            truth = page_truth(pdf, index, dpi, lines=lines,
                               lines_of=lambda number: text_layer_lines(pdf[number], dpi))
        finally:
            pdf.close()
        tables = self._tables(image, truth.body)
        # table regions as text regions, so that no block runs across a table's edge
        regions = [LayoutRegion("text", region.box, region.score) for region, _ in tables]
        elements, _ = page_elements(truth.body, truth.furniture, float(image.height), regions)
        elements = _with_tables(elements, tables)
        markup = Page("_", "", image.width, image.height, elements=elements).markup
        return PreAnnotation(markup, 1.0, self.model_version, elements,
                             {"source": TEXT_LAYER_SOURCE, "ink_coverage": None if coverage is None else round(coverage, 3),
                              "tables": ["slanet"] * len(tables)})

    def _tables(self, image: Image.Image, body: list[TextLine]) -> list[tuple[LayoutRegion, str]]:
        """Each table region rapid-layout finds, with its HTML: SLANet's cells holding the text
        layer's runs (a region SLANet finds no cell in stays text)."""
        if not self.config.tables or not slanet_available():
            return []
        if self._layout is None:
            self._layout = RapidLayoutModel(0.5, 1)
        found = []
        for region in (r for r in self._layout.regions(image) if r.category == "table"):
            inside = [line for line in body if _inside(line.box, region.box)]
            if not inside or sum(line.mono for line in inside) * 2 > len(inside):
                continue  # a code listing the detector took for a table: monospace lines stay code
            x0, y0 = max(0, int(region.box[0]) - 4), max(0, int(region.box[1]) - 4)
            x1, y1 = min(image.width, int(region.box[2]) + 4), min(image.height, int(region.box[3]) + 4)
            runs = [(text, (b[0] - x0, b[1] - y0, b[2] - x0, b[3] - y0))
                    for line in inside for text, b in (line.segments or [(line.text, line.box)])]
            html = table_from_pixels(image.crop((x0, y0, x1, y1)), runs) if runs and x1 - x0 > 8 and y1 - y0 > 8 else None
            if html:
                found.append((region, html))
        return found


def _inside(box: tuple[float, ...], region: tuple[float, ...]) -> bool:
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return region[0] <= cx <= region[2] and region[1] <= cy <= region[3]


def _with_tables(elements: list[LayoutElement], tables: list[tuple[LayoutRegion, str]]) -> list[LayoutElement]:
    """The first text block inside each table region becomes the table (so it keeps its place in
    reading order); the region's other blocks go."""
    out: list[LayoutElement] = []
    placed: set[int] = set()
    for element in elements:
        owner = next((i for i, (region, _) in enumerate(tables)
                      if element.category in ("text", "title", "code") and _inside(element.bbox, region.box)), None)
        if owner is None:
            out.append(element)
        elif owner not in placed:
            placed.add(owner)
            region, html = tables[owner]
            out.append(LayoutElement("table", tuple(float(v) for v in region.box), html))
    return out


class AutoAnnotator(PdfTextAnnotator):
    """The ``auto`` backend: the text layer where the page has a usable one, else OCR."""

    name = "auto"

    def __init__(self, config: PdfTextConfig, fallback: PreAnnotator):
        super().__init__(config)
        self.fallback = fallback  # built from config.fallback by the factory

    @property
    def model_version(self) -> str:
        return self.config.model_version or f"auto({TEXT_LAYER_VERSION}|{self.fallback.model_version})"

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        return self._ocr(image, page_id, "not imported from a PDF")

    def annotate_page(self, page: Page, image: Image.Image) -> PreAnnotation:
        try:
            annotation = self.text_layer_annotation(page, image)
        except TextLayerUnusable as exc:
            return self._ocr(image, page.page_id, str(exc))
        annotation.model_version = self.model_version
        return annotation

    def _ocr(self, image: Image.Image, page_id: str, reason: str) -> PreAnnotation:
        logger.info("page %s: OCR instead of the text layer: %s", page_id, reason)
        annotation = self.fallback.annotate(image, page_id)
        annotation.extra = {**annotation.extra, "source": f"ocr:{annotation.model_version}", "fallback_reason": reason}
        annotation.model_version = self.model_version
        return annotation
