"""What every pre-annotation backend returns and shares: the record, the errors, the backend
protocol, and the removal of picture tokens from markup (pictures are not transcribed)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from PIL import Image

from components.data.pages import LayoutElement
from components.services.process import ServiceError

JOURNAL_NAME = "preannotations.journal.jsonl"
META_KEY = "preannotation"




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
