"""Text edit distance as OmniDocBench v1.5 scores it.

Before comparing, a text block is normalized the way the official end-to-end evaluation does
(``textblock2unicode`` then ``clean_string`` in ``utils/data_preprocess.py``): inline math
``$…$`` / ``\\(…\\)`` that holds a ``\\``, ``^`` or ``_`` is rendered to Unicode with pylatexenc,
then every character that is not a word character (letters, digits, ``_``, CJK) is dropped —
spaces and punctuation included. The distance is then Levenshtein over characters divided by
the longer length.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence

from pylatexenc.latex2text import LatexNodes2Text
from rapidfuzz.distance import Levenshtein

# Same pattern as the official one: single-line, lazy, either $…$ or \(…\).
_INLINE_MATH_RE = re.compile(r"\$(.*?)\$|\\\((.*?)\\\)")
_ESCAPED_SPECIAL_RE = re.compile(r"\\([\\_&%^])")
_NOT_WORD_RE = re.compile(r"[^\w\u4e00-\u9fff]")
_LITERAL_BREAKS = ("\\t", "\\n", "\t", "\n", "/t", "/n")

_LATEX_TO_TEXT = LatexNodes2Text()


def latex_to_unicode(latex: str) -> str:
    """Render LaTeX to plain Unicode text (``\\alpha^2`` -> ``α^2``) with pylatexenc."""
    return _LATEX_TO_TEXT.latex_to_text(latex)


def inline_math_to_unicode(text: str) -> str:
    """Replace each inline formula that needs rendering (has ``\\``, ``^`` or ``_``) by its Unicode text.

    Escaped specials (``\\_``, ``\\%``, ...) are dropped before the check, and a formula that
    pylatexenc cannot read is left as it was.
    """
    replacements: list[tuple[int, int, str]] = []
    for match in _INLINE_MATH_RE.finditer(text):
        content = match.group(1) if match.group(1) is not None else match.group(2)
        content = _ESCAPED_SPECIAL_RE.sub("", content)
        if not any(char in content for char in "\\^_"):
            continue
        if content.endswith("\\"):
            content += " "
        try:
            rendered = latex_to_unicode(content)
        except Exception:  # pylatexenc raises many types on malformed input; keep the raw text then
            continue
        replacements.append((match.start(), match.end(), rendered.strip()))
    for start, end, rendered in reversed(replacements):
        text = text[:start] + rendered + text[end:]
    return text


def clean_text(text: str) -> str:
    """Keep only word characters (and CJK); drop spaces, punctuation and literal ``\\t``/``\\n`` escapes."""
    for literal in _LITERAL_BREAKS:
        text = text.replace(literal, "")
    return _NOT_WORD_RE.sub("", text)


def normalize_text(text: str) -> str:
    """The official text normalization: inline math to Unicode, then ``clean_text``."""
    return clean_text(inline_math_to_unicode(text))


def edit_distance(pred: str | Sequence[Hashable], gt: str | Sequence[Hashable]) -> int:
    """Plain Levenshtein distance over characters (strings) or items (lists)."""
    return Levenshtein.distance(pred, gt)


def normalized_edit_distance(pred: str | Sequence[Hashable], gt: str | Sequence[Hashable]) -> float:
    """Levenshtein distance / max(len(pred), len(gt)), in [0, 1]; two empty inputs are identical (0.0)."""
    longest = max(len(pred), len(gt))
    if longest == 0:
        return 0.0
    return Levenshtein.distance(pred, gt) / longest
