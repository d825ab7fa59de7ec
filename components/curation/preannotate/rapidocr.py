"""The embedded default backend: RapidOCR (PP-OCR ONNX weights inside the wheel), with the line
layout heuristics that turn OCR lines into paragraphs, titles, tables and formulas."""

from __future__ import annotations

import html
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from components.curation.preannotate.base import PreAnnotation, strip_image_tokens
from components.data.markup import MarkupBlock, render_markup
from components.data.pages import LayoutElement, validate_image


@dataclass
class _OcrLine:
    text: str
    score: float
    x0: float
    y0: float
    x1: float
    y1: float
    parts: list[_OcrLine] = field(default_factory=list)  # the recognized boxes a visual line is made of

    @property
    def height(self) -> float:
        return self.y1 - self.y0

    @property
    def center_y(self) -> float:
        return (self.y0 + self.y1) / 2


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


def _looks_like_math(text: str) -> bool:
    words = [w for w in re.findall(r"[A-Za-z]+", text) if len(w) >= 3]
    return any(c in _MATH_CHARS for c in text) and len(words) <= 1


@dataclass
class RapidOCRConfig:
    text_score: float = 0.5  # recognitions below this score are dropped by RapidOCR
    threads: int | None = None  # onnxruntime intra-op threads; None = all cores
    # The 180° line classifier flips some upright full-width lines into garbage; pages are upright.
    use_angle_classifier: bool = False
    paragraph_gap: float = 0.25  # a vertical gap above this × body line height starts a paragraph
    title_ratio: float = 1.45  # a line this much taller than body text is a title (boxes of body lines vary ±25%)...
    title_char_ratio: float = 1.35  # ...and so is one this much wider per character (bold or larger face)
    detect_tables: bool = True  # aligned multi-box lines become an HTML table
    detect_formulas: bool = True  # lines of math symbols become $$ LaTeX $$ (best effort)
    drop_page_furniture: bool = True  # drop small lines in the top/bottom margin (headers, page numbers)
    margin_fraction: float = 0.1  # what counts as the top/bottom margin, as a fraction of page height
    model_version: str | None = None


