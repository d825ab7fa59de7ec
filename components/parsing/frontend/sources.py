"""Line sources: who reads the text of the lines the front end found.

- :class:`RecogniserLines`: PP-OCR's recogniser (RapidOCR's reading, the offline pre-annotation);
- :class:`ModelLines`: a model of ours through the decoding engine (the reader): every box the
  detector found on the page is cropped at native resolution and all of them are decoded as one
  engine batch; each line keeps its decode (tokens, speed accounting).

A PDF's text layer is the third source; its lines come with the page record, not from pixels
(:mod:`components.curation.preannotate.pdf_text`).
"""

from __future__ import annotations

from typing import Protocol

from PIL import Image

from components.data.pages import MIN_IMAGE_SIDE
from components.decoding.types import DecodeParams
from components.parsing.crops import CropSettings, native_crop
from components.parsing.frontend.detector import TextLineDetector
from components.parsing.frontend.lines import Box, LineBox
from models.interface import TEXT_LINE_INFO

# A detected box already has PP-OCR's unclip margin around its ink, and RapidOCR's recogniser reads
# it as it is: cropped the same (no margin added), the reader's copy of the recogniser's reading
# equals RapidOCR's on 721 of 743 benchmark lines (707 with a 2-pixel margin).
DETECTED_LINE_CROP = CropSettings(margin=0)
# A text layer's line box is tight around the glyphs: a margin keeps their edges.
TEXT_LAYER_LINE_CROP = CropSettings(margin=2)


def line_crop(image: Image.Image, box: Box, settings: CropSettings = DETECTED_LINE_CROP) -> Image.Image:
    """A line's pixels, marked as one text line for the model that reads it."""
    crop = native_crop(image, box, settings)
    crop.info[TEXT_LINE_INFO] = True
    return crop


class LineSource(Protocol):
    name: str

    def read(self, image: Image.Image, detector: TextLineDetector) -> list[LineBox]: ...


class RecogniserLines:
    name = "recogniser"

    def read(self, image: Image.Image, detector: TextLineDetector) -> list[LineBox]:
        return detector.recognise(image)


class ModelLines:
    """The detector's boxes read by a model through ``engine.generate`` (one batch per page)."""

    name = "model"

    def __init__(self, engine, params: DecodeParams | None = None):
        self.engine = engine
        self.params = params or DecodeParams()

    def read(self, image: Image.Image, detector: TextLineDetector) -> list[LineBox]:
        lines_of_page = [(box, line_crop(image, box)) for box in detector.detect(image)]
        # a sliver the detector boxed (a rule's end, a lone dot) is nothing a model reads
        kept = [(box, crop) for box, crop in lines_of_page if min(crop.size) >= MIN_IMAGE_SIDE]
        if not kept:
            return []
        boxes, crops = [box for box, _ in kept], [crop for _, crop in kept]
        results = self.engine.generate(crops, self.params)
        lines = []
        for box, result in zip(boxes, results, strict=True):
            text = " ".join(result.text.split())
            if text:
                lines.append(LineBox(text, result.stats.mean_confidence, *box, decoded=result))
        return lines
