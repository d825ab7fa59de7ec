"""Text edit distance as OmniDocBench scores it: Levenshtein distance divided by the longer length.

Normalization is a separate step so that callers (page scorer, consistency mining, reports) all
strip the same markdown syntax before comparing; otherwise ``**word**`` against ``word`` would be
charged four edits for a difference no reader sees.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence

from rapidfuzz.distance import Levenshtein

_HEADING_RE = re.compile(r"^\s{0,3}#{1,6}\s*", re.MULTILINE)
# Paired delimiters only, so a lone ``*`` (multiplication, footnote mark) or ``snake_case`` survives.
_STRONG_RE = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1", re.DOTALL)
_EMPHASIS_STAR_RE = re.compile(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])", re.DOTALL)
_EMPHASIS_UNDERSCORE_RE = re.compile(r"(?<![\w_])_(?=[^\s_])(.+?)(?<=[^\s_])_(?![\w_])", re.DOTALL)
_STRIKE_RE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~", re.DOTALL)
_WHITESPACE_RE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Strip markdown heading markers and emphasis, then collapse whitespace to single spaces.

    Only presentation syntax is removed; words, digits and punctuation are kept, so the
    distance still measures recognition errors.
    """
    text = _HEADING_RE.sub("", text)
    text = _STRONG_RE.sub(r"\2", text)
    text = _STRIKE_RE.sub(r"\1", text)
    text = _EMPHASIS_STAR_RE.sub(r"\1", text)
    text = _EMPHASIS_UNDERSCORE_RE.sub(r"\1", text)
    return _WHITESPACE_RE.sub(" ", text).strip()


def edit_distance(pred: str | Sequence[Hashable], gt: str | Sequence[Hashable]) -> int:
    """Plain Levenshtein distance over characters (strings) or tokens (lists)."""
    return Levenshtein.distance(pred, gt)


def normalized_edit_distance(pred: str | Sequence[Hashable], gt: str | Sequence[Hashable]) -> float:
    """Levenshtein distance / max(len(pred), len(gt)), in [0, 1]; two empty inputs are identical (0.0).

    Works on strings (characters) and on token lists (formula tokens, block orders).
    """
    longest = max(len(pred), len(gt))
    if longest == 0:
        return 0.0
    return Levenshtein.distance(pred, gt) / longest