class RapidOCRAnnotator:
    """Offline OCR pre-annotation of single-column pages: paragraphs, titles, grid tables (as HTML,
    from rows of aligned boxes) and formulas (best-effort LaTeX from the recognized symbols)."""

    name = "rapidocr"

    def __init__(self, config: RapidOCRConfig | None = None):
        self.config = config or RapidOCRConfig()
        self._engine = None

    @property
    def model_version(self) -> str:
        if self.config.model_version:
            return self.config.model_version
        from importlib.metadata import version

        return f"rapidocr-{version('rapidocr')}-ppocr"

    def _ocr(self):
        if self._engine is None:
            from rapidocr import RapidOCR

            params: dict[str, Any] = {"Global.log_level": "error", "Global.text_score": self.config.text_score,
                                      "Global.use_cls": self.config.use_angle_classifier}
            if self.config.threads:
                params["EngineConfig.onnxruntime.intra_op_num_threads"] = int(self.config.threads)
            self._engine = RapidOCR(params=params)
        return self._engine

    def recognize_lines(self, image: Image.Image) -> list[_OcrLine]:
        """Recognized text boxes merged into visual lines, top to bottom, left to right."""
        validate_image(image)
        result = self._ocr()(image.convert("RGB"))
        if result.boxes is None or not result.txts:
            return []
        boxes = []
        for box, text, score in zip(result.boxes, result.txts, result.scores, strict=True):
            xs, ys = [float(p[0]) for p in box], [float(p[1]) for p in box]
            if text.strip():
                boxes.append(_OcrLine(text.strip(), float(score), min(xs), min(ys), max(xs), max(ys)))
        boxes.sort(key=lambda b: (b.center_y, b.x0))
        lines: list[list[_OcrLine]] = []
        for box in boxes:
            if lines:
                current = lines[-1]
                top, bottom = min(b.y0 for b in current), max(b.y1 for b in current)
                overlap = min(bottom, box.y1) - max(top, box.y0)
                if overlap >= 0.5 * min(box.height, bottom - top):
                    current.append(box)
                    continue
            lines.append([box])
        merged = []
        for parts in lines:
            parts.sort(key=lambda b: b.x0)
            chars = [max(1, len(p.text)) for p in parts]
            score = sum(p.score * n for p, n in zip(parts, chars, strict=True)) / sum(chars)
            merged.append(_OcrLine(" ".join(p.text for p in parts), score, min(p.x0 for p in parts),
                                   min(p.y0 for p in parts), max(p.x1 for p in parts), max(p.y1 for p in parts), parts))
        return merged

    @staticmethod
    def _char_width(line: _OcrLine) -> float:
        return (line.x1 - line.x0) / max(1, len(line.text))

    def layout(self, lines: list[_OcrLine], page_height: int) -> list[tuple[str, list[_OcrLine]]]:
        """Group lines into (category, lines) blocks in reading order (single column).

        Body text metrics (line height, width per character) are medians over wordy lines. A
        line is a title when it is clearly taller, or set in a clearly wider (bold/larger) face;
        a small or isolated short line in the top/bottom margin is page furniture.
        """
        if not lines:
            return []
        cfg = self.config
        # Body metrics from plain prose lines: table rows (several boxes) and formulas would skew them.
        wordy = [line for line in lines if len(line.text) >= 8 and len(line.parts) <= 1 and not _looks_like_math(line.text)]
        wordy = wordy or lines
        body_height = statistics.median(line.height for line in wordy)
        body_char = statistics.median(self._char_width(line) for line in wordy)
        if cfg.drop_page_furniture:
            margin = cfg.margin_fraction * page_height
            kept = []
            for i, line in enumerate(lines):
                in_margin = line.y1 <= margin or line.y0 >= page_height - margin
                neighbours = [lines[j] for j in (i - 1, i + 1) if 0 <= j < len(lines)]
                gap = min((max(n.y0 - line.y1, line.y0 - n.y1) for n in neighbours), default=0.0)
                char_ratio = self._char_width(line) / body_char if body_char else 1.0
                small = line.height < 0.8 * body_height or (line.height < 0.92 * body_height and char_ratio < 0.85)
                isolated = gap > 2.0 * body_height and len(line.text.split()) <= 6
                if not (in_margin and (small or isolated)):
                    kept.append(line)
            lines = kept
        table_rows = self._table_rows(lines, body_height) if cfg.detect_tables else {}
        math_rows = self._formula_rows(lines, body_height, table_rows) if cfg.detect_formulas else {}
        blocks: list[tuple[str, list[_OcrLine]]] = []
        for index, line in enumerate(lines):
            if index in math_rows:
                if blocks and blocks[-1][0] == "formula" and index - 1 in math_rows:
                    blocks[-1][1].append(line)
                else:
                    blocks.append(("formula", [line]))
                continue
            if index in table_rows:
                if table_rows[index]:  # the first row of a table opens a new block
                    blocks.append(("table", [line]))
                else:
                    blocks[-1][1].append(line)
                continue
            taller = line.height >= cfg.title_ratio * body_height
            wider = self._char_width(line) >= cfg.title_char_ratio * body_char and line.height >= 0.9 * body_height
            category = "title" if taller or wider else "text"
            if blocks:
                last_category, last_lines = blocks[-1]
                gap = line.y0 - last_lines[-1].y1
                if category == last_category and gap <= cfg.paragraph_gap * body_height:
                    last_lines.append(line)
                    continue
            blocks.append((category, [line]))
        return blocks

    @staticmethod
    def _table_rows(lines: list[_OcrLine], body_height: float) -> dict[int, bool]:
        """Line index -> starts-a-table, for runs of >= 2 adjacent lines made of the same number
        (>= 2) of separately detected boxes whose columns line up (overlap horizontally)."""

        def same_columns(a: _OcrLine, b: _OcrLine) -> bool:
            return len(a.parts) == len(b.parts) and all(
                min(p.x1, q.x1) > max(p.x0, q.x0) for p, q in zip(a.parts, b.parts, strict=True)
            )

        rows: dict[int, bool] = {}
        i = 0
        while i < len(lines):
            if len(lines[i].parts) < 2:
                i += 1
                continue
            j = i + 1
            while (j < len(lines) and same_columns(lines[i], lines[j])
                   and lines[j].y0 - lines[j - 1].y1 <= body_height):
                j += 1
            if j - i >= 2:
                rows.update({k: k == i for k in range(i, j)})
                i = j
            else:
                i += 1
        return rows

    @staticmethod
    def _formula_rows(lines: list[_OcrLine], body_height: float, taken: dict[int, bool]) -> dict[int, bool]:
        """Line index -> is-the-formula-body, for math lines and the short limit lines (``i=1``,
        ``k``) touching them, which belong to a big operator."""
        rows = {i: True for i, line in enumerate(lines) if i not in taken and _looks_like_math(line.text)}
        for i in list(rows):
            for j in (i - 1, i + 1, i - 2, i + 2):
                if 0 <= j < len(lines) and j not in rows and j not in taken:
                    line, near = lines[j], lines[i if abs(j - i) == 1 else (i + j) // 2]
                    short = all(len(p.text) <= 4 and not re.search(r"[A-Za-z]{3}", p.text) for p in line.parts or [line])
                    touching = max(line.y0 - near.y1, near.y0 - line.y1) <= 0.35 * body_height
                    if short and touching and (abs(j - i) == 1 or (i + j) // 2 in rows):
                        rows[j] = False
        return rows

    @staticmethod
    def _formula_latex(lines: list[_OcrLine]) -> str:
        return " ".join(unicode_math_to_latex(line.text) for line in lines if _looks_like_math(line.text))

    @staticmethod
    def _table_html(lines: list[_OcrLine]) -> str:
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(p.text, quote=False)}</td>" for p in line.parts) + "</tr>"
                       for line in lines)
        return f"<table>{rows}</table>"

    @staticmethod
    def _join_lines(lines: list[_OcrLine]) -> str:
        text = lines[0].text
        for line in lines[1:]:
            if re.search(r"[A-Za-z]-$", text) and line.text[:1].islower():
                text = text[:-1] + line.text  # re-join a word hyphenated across lines
            else:
                text = f"{text} {line.text}"
        return text

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        started = time.perf_counter()
        lines = self.recognize_lines(image)
        blocks = self.layout(lines, image.height)
        elements = []
        for category, block_lines in blocks:
            if category == "table":
                content = self._table_html(block_lines)
            elif category == "formula":
                content = self._formula_latex(block_lines)
            else:
                content = self._join_lines(block_lines)
            box = (min(x.x0 for x in block_lines), min(x.y0 for x in block_lines),
                   max(x.x1 for x in block_lines), max(x.y1 for x in block_lines))
            elements.append(LayoutElement(category, box, content))
        kept = [line for _, block_lines in blocks for line in block_lines]
        chars = sum(len(line.text) for line in kept)
        confidence = sum(line.score * len(line.text) for line in kept) / chars if chars else 0.0
        markup = render_markup([MarkupBlock(e.category, e.content) for e in elements])
        return PreAnnotation(
            strip_image_tokens(markup), confidence, self.model_version, elements,
            {"lines": len(kept), "seconds": round(time.perf_counter() - started, 4),
             "confidence_source": "recognition_score"},
        )
