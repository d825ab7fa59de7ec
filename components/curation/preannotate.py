"""Pre-annotation: a first markup for every page, with a per-page confidence, before people look.

Backends (all return :class:`PreAnnotation`; pick one with :func:`make_preannotator`):

- ``rapidocr`` (:class:`RapidOCRAnnotator`), the embedded default: PP-OCR detection +
  recognition ONNX models that ship inside the ``rapidocr`` wheel, so it runs offline. Lines
  are grouped into paragraphs by vertical gaps; a clearly taller or wider-set line becomes a
  title; runs of lines made of aligned separate boxes become an HTML table; lines of math
  symbols become a ``$$`` formula; small lines in the top/bottom margin (running headers, page
  numbers) are dropped, as our markup keeps them layout-only. Confidence = recognition score
  weighted by text length.
- ``model`` (:class:`ModelAnnotator`): our own checkpoint through the shared decoding engine;
  confidence = mean token probability of the decode.
- ``paddleocr_vl_server`` (:class:`PaddleOCRVLServerAnnotator`): a PaddleOCR-VL model behind any
  OpenAI-compatible server (vLLM, SGLang, ``paddleocr genai_server``, or our own
  :mod:`components.curation.openai_server`): one ``/v1/chat/completions`` call per page with
  the page as a base64 PNG and the prompt ``OCR:``; confidence from the returned logprobs.
- ``paddleocr_vl_pipeline`` (:class:`PaddleOCRVLPipelineAnnotator`): the official ``paddleocr``
  ``PaddleOCRVL`` pipeline, when that optional package is installed.

Every backend's markup goes through :func:`strip_image_tokens`: as in the dots.ocr / MinerU /
PaddleOCR-VL papers, pictures are not transcribed, so image links, ``<img>`` tags, figure-only
blocks and leaked vision placeholder tokens are removed and nothing else is touched.

:func:`preannotate_dataset` runs a backend over a :class:`PageDataset`, journaling each finished
page (see :mod:`components.curation.storage`), so a crash or a server outage loses no finished
page and a re-run never redoes one.
"""

from __future__ import annotations

import base64
import html
import io
import logging
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

import requests
from PIL import Image

from components.curation.storage import Journal, link_or_copy
from components.data.markup import MarkupBlock, render_markup
from components.data.page_store import PageDataset
from components.data.pages import InvalidPageError, LayoutElement, Page, validate_image
from components.services.process import ServiceError

logger = logging.getLogger(__name__)

JOURNAL_NAME = "preannotations.journal.jsonl"
META_KEY = "preannotation"


# ---------------------------------------------------------------------------------------------
# results and errors


@dataclass
class PreAnnotation:
    """A backend's markup for one page. ``confidence`` in [0, 1]: lower = review sooner."""

    markup: str
    confidence: float
    model_version: str
    elements: list[LayoutElement] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # backend details: tokens, seconds, confidence source

    def __post_init__(self) -> None:
        if not isinstance(self.confidence, int | float) or not math.isfinite(self.confidence):
            raise ValueError(f"confidence must be a finite number, got {self.confidence!r}")
        self.confidence = min(1.0, max(0.0, float(self.confidence)))

    def to_json(self) -> dict:
        record = asdict(self)
        record["elements"] = [asdict(e) for e in self.elements]
        return record

    @classmethod
    def from_json(cls, record: dict) -> PreAnnotation:
        elements = [LayoutElement(e["category"], tuple(e["bbox"]), e.get("content", "")) for e in record.get("elements", [])]
        return cls(record["markup"], record["confidence"], record["model_version"], elements, dict(record.get("extra", {})))


class PageAnnotationError(RuntimeError):
    """This page could not be annotated (the backend refused it); other pages can go on."""


class AnnotatorUnavailableError(ServiceError):
    """The backend itself is down or misconfigured: every page would fail, so the batch stops."""


class BackendNotInstalledError(ImportError):
    """An optional backend whose package is not installed here."""


