"""Code listings among OCR lines: which runs of lines are code, and their fenced text.

Listings are the pages line heuristics get most wrong: a line-numbered listing is two aligned
columns of boxes (so it looked like a table), and ``end;`` is short and bold (so it looked like
a title). A line is code-like when it carries programming syntax (statement ends, assignments,
braces, calls, backslash commands, shell/R prompts, keywords opening a line); a run of lines is
a listing when most of its lines are code-like and it is not prose.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CODE_PATTERNS = [re.compile(p) for p in (
    r";\s*$",                      # statement end
    r":=|<-|->|==|!=|&&|\|\||\+\+|\+=",
    r"[{}]",
    r"^\s*\\[A-Za-z@]+",           # a TeX command opening the line
    r"^\s*(?:for|if|while|begin|end|else|return|def|function|int|void|var|do|then|print|import|from)\b",
    r"\b\w+\([^()]*\)\s*[;{:]?\s*$",  # a call or signature ending the line
    r"^\s*[>$%#]\s+\S",            # an interpreter or shell prompt
    r"^\s*\d+\s+\S.*[;:=(){}]",    # a numbered line with syntax
    r"\w\[[^\]]*\]",               # indexing
    r"\b\w+\s*=\s*[\w\"'(\[\\-]",  # assignment
    r"\\\\\s*$|&",                # a TeX row end or alignment tab
    r"\w\s*=\s*[,}\\]|[,{]\s*%",     # a key=value list, a TeX comment after code
)]
_PROSE_WORD = re.compile(r"^[(\"'“‘]?[A-Za-z][a-z]*[,.;:!?)\"'”’]*$")


def code_signals(text: str) -> int:
    """How many kinds of programming syntax the line shows."""
    return sum(bool(p.search(text)) for p in _CODE_PATTERNS)


def prose_fraction(text: str) -> float:
    """Share of the line's tokens that are ordinary words (prose is mostly words)."""
    tokens = text.split()
    return sum(bool(_PROSE_WORD.match(t)) for t in tokens) / len(tokens) if tokens else 0.0


def looks_like_code(text: str) -> bool:
    signals = code_signals(text)
    return signals >= 2 or (signals == 1 and prose_fraction(text) < 0.6)


def is_listing(texts: Sequence[str]) -> bool:
    """Whether these consecutive lines read as one code listing: mostly code-like lines, few prose
    lines (not code-like, four words or more); a single line needs two kinds of syntax."""
    if not texts:
        return False
    if len(texts) == 1:
        return code_signals(texts[0]) >= 2 and prose_fraction(texts[0]) < 0.5
    code = sum(looks_like_code(t) for t in texts)
    prose = sum(not looks_like_code(t) and len(t.split()) >= 4 for t in texts)
    return code >= 0.5 * len(texts) and prose <= 0.25 * len(texts)


def listing_runs(texts: Sequence[str], max_prose_gap: int = 1) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges of the listings among consecutive ``texts`` (end exclusive).

    A run grows over code-like lines and absorbs up to ``max_prose_gap`` plain lines between
    them (``begin``, a lone identifier); it is kept when :func:`is_listing` accepts it.
    """
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(texts):
        if not looks_like_code(texts[i]):
            i += 1
            continue
        end, gap = i + 1, 0
        j = i + 1
        while j < len(texts) and gap <= max_prose_gap:
            if looks_like_code(texts[j]):
                end, gap = j + 1, 0
            elif len(texts[j].split()) <= 3:
                gap += 1
            else:
                break
            j += 1
        if is_listing(texts[i:end]):
            runs.append((i, end))
        i = end
    return runs


def fenced_text(lines: Sequence[tuple[str, float]], char_width: float) -> str:
    """The listing's text with its indentation (``lines``: text and left x), for a code fence."""
    left = min(x for _, x in lines)
    return "\n".join(" " * max(0, round((x - left) / max(char_width, 1e-6))) + text for text, x in lines)
