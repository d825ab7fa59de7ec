"""Is a submitted correction valid markup? (tables as well-formed HTML fragments, blocks parse)."""

from __future__ import annotations

import html
import re

from lxml import etree

from components.data.markup import parse_markup

_VOID_BR_RE = re.compile(r"<br\s*/?>", re.IGNORECASE)
_NAMED_ENTITY_RE = re.compile(r"&([A-Za-z][A-Za-z0-9]*);")
_BARE_AMPERSAND_RE = re.compile(r"&(?![A-Za-z][A-Za-z0-9]*;|#[0-9]+;|#[xX][0-9A-Fa-f]+;)")
_XML_ENTITIES = frozenset({"amp", "lt", "gt", "quot", "apos"})


def _html_fragment_problems(table_html: str) -> list[str]:
    """Why one ``<table>`` block is not a well-formed table of rows and cells ([] if it is)."""
    # Strict XML parsing catches unclosed/misnested tags that an HTML parser would silently fix.
    # Cell *text* is held to HTML's looser rules: <br> is closed, HTML named entities become
    # characters and a bare "&" (as in "R&D") is escaped, so only the structure is judged.
    normalised = _VOID_BR_RE.sub("<br/>", table_html)
    normalised = _NAMED_ENTITY_RE.sub(
        lambda m: m.group(0) if m.group(1) in _XML_ENTITIES else html.unescape(m.group(0)), normalised
    )
    normalised = _BARE_AMPERSAND_RE.sub("&amp;", normalised)
    parser = etree.XMLParser(recover=False, resolve_entities=False, no_network=True)
    try:
        root = etree.fromstring(normalised.encode("utf-8"), parser)
    except etree.XMLSyntaxError as exc:
        return [f"table is not well-formed HTML: {exc.msg}"]
    if root.tag.lower() != "table":
        return [f"expected a <table> element, found <{root.tag}>"]
    problems: list[str] = []
    rows = []
    for child in root:
        if not isinstance(child.tag, str):
            continue  # comments
        tag = child.tag.lower()
        if tag in ("thead", "tbody", "tfoot"):
            for sub in child:
                if isinstance(sub.tag, str) and sub.tag.lower() != "tr":
                    problems.append(f"<{tag}> may only contain <tr>, found <{sub.tag}>")
                elif isinstance(sub.tag, str):
                    rows.append(sub)
        elif tag == "tr":
            rows.append(child)
        elif tag != "caption":
            problems.append(f"<table> may only contain rows (<tr>), found <{child.tag}>")
    if not rows:
        problems.append("table has no <tr> rows")
    widths = []
    pending: list[int] = []  # remaining rowspan per occupied column, carried to the next rows
    for index, row in enumerate(rows, 1):
        cells = [c for c in row if isinstance(c.tag, str)]
        bad = [c.tag for c in cells if c.tag.lower() not in ("td", "th")]
        if bad:
            problems.append(f"row {index} may only contain <td>/<th> cells, found <{bad[0]}>")
            continue
        if not cells:
            problems.append(f"row {index} has no cells")
            continue
        carried = sum(1 for n in pending if n > 0)
        pending = [n - 1 for n in pending if n - 1 > 0]
        width = carried
        for cell in cells:
            spans = []
            for attr in ("colspan", "rowspan"):
                raw = cell.get(attr, "1")
                try:
                    value = int(raw)
                except ValueError:
                    value = 0
                if value < 1:
                    problems.append(f"row {index}: {attr}={raw!r} is not a positive integer")
                    value = 1
                spans.append(value)
            colspan, rowspan = spans
            width += colspan
            if rowspan > 1:
                pending.extend([rowspan - 1] * colspan)
        widths.append(width)
    if widths and len(set(widths)) > 1:
        problems.append(f"rows have different numbers of columns: {widths}")
    return problems


def validate_markup(markup: str) -> list[str]:
    """Reasons the corrected page markup cannot be used as ground truth ([] when it can)."""
    if not markup.strip():
        return ["the corrected markup is empty"]
    problems: list[str] = []
    for number, block in enumerate(parse_markup(markup), 1):
        if block.category == "table":
            problems.extend(f"block {number}: {p}" for p in _html_fragment_problems(block.content))
        elif block.category in ("text", "title"):
            lowered = block.content.lower()
            if "<table" in lowered or "</table" in lowered or "<tr" in lowered or "<td" in lowered:
                problems.append(f"block {number}: table markup outside a complete <table>...</table> (unclosed table?)")
            if "$$" in block.content:
                problems.append(f"block {number}: unclosed $$ formula")
    return problems