@runtime_checkable
class PreAnnotator(Protocol):
    """What :func:`preannotate_dataset` needs from a backend."""

    name: str

    @property
    def model_version(self) -> str: ...

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation: ...


# ---------------------------------------------------------------------------------------------
# removal of image-related non-text tokens

_MARKDOWN_IMAGE_RE = re.compile(r"!\[[^\]\n]*\]\((?:[^()\s]|\([^()\s]*\))*(?:\s+(?:\"[^\"\n]*\"|'[^'\n]*'))?\s*\)")
_MARKDOWN_REF_IMAGE_RE = re.compile(r"!\[[^\]\n]*\]\[[^\]\n]*\]")
_HTML_IMAGE_RE = re.compile(r"<img\b[^>]*>|</img\s*>|<svg\b.*?</svg\s*>|<picture\b.*?</picture\s*>", re.IGNORECASE | re.DOTALL)
# Vision placeholders of Qwen2-VL / dots.ocr (<|vision_start|>, <|image_pad|>), ERNIE / PaddleOCR-VL
# (<|IMAGE_START|>, <|IMAGE_PLACEHOLDER|>), InternVL (<IMG_CONTEXT>) and LLaVA-style <image>.
_VISION_TOKEN_RE = re.compile(
    r"<\|(?:vision|image|video|img)(?:_[a-z]+)?\|>|<IMG_CONTEXT>|</?image>", re.IGNORECASE
)
_EMPTY_LINK_RE = re.compile(r"\[\s*\]\([^()\s]*\)")
_EMPTY_WRAPPER_RE = re.compile(r"<(div|figure|center|p|span|a)\b[^>]*>\s*</\1\s*>", re.IGNORECASE)
_FIGURE_RE = re.compile(r"<figure\b[^>]*>(.*?)</figure\s*>", re.IGNORECASE | re.DOTALL)
_FIGCAPTION_TAG_RE = re.compile(r"</?figcaption\b[^>]*>", re.IGNORECASE)
_BLOCK_SEPARATOR_RE = re.compile(r"(\n[ \t]*\n\s*)")
_PICTURE_PATTERNS = (_VISION_TOKEN_RE, _MARKDOWN_IMAGE_RE, _MARKDOWN_REF_IMAGE_RE, _HTML_IMAGE_RE)


def _cut(pattern: re.Pattern, text: str) -> str:
    """Remove every match with the spaces that only separated it: ``a ![x](y) b`` -> ``a b``."""
    out, cursor = [], 0
    for match in pattern.finditer(text):
        start, end = match.start(), match.end()
        left = start
        while left > cursor and text[left - 1] in " \t":
            left -= 1
        if left == 0 or text[left - 1] == "\n":  # at a line start: keep the indent, eat the spaces after
            left = start
            while end < len(text) and text[end] in " \t":
                end += 1
        out.append(text[cursor:left])
        cursor = end
    out.append(text[cursor:])
    return "".join(out)


def _strip_block(block: str) -> str:
    def figure_caption(match: re.Match) -> str:
        inner = match.group(1)
        for pattern in _PICTURE_PATTERNS:
            inner = pattern.sub("", inner)
        return _FIGCAPTION_TAG_RE.sub("", inner).strip()

    text = _FIGURE_RE.sub(figure_caption, block)
    for pattern in _PICTURE_PATTERNS:
        text = _cut(pattern, text)
    if text == block:
        return block
    text = _cut(_EMPTY_LINK_RE, text)
    previous = None
    while previous != text:  # <div><a><img></a></div>: peel the wrappers the removal emptied
        previous, text = text, _cut(_EMPTY_WRAPPER_RE, text)
    # A block holds no blank line (they separate blocks), so lines emptied here go entirely.
    lines = [line for line in text.split("\n") if line.strip()]
    return "\n".join(lines) + ("\n" if lines and block.endswith("\n") else "")


