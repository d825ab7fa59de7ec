"""Scanned pages with exact truth: a born-digital page degraded as a print-and-scan process does.

A team's archive comes from a few scanners, each with its own faults, so a document gets one
*device* (:func:`device_for`): a profile's resolution, skew, blur, sensor noise, paper tone and
unevenness, JPEG quality, fax binarisation and bleed-through, each drawn once per document within
the profile's range. Every page of the document then goes through that device with its own seed
(:func:`scan_page`). The truth stays the born-digital original's text layer: the answer key an
annotator would type.

Paper and ink effects come from augraphy (its bleed-through, ink bleed, paper texture and fax
pipelines, seeded); resampling to the scanner's resolution, skew, blur, sensor noise and JPEG are
done here with PIL and numpy, since they must be exact and cheap.

Profiles (``PROFILES``): ``clean`` (the render itself), ``office`` (150 dpi office MFP: slight skew,
blur, noise, JPEG 75), ``poor`` (100 dpi cheap scanner: grey uneven paper, heavy noise, JPEG 30),
``fax`` (96-200 dpi, binarised), ``bleed`` (150 dpi, thin paper: the back page
shows through).
"""

from __future__ import annotations

import hashlib
import io
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter


@dataclass(frozen=True)
class ScanDevice:
    """One scanner as it treats every page: the resolution it samples at, and its faults."""

    name: str
    dpi: int
    skew_deg: float = 0.0  # the page's rotation on the glass (signed)
    blur: float = 0.0  # Gaussian radius in scan pixels (optics, focus)
    noise: float = 0.0  # sensor noise, standard deviation in grey levels
    paper: int = 255  # the paper's grey level
    unevenness: float = 0.0  # grey levels of low-frequency background variation (lighting, paper)
    jpeg_quality: int | None = None
    fax: bool = False  # binarised as a fax or a 1-bit scanner does
    bleed_through: float = 0.0  # strength of the back page showing through (0: none)
    ink_bleed: bool = False  # ink spread into the paper (blotted strokes)


@dataclass(frozen=True)
class ScanProfile:
    """A family of devices: the range each fault is drawn from, once per document."""

    name: str
    dpi: tuple[int, int]
    skew_deg: tuple[float, float] = (0.0, 0.0)
    blur: tuple[float, float] = (0.0, 0.0)
    noise: tuple[float, float] = (0.0, 0.0)
    paper: tuple[int, int] = (255, 255)
    unevenness: tuple[float, float] = (0.0, 0.0)
    jpeg_quality: tuple[int, int] | None = None
    fax: bool = False
    bleed_through: tuple[float, float] = (0.0, 0.0)
    ink_bleed: bool = False


PROFILES: dict[str, ScanProfile] = {
    "clean": ScanProfile("clean", dpi=(0, 0)),
    "office": ScanProfile("office", dpi=(150, 150), skew_deg=(0.3, 0.7), blur=(0.4, 0.7), noise=(3.0, 6.0),
                          paper=(240, 250), unevenness=(3.0, 8.0), jpeg_quality=(70, 80)),
    "poor": ScanProfile("poor", dpi=(100, 100), skew_deg=(0.5, 1.2), blur=(0.5, 0.8), noise=(12.0, 20.0),
                        paper=(195, 215), unevenness=(10.0, 25.0), jpeg_quality=(28, 35), ink_bleed=True),
    "fax": ScanProfile("fax", dpi=(96, 200), skew_deg=(0.3, 1.0), blur=(0.3, 0.6), noise=(4.0, 10.0),
                       paper=(235, 250), fax=True),
    "bleed": ScanProfile("bleed", dpi=(150, 150), skew_deg=(0.2, 0.6), blur=(0.3, 0.6), noise=(3.0, 6.0),
                         paper=(235, 248), unevenness=(3.0, 8.0), jpeg_quality=(70, 85), bleed_through=(0.25, 0.45)),
}


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


def device_for(profile: str | ScanProfile, document: str, seed: int = 0) -> ScanDevice:
    """The scanner one document went through: each fault drawn once within the profile's range."""
    spec = PROFILES[profile] if isinstance(profile, str) else profile
    rng = random.Random(_seed(spec.name, document, seed))

    def draw(bounds: tuple[float, float]) -> float:
        return rng.uniform(*bounds)

    return ScanDevice(
        name=f"{spec.name}:{document}", dpi=rng.choice(sorted({spec.dpi[0], spec.dpi[1]})) if spec.fax else spec.dpi[0],
        skew_deg=draw(spec.skew_deg) * rng.choice((-1, 1)), blur=draw(spec.blur), noise=draw(spec.noise),
        paper=round(draw(spec.paper)), unevenness=draw(spec.unevenness),
        jpeg_quality=None if spec.jpeg_quality is None else rng.randint(*spec.jpeg_quality),
        fax=spec.fax, bleed_through=draw(spec.bleed_through), ink_bleed=spec.ink_bleed,
    )


