"""The page markup format shared by generator, model targets, metrics and annotators.

A page is a sequence of block elements joined by a blank line, in reading order:

- ``title``:   ``# Some title``
- ``text``:    a plain paragraph
- ``table``:   one HTML ``<table>...</table>`` (``<tr>``, ``<td>``/``<th>``, ``colspan``/``rowspan``)
- ``formula``: ``$$`` newline LaTeX newline ``$$``
- ``code``:    a fenced block, ```` ```text ```` newline lines newline ```` ``` ```` (a code listing keeps its
  lines and indentation; OmniDocBench's extraction reads fenced code as text)

Page headers and footers (running heads, page numbers) and figures are layout-only: they have
boxes but no markup, as in OmniDocBench, whose evaluation ignores them. Keeping this format in one module means parsing and rendering
can never drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BLOCK_CATEGORIES = ("title", "text", "table", "formula", "code")
LAYOUT_ONLY_CATEGORIES = ("header", "footer", "figure")
ALL_CATEGORIES = BLOCK_CATEGORIES + LAYOUT_ONLY_CATEGORIES

_TABLE_RE = re.compile(r"<table\b.*?</table>", re.IGNORECASE | re.DOTALL)
_DISPLAY_MATH_RE = re.compile(r"\$\$(.*?)\$\$", re.DOTALL)
_CODE_FENCE_RE = re.compile(r"^```[\w+-]*\n.*?^```[ \t]*$", re.DOTALL | re.MULTILINE)
CODE_LANGUAGE = "text"  # the fence's language tag: pre-annotation cannot tell the language


@dataclass(frozen=True)
class MarkupBlock:
    """One block of page markup: its category and its content without the wrapping syntax."""

    category: str
    content: str


def render_block(category: str, content: str) -> str:
    """Render one element's content into its markup form."""
    if category == "title":
        return f"# {content}"
    if category == "text" or category == "table":
        return content
    if category == "formula":
        return f"$$\n{content}\n$$"
    if category == "code":
        return f"```{CODE_LANGUAGE}\n{content}\n```"
    raise ValueError(f"category {category!r} has no markup form (expected one of {BLOCK_CATEGORIES})")


def render_markup(blocks: list[MarkupBlock]) -> str:
    """Join blocks in reading order into one page markup string."""
    return "\n\n".join(render_block(b.category, b.content) for b in blocks)


def parse_markup(markup: str) -> list[MarkupBlock]:
    """Split page markup (ours or a model's, possibly malformed) back into blocks.

    Code fences, tables and display formulas are cut out first because they may contain blank lines;
    the rest is split on blank lines. Unclosed tables or formulas fall back to text, so a
    broken prediction still gets scored instead of raising.
    """
    blocks: list[MarkupBlock] = []
    pattern = re.compile(f"{_CODE_FENCE_RE.pattern}|{_TABLE_RE.pattern}|{_DISPLAY_MATH_RE.pattern}",
                         re.IGNORECASE | re.DOTALL | re.MULTILINE)
    cursor = 0
    for match in pattern.finditer(markup):
        blocks.extend(_parse_plain(markup[cursor : match.start()]))
        token = match.group(0)
        if token.startswith("```"):
            body = token.split("\n", 1)[1]
            blocks.append(MarkupBlock("code", body[: body.rstrip().rfind("```")].rstrip("\n")))
        elif token.startswith("$$"):
            blocks.append(MarkupBlock("formula", token[2:-2].strip()))
        else:
            blocks.append(MarkupBlock("table", token.strip()))
        cursor = match.end()
    blocks.extend(_parse_plain(markup[cursor:]))
    return blocks


def _parse_plain(chunk: str) -> list[MarkupBlock]:
    blocks = []
    for paragraph in re.split(r"\n\s*\n", chunk):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        if paragraph.startswith("#"):
            blocks.append(MarkupBlock("title", paragraph.lstrip("#").strip()))
        else:
            blocks.append(MarkupBlock("text", " ".join(paragraph.split())))
    return blocks
