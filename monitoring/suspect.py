"""Which served pages deserve an annotator's look, whatever the model's confidence.

A model can be sure of a wrong answer: an empty page at mean confidence 0.93, a page cut off at
the token limit, or a decoding loop repeating one phrase all read as "confident". Monitoring sends
these back to Label Studio beside the low-confidence ones, each with the reasons it was chosen.
"""

from __future__ import annotations

import re

EMPTY = "empty output"
TRUNCATED = "truncated"
REPETITIVE = "repetitive"
LOW_CONFIDENCE = "low confidence"

_MIN_REPEATS = 4  # a unit seen this many times in a row at the end of the output is a loop
_MIN_LOOP_CHARS = 24
_WORD = re.compile(r"\S+")


def is_repetitive(text: str) -> bool:
    """True when the output ends in a loop: one unit (a word group or a run of characters)
    repeated at least four times in a row, or when three-word groups mostly repeat."""
    stripped = text.strip()
    if len(stripped) < _MIN_LOOP_CHARS:
        return False
    tail = stripped[-2000:]
    for period in range(1, min(200, len(tail) // _MIN_REPEATS) + 1):
        span = period * _MIN_REPEATS
        if span < _MIN_LOOP_CHARS:
            continue
        segment = tail[-span:]
        if segment == segment[:period] * _MIN_REPEATS:
            return True
    words = _WORD.findall(stripped)
    if len(words) >= 24:
        trigrams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
        if len(set(trigrams)) / len(trigrams) < 0.35:
            return True
    return False


def review_reasons(text: str, *, truncated: bool, mean_confidence: float, low_confidence: float | None = None) -> list[str]:
    """Why a served page should go back to annotators (empty list: it need not)."""
    reasons = []
    if not text.strip():
        reasons.append(EMPTY)
    if truncated:
        reasons.append(TRUNCATED)
    if is_repetitive(text):
        reasons.append(REPETITIVE)
    if low_confidence is not None and mean_confidence < low_confidence:
        reasons.append(LOW_CONFIDENCE)
    return reasons
