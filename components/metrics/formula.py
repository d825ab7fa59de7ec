"""Formula edit distance: normalized Levenshtein distance over LaTeX tokens.

OmniDocBench v1.5 scores display formulas with CDM, which renders LaTeX to images and needs
LaTeX, node and ImageMagick; the usual cheap stand-in is an edit distance on normalized LaTeX.
We compare tokens rather than characters so ``\\alpha`` vs ``\\beta`` is one error, not five.

Normalization removes what changes the source but not the rendered formula: math delimiters
(``$``, ``$$``, ``\\[ \\]``, ``\\( \\)``, equation environments), ``\\left``/``\\right``/``\\big``
sizing, style switches (``\\displaystyle``), spacing commands, whitespace, and braces around a
single-token sub/superscript (``x^{2}`` = ``x^2``).
"""

from __future__ import annotations

import re

from components.metrics.text import normalized_edit_distance

_TOKEN_RE = re.compile(r"\\[a-zA-Z]+|\\.|\S", re.DOTALL)
_MATH_ENVIRONMENT_RE = re.compile(r"\\(begin|end)\{(equation|displaymath|math)\*?\}")
_DROPPED_COMMANDS = frozenset(
    {
        r"\left", r"\right", r"\middle",
        r"\big", r"\Big", r"\bigg", r"\Bigg",
        r"\bigl", r"\bigr", r"\Bigl", r"\Bigr", r"\biggl", r"\biggr", r"\Biggl", r"\Biggr",
        r"\displaystyle", r"\textstyle", r"\scriptstyle", r"\scriptscriptstyle",
        r"\,", r"\;", r"\:", r"\!", r"\ ", r"\quad", r"\qquad", "~",
        r"\nonumber", r"\notag",
        "$", r"\[", r"\]", r"\(", r"\)",  # math delimiters; an escaped dollar is the token \$
    }
)


def tokenize_latex(latex: str) -> list[str]:
    """Split LaTeX into tokens: ``\\command``, escaped symbols, single characters."""
    return _TOKEN_RE.findall(latex)


def normalize_latex_tokens(latex: str) -> list[str]:
    """Tokens of a formula after removing delimiters, sizing, style and spacing that do not change it."""
    stripped = _MATH_ENVIRONMENT_RE.sub(" ", latex)
    tokens = [token for token in tokenize_latex(stripped) if token not in _DROPPED_COMMANDS]
    return _unbrace_single_scripts(tokens)


def normalize_latex(latex: str) -> str:
    """Normalized LaTeX as one string with single spaces between tokens (for display and hashing)."""
    return " ".join(normalize_latex_tokens(latex))


def _unbrace_single_scripts(tokens: list[str]) -> list[str]:
    """``^ { x }`` -> ``^ x`` when the group holds exactly one token."""
    result: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if (
            token in ("^", "_")
            and i + 3 < len(tokens)
            and tokens[i + 1] == "{"
            and tokens[i + 3] == "}"
            and tokens[i + 2] not in ("{", "}")
        ):
            result.extend((token, tokens[i + 2]))
            i += 4
            continue
        result.append(token)
        i += 1
    return result


def formula_edit_distance(pred: str, gt: str) -> float:
    """Normalized token edit distance in [0, 1] between two formulas (0 = same after normalization)."""
    return normalized_edit_distance(normalize_latex_tokens(pred), normalize_latex_tokens(gt))
