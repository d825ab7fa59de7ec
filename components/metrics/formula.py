"""Display-formula edit distance, OmniDocBench v1.5's fallback when CDM cannot run.

OmniDocBench ranks formulas by CDM, which renders LaTeX to images (LaTeX + ImageMagick). Its
code also reports a character edit distance on normalized LaTeX (``normalized_formula`` in
``utils/data_preprocess.py``), which is what we compute: strip surrounding ``$`` and newlines,
keep the inside of ``\\[…\\]``, drop ``\\tag{…}``, ``\\hspace{…}``, every ``\\begin{…}`` /
``\\end{…}``, ``\\arraycolsep…}``, leading/trailing dots, then delete the names of font and
spacing commands (``\\mathrm``, ``\\mathbf``, ``\\operatorname``, ``\\left``, ``\\right``,
``\\quad``, …; their braces stay) and every space, and lowercase. It works on characters, so
``\\alpha`` vs ``\\beta`` costs several edits, exactly as the official number does.
"""

from __future__ import annotations

import re

from components.metrics.text import normalized_edit_distance

# Removed as plain substrings, in this order (order matters: "\\text" before "\\textbf" would
# leave "bf"; the official list has "\\textbf" first and "\\text" twice).
_REMOVED_SUBSTRINGS = (
    "\\mathbf", "\\mathrm", "\\mathnormal", "\\mathit", "\\mathbb", "\\mathcal", "\\mathscr",
    "\\mathfrak", "\\mathsf", "\\mathtt", "\\textbf", "\\text", "\\boldmath", "\\boldsymbol",
    "\\operatorname", "\\bm", "\\symbfit", "\\mathbfcal", "\\symbf", "\\scriptscriptstyle",
    "\\notag", "\\setlength", "\\coloneqq", "\\space", "\\thickspace", "\\thinspace", "\\medspace",
    "\\nobreakspace", "\\negmedspace", "\\quad", "\\qquad", "\\enspace", "\\substackw", " ", "$$",
    "\\left", "\\right", "\\displaystyle", "\\text",
)
_BRACKET_DISPLAY_RE = re.compile(r"\\\[(.+?)(?<!\\)\\\]")
_REMOVED_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (r"\\tag\{.*?\}", r"\\hspace\{.*?\}", r"\\begin\{.*?\}", r"\\end\{.*?\}", r"\\arraycolsep.*?\}")
)


def normalize_formula(latex: str) -> str:
    """LaTeX normalized for the formula edit distance (see the module docstring)."""
    text = latex.strip().strip("$").strip("\n")
    inside = _BRACKET_DISPLAY_RE.search(text)
    if inside:
        text = inside.group(1).strip()
    for pattern in _REMOVED_PATTERNS:
        text = pattern.sub("", text)
    text = text.strip(".")
    for substring in _REMOVED_SUBSTRINGS:
        text = text.replace(substring, "")
    return text.lower()


def formula_edit_distance(pred: str, gt: str) -> float:
    """Normalized character edit distance in [0, 1] between two normalized formulas."""
    return normalized_edit_distance(normalize_formula(pred), normalize_formula(gt))