def scan_page(image: Image.Image, render_dpi: float, device: ScanDevice, seed: int = 0,
              back: Image.Image | None = None) -> Image.Image:
    """``image`` (a render at ``render_dpi``) as ``device`` scans it, at the device's resolution.
    ``back``: the page printed on the other side (for bleed-through; default the page itself,
    mirrored). Deterministic for a given seed. The result's ``info["dpi"]`` is the scan's."""
    if device.dpi <= 0:  # clean: the render itself
        return image.convert("RGB")
    rng = np.random.default_rng(_seed(device.name, seed))
    gray = image.convert("L")
    if device.bleed_through > 0:
        gray = _bleed_through(gray, back.convert("L") if back is not None else gray, device.bleed_through, rng)
    if device.ink_bleed:
        gray = _augraphy(gray, "ink_bleed", rng)
    scale = device.dpi / render_dpi
    size = (max(1, round(gray.width * scale)), max(1, round(gray.height * scale)))
    if device.skew_deg:
        gray = gray.rotate(device.skew_deg, resample=Image.Resampling.BILINEAR, expand=False, fillcolor=255)
    gray = gray.resize(size, Image.Resampling.LANCZOS)
    if device.blur:
        gray = gray.filter(ImageFilter.GaussianBlur(device.blur))
    pixels = np.asarray(gray, dtype=np.float32) / 255.0
    # paper tone and lighting: ink stays dark, white becomes the paper's (uneven) grey
    background = float(device.paper) + _low_frequency(pixels.shape, device.unevenness, rng)
    pixels = pixels * background
    if device.noise:
        pixels = pixels + rng.normal(0.0, device.noise, pixels.shape)
    pixels = np.clip(pixels, 0, 255).astype(np.uint8)
    scanned = Image.fromarray(pixels, "L")
    if device.fax:
        scanned = _augraphy(scanned, "fax", rng)
    if device.jpeg_quality is not None:
        buffer = io.BytesIO()
        scanned.save(buffer, "JPEG", quality=device.jpeg_quality)
        scanned = Image.open(io.BytesIO(buffer.getvalue()))
    scanned = scanned.convert("RGB")
    scanned.info["dpi"] = (device.dpi, device.dpi)
    return scanned


def _low_frequency(shape: tuple[int, int], amplitude: float, rng: np.random.Generator) -> np.ndarray:
    """A smooth field of about ``amplitude`` grey levels (uneven lighting and paper), mean zero."""
    if amplitude <= 0:
        return np.zeros(shape, dtype=np.float32)
    coarse = rng.normal(0.0, 1.0, (4, 4)).astype(np.float32)
    field = np.asarray(Image.fromarray(coarse, "F").resize((shape[1], shape[0]), Image.Resampling.BICUBIC))
    field = field - field.mean()
    return field / max(1e-6, float(np.abs(field).max())) * amplitude


def _bleed_through(front: Image.Image, back: Image.Image, strength: float, rng: np.random.Generator) -> Image.Image:
    """The back page, mirrored, blurred and faint, darkening the front where its ink is."""
    mirrored = back.transpose(Image.Transpose.FLIP_LEFT_RIGHT).resize(front.size).filter(ImageFilter.GaussianBlur(2.0))
    shift = tuple(int(v) for v in rng.integers(-12, 13, 2))
    mirrored = mirrored.transform(mirrored.size, Image.Transform.AFFINE, (1, 0, shift[0], 0, 1, shift[1]), fillcolor=255)
    ink = 1.0 - np.asarray(mirrored, dtype=np.float32) / 255.0
    pixels = np.asarray(front, dtype=np.float32) * (1.0 - strength * ink)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "L")


def _augraphy(gray: Image.Image, effect: str, rng: np.random.Generator) -> Image.Image:
    """augraphy's ink bleed or fax pipeline, seeded (it draws from Python's and numpy's global RNGs)."""
    # deferred: augraphy pulls numba and scikit-image (seconds to import); only scans use it
    import augraphy

    if effect == "ink_bleed":
        phase = [augraphy.InkBleed(intensity_range=(0.3, 0.5), kernel_size=(3, 3), severity=(0.2, 0.3), p=1)]
        pipeline = augraphy.AugraphyPipeline(ink_phase=phase, paper_phase=[], post_phase=[], random_seed=int(rng.integers(2**31)))
    else:
        phase = [augraphy.Faxify(scale_range=(1.0, 1.0), monochrome=1, monochrome_method="threshold_otsu", halftone=0, p=1)]
        pipeline = augraphy.AugraphyPipeline(ink_phase=[], paper_phase=[], post_phase=phase, random_seed=int(rng.integers(2**31)))
    state = random.getstate(), np.random.get_state()
    try:
        out = pipeline(np.asarray(gray))
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
    if out.ndim == 3:
        out = out[..., 0]
    return Image.fromarray(np.asarray(out, dtype=np.uint8), "L")

