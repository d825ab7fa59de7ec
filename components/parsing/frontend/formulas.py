"""Formulas among OCR lines: which lines are math, and a best-effort LaTeX for them.

A recogniser reads a display as Unicode (``α³ = √π``); OmniDocBench scores formulas as LaTeX, so
Greek letters, operators, super- and subscripts are mapped to their commands. An equation number
at a display's right ("(2)") is not part of the formula.
"""

from __future__ import annotations

import re

_GREEK_LATEX = {
    "α": r"\alpha", "β": r"\beta", "γ": r"\gamma", "δ": r"\delta", "ε": r"\epsilon", "ζ": r"\zeta", "η": r"\eta",
    "θ": r"\theta", "ι": r"\iota", "κ": r"\kappa", "λ": r"\lambda", "μ": r"\mu", "µ": r"\mu", "ν": r"\nu", "ξ": r"\xi",
    "π": r"\pi", "ρ": r"\rho", "σ": r"\sigma", "τ": r"\tau", "φ": r"\phi", "χ": r"\chi", "ψ": r"\psi", "ω": r"\omega",
    "Γ": r"\Gamma", "Δ": r"\Delta", "Θ": r"\Theta", "Λ": r"\Lambda", "Π": r"\Pi", "Σ": r"\Sigma", "Φ": r"\Phi",
    "Ψ": r"\Psi", "Ω": r"\Omega",
}
_SYMBOL_LATEX = {
    "∑": r"\sum", "∏": r"\prod", "∫": r"\int", "∞": r"\infty", "≤": r"\leq", "≥": r"\geq", "≠": r"\neq",
    "≈": r"\approx", "±": r"\pm", "×": r"\times", "÷": r"\div", "∂": r"\partial", "∇": r"\nabla", "·": r"\cdot",
    "−": "-", "∈": r"\in", "→": r"\to",
}
_SUPERSCRIPTS = dict(zip("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻ⁿ", "0123456789+-n", strict=True))
_SUBSCRIPTS = dict(zip("₀₁₂₃₄₅₆₇₈₉₊₋", "0123456789+-", strict=True))
_MATH_CHARS = set(_GREEK_LATEX) | set(_SYMBOL_LATEX) - {"−", "·", "→"} | {"√"} | set(_SUPERSCRIPTS) | set(_SUBSCRIPTS)


def unicode_math_to_latex(text: str) -> str:
    """Best-effort LaTeX for an OCR'd formula line (``α³ = √π`` -> ``\\alpha^{3} = \\sqrt{\\pi}``)."""
    out: list[str] = []
    chars = list(text)
    i = 0
    while i < len(chars):
        char = chars[i]
        if char in _SUPERSCRIPTS or char in _SUBSCRIPTS:
            table, marker = (_SUPERSCRIPTS, "^") if char in _SUPERSCRIPTS else (_SUBSCRIPTS, "_")
            run = ""
            while i < len(chars) and chars[i] in table:
                run += table[chars[i]]
                i += 1
            out.append(f"{marker}{{{run}}}")
            continue
        if char == "√":
            i += 1
            if i < len(chars) and chars[i] in _GREEK_LATEX:
                out.append(rf"\sqrt{{{_GREEK_LATEX[chars[i]]}}}")
                i += 1
            elif i < len(chars) and chars[i].isalnum():
                out.append(rf"\sqrt{{{chars[i]}}}")
                i += 1
            else:
                out.append(r"\sqrt")
            continue
        latex = _GREEK_LATEX.get(char) or _SYMBOL_LATEX.get(char)
        if latex is not None:
            out.append(latex + (" " if latex.startswith("\\") and i + 1 < len(chars) and chars[i + 1].isalpha() else ""))
        else:
            out.append(char)
        i += 1
    return "".join(out)


EQUATION_NUMBER = re.compile(r"\s*\(\d+(?:\.\d+)*[a-z]?\)\s*$")  # "(2)", "(3.1a)" at a display's right


def looks_like_math(text: str) -> bool:
    words = [w for w in re.findall(r"[A-Za-z]+", text) if len(w) >= 3]
    return any(c in _MATH_CHARS for c in text) and len(words) <= 1


def formula_latex(texts: list[str], only_math: bool = True) -> str:
    """A formula block's lines as one LaTeX string, equation numbers removed; ``only_math``: its
    math lines only (a block found by its symbols), else every line (a layout model's formula region)."""
    return " ".join(unicode_math_to_latex(EQUATION_NUMBER.sub("", text)).strip()
                    for text in texts if not only_math or looks_like_math(text)).strip()
