"""PP-OCR's text-line detector and recogniser, the ONNX models inside the rapidocr wheel.

The detector finds lines anywhere on the page (inside a layout region or not); the recogniser
reads them. The front end runs the detector for every line source; the recogniser is one source
(RapidOCR's own reading), the reader another (:mod:`~components.parsing.frontend.sources`).
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from components.data.pages import validate_image
from components.parsing.frontend.lines import Box, LineBox


class TextLineDetector:
    """RapidOCR's engine, loaded on first use. ``det_max_side``: the page is scaled so its longer
    side is at most this many pixels for detection (None: RapidOCR's default)."""

    def __init__(self, *, text_score: float = 0.5, threads: int | None = None, det_max_side: int | None = 960,
                 use_angle_classifier: bool = False):
        self.text_score = text_score
        self.threads = threads
        self.det_max_side = det_max_side
        self.use_angle_classifier = use_angle_classifier
        self._engine: Any = None

    def engine(self) -> Any:
        if self._engine is None:
            # deferred: its ONNX sessions load in seconds, only on this path
            from rapidocr import RapidOCR  # the ONNX models load with the engine (seconds): only when asked

            params: dict[str, Any] = {"Global.log_level": "error", "Global.text_score": self.text_score,
                                      "Global.use_cls": self.use_angle_classifier}
            if self.det_max_side:
                params.update({"Det.limit_side_len": int(self.det_max_side), "Det.limit_type": "max"})
            if self.threads:
                params["EngineConfig.onnxruntime.intra_op_num_threads"] = int(self.threads)
            self._engine = RapidOCR(params=params)
        return self._engine

    def detect(self, image: Image.Image) -> list[Box]:
        """The page's text-line boxes (axis-aligned, page pixels), top to bottom, left to right."""
        validate_image(image)
        result = self.engine()(image.convert("RGB"), use_det=True, use_cls=False, use_rec=False)
        if result.boxes is None:
            return []
        boxes = [(min(float(p[0]) for p in quad), min(float(p[1]) for p in quad),
                  max(float(p[0]) for p in quad), max(float(p[1]) for p in quad)) for quad in result.boxes]
        return sorted(boxes, key=lambda b: ((b[1] + b[3]) / 2, b[0]))

    def recognise(self, image: Image.Image) -> list[LineBox]:
        """The detector's boxes read by the recogniser (empty readings and those under
        ``text_score`` dropped), top to bottom."""
        validate_image(image)
        # every flag explicit: RapidOCR keeps the flags of its previous call (a detect-only one)
        result = self.engine()(image.convert("RGB"), use_det=True, use_cls=self.use_angle_classifier, use_rec=True)
        if result.boxes is None or not result.txts:
            return []
        lines = []
        for quad, text, score in zip(result.boxes, result.txts, result.scores, strict=True):
            xs, ys = [float(p[0]) for p in quad], [float(p[1]) for p in quad]
            if text.strip():
                lines.append(LineBox(text.strip(), float(score), min(xs), min(ys), max(xs), max(ys)))
        return sorted(lines, key=lambda b: (b.center_y, b.x0))
