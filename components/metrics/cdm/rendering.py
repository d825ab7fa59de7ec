"""Rendering a formula with one colour per token and reading each token's box back.

As the official CDM does: the coloured formula goes into a ``displaymath`` of a 12-pt article on
A5 landscape paper (A4 above 600 tokens, A3 above 1,300), ``pdflatex`` compiles it, the page is
rasterised at 200 dpi (Ghostscript's ``pngalpha`` device with the settings ImageMagick's
``magick -density 200`` hands it, so the pixels are the official ones), cropped to its ink with
8 pixels around, and each token's box is where its exact colour lies (one pixel added around).

Renderings are cached on disk by the hash of the LaTeX document, so the ground truth of a test
set is rendered once across evaluation runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from components.metrics.cdm.latex import FormulaError, colour_tokens, normalize, tokenize

DPI = 200
CROP_PAD = 8
COMPILE_SECONDS = 30
COLOUR_GAP = 15  # colour channels step by 15: 18 levels each, black (the first) left out
TOOLS = ("pdflatex", "gs")

DOCUMENT = r"""
\documentclass[12pt]{article}
\usepackage[landscape]{geometry}
\usepackage{geometry}
\geometry{a<PaperSize>paper,scale=0.98}
\pagestyle{empty}
\usepackage{booktabs}
\usepackage{amsmath}
\usepackage{upgreek}
\usepackage{amssymb}
\usepackage{xcolor}
\begin{document}
\makeatletter
\renewcommand*{\@textcolor}[3]{%
  \protect\leavevmode
  \begingroup
    \color#1{#2}#3%
  \endgroup
}
\makeatother
\begin{displaymath}
<Formula>
\end{displaymath}
\end{document}
"""


class ToolchainMissing(RuntimeError):
    """pdflatex or Ghostscript is not installed (``./run setup --cdm`` installs them)."""


def toolchain_present() -> bool:
    return all(shutil.which(tool) for tool in TOOLS)


def token_colours(count: int) -> list[tuple[int, int, int]]:
    """The first ``count`` token colours: (R, G, B) counting up in steps of 15, black skipped."""
    levels = 255 // COLOUR_GAP + 1
    colours = []
    for index in range(1, min(count, levels**3 - 1) + 1):
        red, rest = divmod(index, levels**2)
        green, blue = divmod(rest, levels)
        colours.append((red * COLOUR_GAP, green * COLOUR_GAP, blue * COLOUR_GAP))
    return colours


@dataclass
class Rendering:
    """One formula drawn: its tokens in colour order, each token's box (None where it drew
    nothing visible), and the cropped image's size."""

    tokens: list[str]
    boxes: list[list[int] | None]
    size: tuple[int, int]

    def drawn(self) -> list[tuple[str, list[int]]]:
        """The tokens that drew something, with their boxes (the ones CDM matches)."""
        return [(token, box) for token, box in zip(self.tokens, self.boxes, strict=True) if box]


def document(latex: str) -> tuple[str, list[str]]:
    """The LaTeX document drawing ``latex`` token by token in colours, and its tokens.
    Raises :class:`FormulaError` where the official preparation fails."""
    latex = latex.replace("\n", " ")
    coloured, tokens = colour_tokens(normalize(tokenize(latex)))
    for index, (red, green, blue) in enumerate(token_colours(len(coloured.split(" ")))):
        coloured = coloured.replace(f"<color_{index}>", f"{red},{green},{blue}")
    paper = 3 if len(tokens) > 1300 else 4 if len(tokens) > 600 else 5
    return DOCUMENT.replace("<PaperSize>", str(paper)).replace("<Formula>", coloured), tokens


def render(latex: str, cache_dir: Path | None = None) -> Rendering | None:
    """The formula drawn and its token boxes; None where it cannot be (does not prepare, does
    not compile, or spills onto a second page)."""
    if not toolchain_present():
        raise ToolchainMissing("CDM needs pdflatex and Ghostscript: run ./run setup --cdm")
    try:
        source, tokens = document(latex)
    except (FormulaError, IndexError):
        return None
    key = hashlib.sha256(source.encode()).hexdigest()
    cached = cache_dir / f"{key}.json" if cache_dir else None
    if cached is not None and cached.exists():
        stored = json.loads(cached.read_text())
        return Rendering(stored["tokens"], stored["boxes"], tuple(stored["size"])) if stored else None
    rendering = _draw(source, tokens)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        payload = {"tokens": rendering.tokens, "boxes": rendering.boxes, "size": rendering.size} if rendering else {}
        temporary = cached.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # writers never share one
        temporary.write_text(json.dumps(payload))
        temporary.replace(cached)
    return rendering


def _draw(source: str, tokens: list[str]) -> Rendering | None:
    with tempfile.TemporaryDirectory(prefix="cdm-") as work:
        folder = Path(work)
        (folder / "formula.tex").write_text(source)
        try:
            subprocess.run(["pdflatex", "-interaction=nonstopmode", "formula.tex"], cwd=folder,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=COMPILE_SECONDS, check=False)
        except subprocess.TimeoutExpired:
            return None
        if not (folder / "formula.pdf").exists():
            return None
        try:
            subprocess.run(["gs", "-q", "-dSAFER", "-dBATCH", "-dNOPAUSE", "-dNOPROMPT", "-dMaxBitmap=500000000",
                            "-dAlignToPixels=0", "-dGridFitTT=2", "-sDEVICE=pngalpha", "-dTextAlphaBits=4",
                            "-dGraphicsAlphaBits=4", f"-r{DPI}x{DPI}", "-sOutputFile=page-%d.png", "formula.pdf"],
                           cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=COMPILE_SECONDS,
                           check=True)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            return None  # a PDF Ghostscript cannot rasterise draws nothing, as in the official pipeline
        pages = sorted(folder.glob("page-*.png"))
        if len(pages) != 1:  # the official pipeline finds no single page image then
            return None
        with Image.open(pages[0]) as page:
            image = crop_to_ink(page.convert("RGB"))
    return Rendering(tokens, token_boxes(image, len(tokens)), image.size)


def crop_to_ink(image: Image.Image) -> Image.Image:
    """The page cropped to its non-white pixels plus ``CROP_PAD`` around (a blank page: its corner)."""
    gray = np.asarray(image.convert("L"))
    rows, columns = np.nonzero(gray != 255)
    if len(rows) == 0:
        top, bottom, left, right = 0, 10, 0, 10
    else:
        top, bottom, left, right = rows.min(), rows.max(), columns.min(), columns.max()
    return image.crop((left - CROP_PAD, top - CROP_PAD, right + CROP_PAD, bottom + CROP_PAD))


def token_boxes(image: Image.Image, count: int) -> list[list[int] | None]:
    """Each token's box [x0, y0, x1, y1] from the pixels of exactly its colour, one pixel around."""
    pixels = np.asarray(image.convert("RGB"))
    packed = (pixels[..., 0].astype(np.int32) << 16) | (pixels[..., 1].astype(np.int32) << 8) | pixels[..., 2]
    boxes: list[list[int] | None] = []
    for red, green, blue in token_colours(count):
        ys, xs = np.nonzero(packed == (red << 16 | green << 8 | blue))
        boxes.append([int(xs.min()) - 1, int(ys.min()) - 1, int(xs.max()) + 1, int(ys.max()) + 1] if len(xs) else None)
    return boxes
