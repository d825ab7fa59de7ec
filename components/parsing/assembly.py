"""Element outputs -> page markup: each element's text in its category's markup form, the
elements in reading order, layout-only elements (headers, footers, figures) left out as in
OmniDocBench."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from components.data.markup import BLOCK_CATEGORIES, LAYOUT_ONLY_CATEGORIES, parse_markup, render_block
from components.parsing.reading_order import HasBox, find_gutter, reading_order

T = TypeVar("T", bound=HasBox)

# Detector categories outside ours that are read as text.
READ_AS_TEXT = ("caption", "chart")


def recognition_category(category: str) -> str | None:
    """The block category an element is read as, or None for layout-only elements."""
    if category in LAYOUT_ONLY_CATEGORIES:
        return None
    if category in BLOCK_CATEGORIES:
        return category
    return "text"


def element_markup(category: str, text: str, native: bool = True) -> str:
    """A recogniser's output in page-markup form.

    Prompt-free page-trained element models (``native=False``: the DocVLM) write it already (their
    targets are :func:`render_block` of the element) and decide the form from the crop, which a
    detector's category must not overrule; a prompted family's native outputs (bare LaTeX after
    ``Formula Recognition:``, a title without ``#``) and the reader's bare text are wrapped by the
    layout's category."""
    text = text.strip()
    if not text or not native:
        return text
    if category == "formula" and not text.startswith("$$"):
        return render_block("formula", text.strip("$").strip())
    if category == "title" and not text.startswith("#"):
        return render_block("title", text)
    if category == "code" and not text.startswith("```"):
        return render_block("code", text)
    return text


def element_content(markup: str) -> str:
    """An element's content without its markup wrapping (``# ``, ``$$``, fences), as page records
    and annotation regions keep it."""
    blocks = parse_markup(markup)
    return blocks[0].content if len(blocks) == 1 else markup


def order_elements(elements: Sequence[T], page_width: float, detected: bool) -> list[T]:
    """Reading order: a detector's regions are unordered (column-aware order is computed), a
    page record's elements are stored in reading order already."""
    if not detected:
        return list(elements)
    return reading_order(elements, find_gutter([e.box for e in elements], page_width))


def assemble(markups: Sequence[str]) -> str:
    """Join the (ordered) elements' markups into one page."""
    return "\n\n".join(m for m in markups if m.strip())
