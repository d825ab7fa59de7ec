"""Element crops at native resolution: the second stage sees an element's pixels as the page has
them (the point of two-stage parsing), never a page squeezed into the model's input size.

A region's box is clipped to the image and widened by a margin; regions that leave nothing to
read are skipped with a reason (never an exception: one bad box must not lose the page), and a
crop above the pixel cap is scaled down to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from components.parsing.layout.region import Box

# Reasons a region is not decoded (reported per element).
OUTSIDE = "outside the image"
DEGENERATE = "degenerate box"
BLANK = "blank region"


@dataclass(frozen=True)
class CropSettings:
    margin: int = 2  # pixels added on every side (glyphs touching the box edge stay whole)
    min_side: int = 4  # a clipped box thinner than this holds nothing legible
    max_pixels: int = 1_000_000  # larger crops are scaled down to this many pixels
    ink_threshold: int = 200  # a crop whose darkest pixel is lighter than this is blank


DEFAULT_CROP = CropSettings()


@dataclass
class Crop:
    image: Image.Image | None  # None when skipped
    box: Box  # the clipped box in page pixels (before the margin)
    skipped: str | None = None


def clip_box(box: Box, width: int, height: int) -> Box:
    x0, y0, x1, y1 = box
    return (min(max(x0, 0.0), width), min(max(y0, 0.0), height), min(max(x1, 0.0), width), min(max(y1, 0.0), height))


def crop_region(image: Image.Image, box: Box, settings: CropSettings = DEFAULT_CROP) -> Crop:
    """The region's pixels (clipped, with margin, capped), or the reason there are none."""
    if any(not math.isfinite(v) for v in box):
        return Crop(None, box, DEGENERATE)
    clipped = clip_box(box, image.width, image.height)
    x0, y0, x1, y1 = clipped
    if x1 <= x0 or y1 <= y0:
        return Crop(None, clipped, OUTSIDE if (box[2] > box[0] and box[3] > box[1]) else DEGENERATE)
    if x1 - x0 < settings.min_side or y1 - y0 < settings.min_side:
        return Crop(None, clipped, DEGENERATE)
    crop = native_crop(image, clipped, settings)
    if int(np.asarray(crop.convert("L")).min()) >= settings.ink_threshold:
        return Crop(None, clipped, BLANK)
    return Crop(crop, clipped)


def native_crop(image: Image.Image, box: Box, settings: CropSettings = DEFAULT_CROP) -> Image.Image:
    """The box's pixels with the margin, clipped to the image, scaled down only above the pixel
    cap: the crop training and decoding both use."""
    x0, y0, x1, y1 = clip_box(box, image.width, image.height)
    m = settings.margin
    pixels = (max(0, math.floor(x0) - m), max(0, math.floor(y0) - m),
              min(image.width, max(math.ceil(x1) + m, math.floor(x0) + 1)),
              min(image.height, max(math.ceil(y1) + m, math.floor(y0) + 1)))
    crop = image.crop(pixels)
    area = crop.width * crop.height
    if area > settings.max_pixels:
        scale = math.sqrt(settings.max_pixels / area)
        crop = crop.resize((max(1, int(crop.width * scale)), max(1, int(crop.height * scale))), Image.Resampling.BILINEAR)
    return crop