def strip_image_tokens(markup: str) -> str:
    """Remove pictures and vision placeholder tokens; leave every other byte as it was.

    Removed: markdown images ``![alt](src)`` (also inside links), ``<img>``/``<svg>``/``<picture>``,
    ``<figure>`` wrappers (their caption text stays), and placeholder tokens such as
    ``<|image_pad|>``, ``<|vision_start|>``, ``<|IMAGE_PLACEHOLDER|>``. In a block where something
    was removed, wrappers and links left empty go too. A block that held nothing but a picture
    disappears with its blank-line separator; a block where nothing was removed is kept
    byte-identical. Idempotent.
    """
    if not markup:
        return markup
    parts = _BLOCK_SEPARATOR_RE.split(markup)  # block, separator, block, ..., block
    blocks, separators = parts[0::2], parts[1::2]
    out: list[str] = []
    for index, block in enumerate(blocks):
        stripped = _strip_block(block)
        if stripped != block and not stripped.strip():
            continue  # a picture-only block
        if out:
            out.append(separators[index - 1])
        out.append(stripped)
    text = "".join(out)
    if markup.endswith("\n") and text and not text.endswith("\n"):
        text += "\n"  # the dropped last block took the final newline with it
    return text


# ---------------------------------------------------------------------------------------------
# embedded default: RapidOCR (PP-OCR ONNX weights inside the wheel)


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


# ---------------------------------------------------------------------------------------------
# our own model through the shared decoding engine


@dataclass
class ModelAnnotatorConfig:
    model_dir: str | None = None
    decoder: str = "ar"
    max_new_tokens: int = 1024
    device: str = "cpu"
    model_version: str | None = None


class ModelAnnotator:
    """Greedy decode with one of our checkpoints; confidence = mean token probability."""

    name = "model"

    def __init__(self, engine, *, model_version: str = "model", decoder: str = "ar", max_new_tokens: int = 1024):
        from components.decoding.types import DecodeParams

        self.engine = engine  # a DecodingEngine (or anything with its generate())
        self._model_version = model_version
        self.params = DecodeParams(decoder=decoder, max_new_tokens=max_new_tokens)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, *, device: str = "cpu", model_version: str | None = None,
                        decoder: str = "ar", max_new_tokens: int = 1024) -> ModelAnnotator:
        from components.decoding.engine import DecodingEngine
        from models.loading import model_fingerprint

        engine = DecodingEngine.from_pretrained(model_dir, device=device)
        # a content hash, not the folder name: every trained folder is called "model"
        return cls(engine, model_version=model_version or f"model:{model_fingerprint(model_dir)}",
                   decoder=decoder, max_new_tokens=max_new_tokens)

    @property
    def model_version(self) -> str:
        return self._model_version

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        [result] = self.engine.generate([image], self.params)
        stats = result.stats
        return PreAnnotation(
            strip_image_tokens(result.text), stats.mean_confidence, self.model_version, [],
            {"new_tokens": stats.new_tokens, "forward_passes": stats.forward_passes, "seconds": round(stats.seconds, 4),
             "truncated": result.truncated, "decoder": self.params.decoder, "confidence_source": "token_probability"},
        )


# ---------------------------------------------------------------------------------------------
# PaddleOCR-VL behind an OpenAI-compatible server


@dataclass
class PaddleOCRVLServerConfig:
    url: str | None = None  # server root, e.g. http://127.0.0.1:8118 (a trailing /v1 is fine too)
    model: str | None = None  # served model name; None = the first one /v1/models lists
    prompt: str = "OCR:"  # PaddleOCR-VL's task prompt for text recognition
    max_tokens: int = 4096
    timeout_s: float = 120.0
    retries: int = 2  # extra attempts on connection errors, timeouts and 5xx
    backoff_s: float = 1.0
    api_key_env: str | None = None  # name of an environment variable holding a bearer token
    model_version: str | None = None


