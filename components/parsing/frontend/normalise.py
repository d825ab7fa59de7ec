"""Scanned pages made readable before detection: background flattened, noise removed, skew undone,
low-resolution pages brought to the detector's working scale; and the ink a page carries, so that a
page a person can read never comes back empty without a reason.

A born-digital render (white paper, no noise, no skew) is returned untouched, so clean pages read
exactly as before; a clean but skewed or very low-resolution page (a fax: binarised, white) is only
deskewed and upscaled. A scan is recognised by its paper (darker than white) or its sensor
noise; then, in order:

1. background flattening: the page divided by its background (a max filter over a downsampled page:
   the paper's brightness wherever no ink is), so grey or unevenly lit paper becomes white, and its
   darkest ink stretched to black (a poor scan's ink is a grey barely darker than its paper);
2. denoising: a 3x3 median filter when the paper's noise is high (speckle the detector reads as text
   texture, or drowns faint strokes in);
3. deskew: the angle within ±3° whose horizontal ink profile is sharpest, turned back;
4. upscaling: a page whose text lines are under ``MIN_LINE_HEIGHT`` pixels (a 100-dpi scan) is
   scaled up so they reach it; the front end maps its boxes back to the page's own pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageFilter

WHITE_PAPER = 250  # a render's paper: at least this bright
BILEVEL_SHARE = 0.97  # a page whose pixels are this much pure black or white was binarised (a fax)
NOISY = 3.0  # the paper's noise (grey levels, median absolute deviation) from which it counts as a scan
DENOISE_FROM = 6.0  # noise from which the page is median-filtered
MAX_SKEW = 3.0  # degrees searched for skew
MIN_SKEW = 0.15  # a smaller skew is left alone
MIN_LINE_HEIGHT = 22  # pixels a text line should span for the detector and recogniser (a 150-dpi line ~ 20-28)
FAX_LINE_HEIGHT = 16  # a clean page (render, fax) is upscaled only when its lines are under this
MAX_UPSCALE = 2.0
INK_LEVEL = 110  # grey levels below the paper from which a flattened pixel is ink


@dataclass
class NormalisedPage:
    """What detection and reading see, and how it relates to the page's own pixels."""

    image: Image.Image
    scale: float = 1.0  # normalised pixels per page pixel
    angle: float = 0.0  # degrees the page was turned back by
    steps: list[str] = field(default_factory=list)  # what was done, for the page's record
    ink_share: float = 0.0  # the share of the page's area that is ink (after flattening)

    def to_page(self, box: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
        """A box of the normalised image in the page's own pixels (the small deskew turn is ignored)."""
        return tuple(v / self.scale for v in box)  # type: ignore[return-value]


def normalise_page(image: Image.Image) -> NormalisedPage:
    """The page as detection should see it (see the module doc); a clean render is returned as it is."""
    gray = image.convert("L")
    pixels = np.asarray(gray, dtype=np.float32)
    background = _background(gray)
    paper = float(np.median(background))
    spread = float(np.percentile(background, 95) - np.percentile(background, 5))
    noise = _paper_noise(pixels, background)
    # White noiseless paper is no scan, however uneven its background (a render's figures darken it).
    scan = paper < WHITE_PAPER or noise > NOISY
    if not scan:  # a render or a clean binarised page (a fax): only skew and a fax's low resolution are undone
        ink = pixels < paper - INK_LEVEL
        angle = _skew(ink)
        bilevel = float(((pixels < 16) | (pixels > 239)).mean()) > BILEVEL_SHARE
        small = bilevel and 0 < _line_height(ink) < FAX_LINE_HEIGHT
        if abs(angle) < MIN_SKEW and not small:
            return NormalisedPage(image, ink_share=float(ink.mean()))  # a render: read as it is
        page, steps = gray, []
        if abs(angle) >= MIN_SKEW:
            page = page.rotate(-angle, resample=Image.Resampling.BICUBIC, fillcolor=255)
            steps.append(f"deskewed {angle:+.2f}°")
            ink = np.asarray(page) < paper - INK_LEVEL
        scale = 1.0
        line = _line_height(ink)
        if bilevel and 0 < line < FAX_LINE_HEIGHT:
            scale = min(MAX_UPSCALE, MIN_LINE_HEIGHT / line)
            page = page.resize((round(page.width * scale), round(page.height * scale)), Image.Resampling.LANCZOS)
            steps.append(f"upscaled {scale:.2f}x (text lines {line:.0f} px)")
        return NormalisedPage(page.convert("RGB"), scale=scale, angle=-angle if abs(angle) >= MIN_SKEW else 0.0,
                              steps=steps, ink_share=float(ink.mean()))
    steps = [f"scan (paper {paper:.0f}, unevenness {spread:.0f}, noise {noise:.1f})"]
    flat = np.clip(pixels / np.maximum(background, 1.0) * 255.0, 0, 255)
    darkest = float(np.percentile(flat, 0.5))  # the page's darkest ink: stretched to black
    if darkest < 200:
        flat = np.clip((flat - darkest) / (255.0 - darkest) * 255.0, 0, 255)
    page = Image.fromarray(flat.astype(np.uint8), "L")
    steps.append("background flattened")
    if noise > DENOISE_FROM:
        page = page.filter(ImageFilter.MedianFilter(3))
        steps.append("denoised")
    ink = np.asarray(page) < 255 - INK_LEVEL
    angle = _skew(ink)
    if abs(angle) >= MIN_SKEW:
        page = page.rotate(-angle, resample=Image.Resampling.BICUBIC, fillcolor=255)
        steps.append(f"deskewed {angle:+.2f}°")
    scale = 1.0
    line = _line_height(ink)
    if 0 < line < MIN_LINE_HEIGHT:
        scale = min(MAX_UPSCALE, MIN_LINE_HEIGHT / line)
        page = page.resize((round(page.width * scale), round(page.height * scale)), Image.Resampling.LANCZOS)
        steps.append(f"upscaled {scale:.2f}x (text lines {line:.0f} px)")
    return NormalisedPage(page.convert("RGB"), scale=scale, angle=-angle if abs(angle) >= MIN_SKEW else 0.0,
                          steps=steps, ink_share=float(ink.mean()))


def _background(gray: Image.Image, cell: int = 8) -> np.ndarray:
    """The paper's brightness everywhere: the brightest nearby pixels of a downsampled page
    (wider than a glyph, so ink never counts), smoothed and scaled back to the page."""
    small = gray.resize((max(1, gray.width // cell), max(1, gray.height // cell)), Image.Resampling.BOX)
    paper = small.filter(ImageFilter.MaxFilter(5)).filter(ImageFilter.GaussianBlur(2))
    return np.asarray(paper.resize(gray.size, Image.Resampling.BILINEAR), dtype=np.float32)


def _paper_noise(pixels: np.ndarray, background: np.ndarray) -> float:
    """The median absolute deviation of the paper's pixels from the background (ink left out)."""
    paper = pixels[pixels > background - 40]
    if paper.size == 0:
        return 0.0
    return float(np.median(np.abs(paper - np.median(paper))))


def _skew(ink: np.ndarray) -> float:
    """The angle (degrees, counter-clockwise positive) whose row profile of ink is sharpest."""
    step = max(1, max(ink.shape) // 1000)
    ys, xs = np.nonzero(ink[::step, ::step])
    if len(xs) < 200:
        return 0.0
    ys, xs = ys.astype(np.float32), xs.astype(np.float32)
    best, best_score = 0.0, -1.0
    for coarse in (np.arange(-MAX_SKEW, MAX_SKEW + 1e-6, 0.25), None):
        angles = coarse if coarse is not None else np.arange(best - 0.25, best + 0.25 + 1e-6, 0.05)
        for angle in angles:
            rows = np.round(ys - xs * np.tan(np.radians(angle))).astype(np.int64)
            counts = np.bincount(rows - rows.min())
            score = float((counts.astype(np.float64) ** 2).sum())
            if score > best_score:
                best, best_score = float(angle), score
    return -best


def _line_height(ink: np.ndarray) -> float:
    """The median height of the page's runs of inked rows (a text line's height), 0 without any."""
    rows = ink.mean(axis=1) > 0.002
    runs, start = [], None
    for y, inked in enumerate([*rows.tolist(), False]):
        if inked and start is None:
            start = y
        elif not inked and start is not None:
            if y - start >= 3:
                runs.append(y - start)
            start = None
    return float(np.median(runs)) if runs else 0.0
