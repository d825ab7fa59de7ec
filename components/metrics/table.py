"""TEDS and TEDS-S (tree edit distance similarity) for HTML tables, as PubTabNet/OmniDocBench define them.

A table becomes a tree ``table -> tr -> td`` whose cells carry colspan, rowspan and their content
tokens (characters, plus ``<tag>``/``</tag>`` tokens for markup left inside a cell, as in the
original TEDS tokenizer). The APTED tree edit distance uses these costs:

- insert / delete a node: 1;
- rename: 1 when tag, colspan or rowspan differ; for two cells that agree on those, the
  normalized Levenshtein distance of their content tokens (0 in the structure-only variant);

and ``TEDS = 1 - distance / max(n_nodes_pred, n_nodes_gt)``, where a table's node count is the
number of nodes below the ``<table>`` root (rows, cells and any other structural element), as
PubTabNet counts ``table.xpath(".//*")``.

Normalization before building the trees (the same on both sides), following OmniDocBench:
``<thead>/<tbody>/<tfoot>`` wrappers are dropped (their rows are kept), ``<th>`` is scored as
``<td>``, presentational inline tags (``<b>``, ``<i>``, ``<span>``, ...) are unwrapped, and cell
whitespace is collapsed. An empty prediction, a prediction without a ``<table>`` or any parse
failure scores 0 instead of raising, because model output is often malformed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apted import APTED, Config
from lxml import etree, html

from components.metrics.text import normalized_edit_distance

_WRAPPER_TAGS = ("thead", "tbody", "tfoot")
_INLINE_TAGS = ("b", "strong", "i", "em", "u", "span", "font", "p", "div", "a")
_CELL_TAGS = ("td", "th")


@dataclass
class TableNode:
    """One node of a table tree; ``content`` is the cell's token string (one character per token)."""

    tag: str
    colspan: int = 1
    rowspan: int = 1
    content: str = ""
    children: list[TableNode] = field(default_factory=list)

    def size(self) -> int:
        return 1 + sum(child.size() for child in self.children)


class _TedsConfig(Config):
    """APTED costs of TEDS: unit insert/delete, rename by structure then by cell content."""

    valuecls = float

    def rename(self, node1: TableNode, node2: TableNode) -> float:
        if node1.tag != node2.tag or node1.colspan != node2.colspan or node1.rowspan != node2.rowspan:
            return 1.0
        if node1.tag == "td" and (node1.content or node2.content):
            return normalized_edit_distance(node1.content, node2.content)
        return 0.0

    def children(self, node: TableNode) -> list[TableNode]:
        return node.children


class _TokenCodec:
    """Maps multi-character tokens (``<br>``, ``</sup>``) to single private-use characters.

    Cell contents then stay plain strings, so rapidfuzz compares them at C speed while each
    token still costs exactly one edit.
    """

    _FIRST_PRIVATE_USE = 0xF0000

    def __init__(self) -> None:
        self._codes: dict[str, str] = {}

    def encode(self, token: str) -> str:
        if len(token) == 1:
            return token
        if token not in self._codes:
            self._codes[token] = chr(self._FIRST_PRIVATE_USE + len(self._codes))
        return self._codes[token]


def _span(element: etree._Element, name: str) -> int:
    """colspan/rowspan as an int; junk values ("2a", "") read their leading digits or default to 1."""
    raw = str(element.get(name, "1")).strip()
    digits = ""
    for char in raw:
        if not char.isdigit():
            break
        digits += char
    return max(1, int(digits)) if digits else 1


def _raw_cell_tokens(element: etree._Element, tokens: list[str]) -> None:
    """The original TEDS tokenizer: text characters, child tags as tokens, tails after children."""
    if element.text:
        tokens.extend(element.text)
    for child in element:
        if not isinstance(child.tag, str):  # comments / processing instructions
            if child.tail:
                tokens.extend(child.tail)
            continue
        tokens.append(f"<{child.tag}>")
        _raw_cell_tokens(child, tokens)
        tokens.append(f"</{child.tag}>")
        if child.tail:
            tokens.extend(child.tail)


def _cell_content(element: etree._Element, codec: _TokenCodec) -> str:
    raw: list[str] = []
    _raw_cell_tokens(element, raw)
    collapsed: list[str] = []
    for token in raw:
        if token.isspace():
            if collapsed and collapsed[-1] != " ":
                collapsed.append(" ")
            continue
        collapsed.append(codec.encode(token))
    if collapsed and collapsed[-1] == " ":
        collapsed.pop()
    return "".join(collapsed)


def _build_tree(element: etree._Element, codec: _TokenCodec, structure_only: bool) -> TableNode:
    tag = "td" if element.tag in _CELL_TAGS else str(element.tag)
    if tag == "td":
        content = "" if structure_only else _cell_content(element, codec)
        return TableNode("td", _span(element, "colspan"), _span(element, "rowspan"), content)
    node = TableNode(tag)
    node.children = [_build_tree(child, codec, structure_only) for child in element if isinstance(child.tag, str)]
    return node


def parse_table(table_html: str) -> etree._Element | None:
    """First ``<table>`` element of an HTML string, normalized; None when there is none or parsing fails."""
    if not table_html or not table_html.strip():
        return None
    parser = html.HTMLParser(remove_comments=True, remove_pis=True)
    try:
        document = html.fromstring(f"<html><body>{table_html}</body></html>", parser=parser)
    except (etree.LxmlError, ValueError):
        return None
    table = document if document.tag == "table" else document.find(".//table")
    if table is None:
        return None
    etree.strip_tags(table, *_WRAPPER_TAGS)
    for cell in table.iter(*_CELL_TAGS):
        etree.strip_tags(cell, *_INLINE_TAGS)
    return table


def table_tree(table_html: str, *, structure_only: bool = False) -> TableNode | None:
    """The TEDS tree of a table (for inspection and tests); None when the HTML has no usable table."""
    table = parse_table(table_html)
    if table is None:
        return None
    return _build_tree(table, _TokenCodec(), structure_only)


def _teds_from_elements(pred: etree._Element, gt: etree._Element, structure_only: bool) -> float:
    codec = _TokenCodec()
    pred_tree = _build_tree(pred, codec, structure_only)
    gt_tree = _build_tree(gt, codec, structure_only)
    if pred_tree == gt_tree:
        return 1.0
    n_nodes = max(pred_tree.size(), gt_tree.size()) - 1  # nodes below the <table> root
    if n_nodes <= 0:
        return 1.0
    distance = APTED(pred_tree, gt_tree, _TedsConfig()).compute_edit_distance()
    return min(1.0, max(0.0, 1.0 - float(distance) / n_nodes))


def teds(pred_html: str, gt_html: str, *, structure_only: bool = False) -> float:
    """TEDS in [0, 1] (1 = identical); ``structure_only=True`` gives TEDS-S. Never raises on bad HTML."""
    pred, gt = parse_table(pred_html), parse_table(gt_html)
    if pred is None or gt is None:
        return 0.0
    return _teds_from_elements(pred, gt, structure_only)


def teds_structure(pred_html: str, gt_html: str) -> float:
    """TEDS-S: the structure-only variant (cell content ignored)."""
    return teds(pred_html, gt_html, structure_only=True)


def teds_pair(pred_html: str, gt_html: str) -> tuple[float, float]:
    """(TEDS, TEDS-S) from one parse of each table, for the page scorer."""
    pred, gt = parse_table(pred_html), parse_table(gt_html)
    if pred is None or gt is None:
        return 0.0, 0.0
    return _teds_from_elements(pred, gt, False), _teds_from_elements(pred, gt, True)
