"""The page's own boxes as its layout: oracle evaluation (recognition error without layout error)
and training, where every element of a page with ground truth is a crop with its target."""

from __future__ import annotations

from PIL import Image

from components.data.pages import Page
from components.parsing.layout.region import LayoutRegion


class GroundTruthLayout:
    name = "ground-truth"

    def detect(self, image: Image.Image, page: Page | None = None) -> list[LayoutRegion]:
        """The page's elements in their stored (reading) order, score 1."""
        if page is None:
            raise ValueError("the ground-truth layout needs the page record whose boxes it returns")
        return [LayoutRegion(e.category, e.bbox, 1.0) for e in page.elements]