def image_data_uri(image: Image.Image) -> str:
    """The page as a base64 PNG data URI, the OpenAI chat format's way to inline an image."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class PaddleOCRVLServerAnnotator:
    """One chat completion per page against an OpenAI-compatible server (vLLM, SGLang, ours)."""

    name = "paddleocr_vl_server"
    START_HINT = (
        "start one, e.g. `paddleocr genai_server --model_name PaddleOCR-VL-0.9B --backend vllm --port 8118`, "
        "`vllm serve PaddlePaddle/PaddleOCR-VL --trust-remote-code --port 8118`, or our own model with "
        "`python -m components.curation.openai_server --model MODEL_DIR --port 8118`; then set the `url` key "
        "of the pre-annotation config"
    )

    def __init__(self, config: PaddleOCRVLServerConfig):
        if not config.url:
            raise ValueError(f"the paddleocr_vl_server backend needs `url` (the OpenAI-compatible server); {self.START_HINT}")
        self.config = config
        root = config.url.rstrip("/")
        self.base_url = root if root.endswith("/v1") else f"{root}/v1"
        self._model = config.model
        self._session = requests.Session()

    @property
    def model_version(self) -> str:
        return self.config.model_version or f"openai:{self.served_model}"

    @property
    def served_model(self) -> str:
        if self._model is None:
            listing = self._request("GET", "/models").json()
            names = [entry.get("id") for entry in listing.get("data", []) if entry.get("id")]
            if not names:
                raise AnnotatorUnavailableError(f"{self.base_url}/models lists no model; set `model` in the config")
            self._model = names[0]
        return self._model

    def _headers(self) -> dict[str, str]:
        if self.config.api_key_env:
            token = os.environ.get(self.config.api_key_env)
            if not token:
                raise AnnotatorUnavailableError(f"environment variable {self.config.api_key_env} (api_key_env) is not set")
            return {"Authorization": f"Bearer {token}"}
        return {}

    def _request(self, method: str, path: str, payload: dict | None = None) -> requests.Response:
        url = f"{self.base_url}{path}"
        attempts = self.config.retries + 1
        last_problem = ""
        for attempt in range(attempts):
            try:
                response = self._session.request(method, url, json=payload, headers=self._headers(), timeout=self.config.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as exc:
                last_problem = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 500:
                    return self._check(response, url)
                last_problem = f"HTTP {response.status_code}: {response.text[:300]}"
            if attempt + 1 < attempts:
                time.sleep(self.config.backoff_s * 2**attempt)
        raise AnnotatorUnavailableError(
            f"PaddleOCR-VL server at {url} did not answer after {attempts} attempt(s) ({last_problem}). "
            f"Is it running? {self.START_HINT}"
        )

    @staticmethod
    def _check(response: requests.Response, url: str) -> requests.Response:
        if response.status_code < 400:
            return response
        detail = response.text[:500]
        if response.status_code in (400, 413, 422):
            raise PageAnnotationError(f"{url} refused this page: HTTP {response.status_code}: {detail}")
        raise AnnotatorUnavailableError(f"{url} answered HTTP {response.status_code}: {detail} (check url, model and api key)")

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        validate_image(image)
        payload = {
            "model": self.served_model,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_data_uri(image)}},
                {"type": "text", "text": self.config.prompt},
            ]}],
            "max_tokens": self.config.max_tokens,
            "temperature": 0.0,
            "logprobs": True,
        }
        started = time.perf_counter()
        body = self._request("POST", "/chat/completions", payload).json()
        try:
            choice = body["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            raise AnnotatorUnavailableError(f"{self.base_url}/chat/completions returned no choice: {str(body)[:300]}") from exc
        if isinstance(content, list):  # some servers return content parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        token_logprobs = [t["logprob"] for t in ((choice.get("logprobs") or {}).get("content") or []) if "logprob" in t]
        if token_logprobs:
            confidence, source = sum(math.exp(lp) for lp in token_logprobs) / len(token_logprobs), "token_probability"
        else:
            # No logprobs from this server: send the page to review first rather than guess.
            confidence, source = 0.0, "none"
        return PreAnnotation(
            strip_image_tokens(content or ""), confidence, self.model_version, [],
            {"completion_tokens": (body.get("usage") or {}).get("completion_tokens"),
             "finish_reason": choice.get("finish_reason"), "seconds": round(time.perf_counter() - started, 4),
             "confidence_source": source},
        )


# ---------------------------------------------------------------------------------------------
# the official PaddleOCR-VL pipeline (optional extra)


@dataclass
class PaddleOCRVLPipelineConfig:
    server_url: str | None = None  # an OpenAI-compatible PaddleOCR-VL server; None = run the VLM in-process
    vl_rec_backend: str | None = None  # default: "vllm-server" with server_url, else "native"
    use_layout_detection: bool = False  # the layout model is downloaded on first use (fails offline)
    pipeline_kwargs: dict = field(default_factory=dict)  # passed to PaddleOCRVL(...) as is
    model_version: str | None = None


_PADDLE_CATEGORY = {"doc_title": "title", "paragraph_title": "title", "title": "title", "table": "table",
                    "display_formula": "formula", "formula": "formula", "header": "header", "footer": "footer",
                    "number": "footer"}
_PADDLE_PICTURES = {"image", "figure", "chart", "seal", "header_image", "footer_image"}


def paddle_result_to_annotation(result_json: dict, markdown: str, model_version: str, width: int, height: int) -> PreAnnotation:
    """Convert one PaddleOCRVL page result (``res.json["res"]``, ``res.markdown["markdown_texts"]``)."""
    elements, scores = [], []
    for block in result_json.get("parsing_res_list") or []:
        label = str(block.get("block_label", "text")).lower()
        if label in _PADDLE_PICTURES:
            continue
        bbox = block.get("block_bbox") or [0, 0, width, height]
        if isinstance(bbox, str):
            bbox = [float(v) for v in bbox.strip("[]").split(",")]
        content = strip_image_tokens(str(block.get("block_content", "")))
        elements.append(LayoutElement(_PADDLE_CATEGORY.get(label, "text"), tuple(bbox[:4]), content))
    for box in (result_json.get("layout_det_res") or {}).get("boxes") or []:
        if isinstance(box, dict) and "score" in box:
            scores.append(float(box["score"]))
    confidence, source = (sum(scores) / len(scores), "layout_score") if scores else (0.0, "none")
    return PreAnnotation(strip_image_tokens(markdown), confidence, model_version, elements, {"confidence_source": source})


class PaddleOCRVLPipelineAnnotator:
    """The official ``paddleocr.PaddleOCRVL`` pipeline (install the ``paddle`` extra separately)."""

    name = "paddleocr_vl_pipeline"
    INSTALL_HINT = (
        "the paddleocr_vl_pipeline backend needs the official PaddleOCR package, which is not installed here. "
        "Install it in its own environment (paddlex pins its own OpenCV, which clashes with the main one): "
        "`python -m venv .venv-paddle && .venv-paddle/bin/pip install paddlepaddle 'paddleocr[doc-parser]'` "
        "(or `pip install -e '.[paddle]'`), or use the `paddleocr_vl_server` backend against a running "
        "PaddleOCR-VL OpenAI-compatible server instead"
    )

    def __init__(self, config: PaddleOCRVLPipelineConfig | None = None):
        self.config = config or PaddleOCRVLPipelineConfig()
        self._pipeline = None

    @property
    def model_version(self) -> str:
        return self.config.model_version or "paddleocr-vl-pipeline"

    def _load(self):
        if self._pipeline is None:
            try:
                from paddleocr import PaddleOCRVL
            except ImportError as exc:
                raise BackendNotInstalledError(f"{self.INSTALL_HINT} (import error: {exc})") from exc
            cfg = self.config
            kwargs = {"use_layout_detection": cfg.use_layout_detection, **cfg.pipeline_kwargs}
            if cfg.server_url:
                kwargs.setdefault("vl_rec_backend", cfg.vl_rec_backend or "vllm-server")
                kwargs.setdefault("vl_rec_server_url", cfg.server_url)
            elif cfg.vl_rec_backend:
                kwargs.setdefault("vl_rec_backend", cfg.vl_rec_backend)
            self._pipeline = PaddleOCRVL(**kwargs)
        return self._pipeline

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        import numpy as np

        validate_image(image)
        pipeline = self._load()
        bgr = np.ascontiguousarray(np.asarray(image.convert("RGB"))[:, :, ::-1])  # PaddleX reads arrays as BGR
        results = list(pipeline.predict(bgr))
        if not results:
            raise PageAnnotationError(f"PaddleOCRVL returned no result for page {page_id}")
        markups, elements, confidences, sources = [], [], [], []
        for res in results:
            annotation = paddle_result_to_annotation(res.json.get("res", {}), res.markdown.get("markdown_texts", ""),
                                                     self.model_version, image.width, image.height)
            markups.append(annotation.markup)
            elements.extend(annotation.elements)
            confidences.append(annotation.confidence)
            sources.append(annotation.extra["confidence_source"])
        return PreAnnotation("\n\n".join(m for m in markups if m), min(confidences), self.model_version, elements,
                             {"confidence_source": sources[0]})


# ---------------------------------------------------------------------------------------------
# factory

BACKENDS: dict[str, tuple[type, type]] = {
    "rapidocr": (RapidOCRAnnotator, RapidOCRConfig),
    "model": (ModelAnnotator, ModelAnnotatorConfig),
    "paddleocr_vl_server": (PaddleOCRVLServerAnnotator, PaddleOCRVLServerConfig),
    "paddleocr_vl_pipeline": (PaddleOCRVLPipelineAnnotator, PaddleOCRVLPipelineConfig),
}
DEFAULT_BACKEND = "rapidocr"


def make_preannotator(config: dict | None = None) -> PreAnnotator:
    """Build a backend from config, e.g. ``{"backend": "paddleocr_vl_server", "url": "http://127.0.0.1:8118"}``.

    Unknown backends and unknown keys are rejected with the accepted ones listed.
    """
    config = dict(config or {})
    backend = config.pop("backend", DEFAULT_BACKEND)
    if backend not in BACKENDS:
        raise ValueError(f"unknown pre-annotation backend {backend!r}; choose one of {sorted(BACKENDS)}")
    annotator_cls, config_cls = BACKENDS[backend]
    accepted = [f.name for f in fields(config_cls)]
    unknown = sorted(set(config) - set(accepted))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for pre-annotation backend {backend!r}; accepted: {accepted}")
    settings = config_cls(**config)
    if backend == "model":
        if not settings.model_dir:
            raise ValueError("the model backend needs `model_dir` (a folder written by save_markup_model)")
        return ModelAnnotator.from_pretrained(settings.model_dir, device=settings.device, model_version=settings.model_version,
                                              decoder=settings.decoder, max_new_tokens=settings.max_new_tokens)
    return annotator_cls(settings)


# ---------------------------------------------------------------------------------------------
# running a backend over a dataset


@dataclass
class PreAnnotationReport:
    model_version: str
    annotated: list[str] = field(default_factory=list)  # page ids annotated by this call
    skipped: list[str] = field(default_factory=list)  # already annotated by this model version earlier
    failed: dict[str, str] = field(default_factory=dict)  # page id -> reason (corrupt image, refused page)
    seconds: float = 0.0

    @property
    def pages_per_second(self) -> float:
        return len(self.annotated) / self.seconds if self.seconds > 0 else 0.0


def _meta_record(record: dict) -> dict:
    return {key: record[key] for key in ("markup", "confidence", "model_version", "elements", "extra", "annotated_at")}


def _fold(dataset: PageDataset, target: PageDataset, journal: Journal) -> int:
    """Write every journaled annotation into the target manifest (atomically). Returns pages changed."""
    latest: dict[str, dict] = {}
    for record in journal.records():
        if record.get("status") == "done":
            latest[record["page_id"]] = record
    if not latest:
        return 0
    in_place = target.root.resolve() == dataset.root.resolve()
    source_pages = dataset.get_many(latest)
    current = target.get_many(latest)
    changed: list[Page] = []
    for page_id, record in latest.items():
        meta_record = _meta_record(record)
        if in_place:
            page = current.get(page_id)
            if page is None or page.meta.get(META_KEY) == meta_record:
                continue
            changed.append(replace(page, meta={**page.meta, META_KEY: meta_record}))
        else:
            source = source_pages.get(page_id)
            existing = current.get(page_id)
            if source is None or (existing is not None and existing.meta.get(META_KEY) == meta_record):
                continue
            link_or_copy(dataset.image_path(source), target.root / source.image)
            annotation = PreAnnotation.from_json(record)
            changed.append(replace(
                source, elements=annotation.elements, markup_override=annotation.markup, source=f"preannotation:{annotation.model_version}",
                meta={**source.meta, META_KEY: meta_record, "origin_dataset": str(dataset.root)},
            ))
    if changed:
        target.upsert(changed)
    return len(changed)


def preannotate_dataset(
    dataset: PageDataset,
    annotator: PreAnnotator,
    out: PageDataset | None = None,
    *,
    resume: bool = True,
    page_ids: Iterable[str] | None = None,
    flush_every: int = 25,
    progress: Callable[[str, PreAnnotation | None], None] | None = None,
) -> PreAnnotationReport:
    """Annotate every page of ``dataset`` not yet annotated by this ``annotator.model_version``.

    Results land in ``page.meta["preannotation"]`` (markup, confidence, model_version, elements)
    of ``dataset`` itself, or, with ``out``, as pages of a separate dataset whose markup *is*
    the pre-annotation (images hard-linked or copied). Each finished page is journaled
    (``preannotations.journal.jsonl`` in the written dataset) before the next starts, and the
    manifest is rewritten atomically every ``flush_every`` pages and at the end, also when the
    run stops on an error. Corrupt images and pages the backend refuses are reported in
    ``failed`` and skipped; an unreachable backend stops the run (finished pages are kept).
    ``resume=False`` redoes pages this model version already annotated.
    """
    if flush_every < 1:
        raise ValueError(f"flush_every must be >= 1, got {flush_every}")
    target = out if out is not None else dataset  # (an empty PageDataset is falsy)
    journal = Journal(target.root / JOURNAL_NAME)
    journal.repair()
    version = annotator.model_version
    report = PreAnnotationReport(model_version=version)
    _fold(dataset, target, journal)  # a crash after journaling but before the manifest rewrite
    done = {r["page_id"] for r in journal.records() if r.get("status") == "done" and r.get("model_version") == version}
    wanted = list(dict.fromkeys(page_ids)) if page_ids is not None else None
    started = time.perf_counter()
    pending = 0
    try:
        for page in dataset.iter_pages(page_ids=wanted):
            if resume and page.page_id in done:
                report.skipped.append(page.page_id)
                continue
            try:
                image = dataset.load_image(page)
                annotation = annotator.annotate(image, page.page_id)
            except (InvalidPageError, PageAnnotationError) as exc:
                report.failed[page.page_id] = str(exc)
                logger.warning("pre-annotation skipped page %s: %s", page.page_id, exc)
                journal.append({"page_id": page.page_id, "status": "failed", "model_version": version, "reason": str(exc)})
                if progress:
                    progress(page.page_id, None)
                continue
            annotation.markup = strip_image_tokens(annotation.markup)
            record = {"page_id": page.page_id, "status": "done", **annotation.to_json(),
                      "annotated_at": datetime.now(UTC).isoformat(timespec="seconds")}
            journal.append(record)
            report.annotated.append(page.page_id)
            if progress:
                progress(page.page_id, annotation)
            pending += 1
            if pending >= flush_every:
                _fold(dataset, target, journal)
                pending = 0
    finally:
        _fold(dataset, target, journal)
        report.seconds = time.perf_counter() - started
    return report


def preannotation_of(page: Page) -> PreAnnotation | None:
    """The pre-annotation stored on a page by :func:`preannotate_dataset`, if any."""
    record = page.meta.get(META_KEY)
    return PreAnnotation.from_json(record) if record else None

