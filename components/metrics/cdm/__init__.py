"""CDM (Character Detection Matching), OmniDocBench's formula metric, as the official code computes it.

"Image Over Text: Transforming Formula Recognition Evaluation with Character Detection Matching"
(official code: UniMERNet ``cdm/``, which OmniDocBench calls for its formula term). Both formulas
are rendered with one colour per token (:mod:`.latex`, :mod:`.rendering`), every token's box is read
back from its colour, and the boxes are matched by identity, position and order, then checked
for one consistent shift-and-scale (:mod:`.matching`). The score is the F1 of matched tokens, so
LaTeX spelled differently that renders the same scores 1.

It needs ``pdflatex`` and Ghostscript (``./run setup --cdm``); :func:`cdm_available` says whether
they are here, and callers fall back to the edit distance where they are not.

- a prediction that does not prepare, compile or render scores 0;
- a ground truth that does not render gives ``None``: the official code leaves such pairs out.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from components.metrics.cdm.matching import f1
from components.metrics.cdm.rendering import Rendering, ToolchainMissing, render, toolchain_present
from components.services.process import VAR_DIR

__all__ = ["ToolchainMissing", "cdm_available", "cdm_score", "cdm_scores"]

DEFAULT_CACHE = VAR_DIR / "cdm-cache"


def cdm_available() -> bool:
    """Whether pdflatex and Ghostscript are installed (CDM can be computed here)."""
    return toolchain_present()


def _score(gt: Rendering | None, pred: Rendering | None) -> float | None:
    if gt is None or not gt.drawn():
        return None
    if pred is None:
        return 0.0
    return f1(gt.drawn(), pred.drawn(), gt.size, pred.size)


def cdm_score(gt_latex: str, pred_latex: str, cache_dir: Path | None = DEFAULT_CACHE) -> float | None:
    """CDM F1 of one formula pair in [0, 1]; None when the ground truth cannot be rendered."""
    return _score(render(gt_latex, cache_dir), render(pred_latex, cache_dir))


def cdm_scores(pairs: list[tuple[str, str]], cache_dir: Path | None = DEFAULT_CACHE,
               workers: int | None = None) -> list[float | None]:
    """:func:`cdm_score` of many pairs, every distinct formula rendered once, in parallel (each
    rendering is two subprocesses, so threads suffice)."""
    if not toolchain_present():
        raise ToolchainMissing("CDM needs pdflatex and Ghostscript: run ./run setup --cdm")
    formulas = sorted({latex for pair in pairs for latex in pair})
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        rendered = dict(zip(formulas, pool.map(lambda latex: render(latex, cache_dir), formulas), strict=True))
    return [_score(rendered[gt], rendered[pred]) for gt, pred in pairs]
