"""TEDS and TEDS-S (tree edit distance similarity) for HTML tables, as OmniDocBench v1.5 computes them.

**Normalization** (``normalized_html_table`` in the official ``utils/data_preprocess.py``),
applied to both sides before scoring: with BeautifulSoup, ``<th>`` becomes ``<td>``,
``<thead>`` and ``<span>`` are unwrapped and ``<math alttext=…>`` becomes ``$alttext$``; then
HTML entities are unescaped, newlines dropped, Unicode NFKC-normalized, the inside of the
outermost ``<table>`` kept, ``style``/``height``/``width``/``align``/``class`` attributes and
``<tbody>`` removed, whitespace runs collapsed to one space (cell-edge spaces stay), and the
bare tags ``<sup>``, ``<sub>``, ``<span>``, ``<div>``, ``<p>`` (and ``<colgroup>…</colgroup>``)
deleted. ``<b>``/``<i>`` stay and count. A string without ``<table`` normalizes to ``""``.

**Score** (PubTabNet's TEDS): a table is the tree ``table -> tr -> td`` with each cell's
colspan, rowspan and content tokens (characters, plus ``<tag>``/``</tag>`` for elements inside
the cell). APTED with unit insert/delete; renaming costs 1 when tag or spans differ, otherwise
the normalized Levenshtein distance of the cells' tokens (0 for TEDS-S).
``TEDS = 1 - distance / n``, where ``n`` is the larger number of elements below ``<table>``
(``.//*``, so tags inside cells count). Anything the official code would fail on (no table,
unparsable spans, an empty table) scores 0.
"""

from __future__ import annotations

import html as html_entities
import re
import unicodedata
from dataclasses import dataclass, field

from apted import APTED, Config
from bs4 import BeautifulSoup
from lxml import etree, html

from components.metrics.text import normalized_edit_distance

_OUTER_TABLE_RE = re.compile(r"<table\b[^>]*>(.*)</table>", re.DOTALL | re.IGNORECASE)
_DROPPED_ATTRIBUTE_RES = tuple(re.compile(f'( {name}=".*?")') for name in ("style", "height", "width", "align", "class"))
_TBODY_RE = re.compile(r"</?tbody>")
_WHITESPACE_RE = re.compile(r"\s+")
_COLGROUP_RE = re.compile(r"<colgroup>.*?</colgroup>")
_DROPPED_TAGS = ("<sup>", "</sup>", "<sub>", "</sub>", "<span>", "</span>", "<div>", "</div>", "<p>", "</p>",
                 '<spandata-span-identity="">')
_TABLE_PREFIX = '<html><body><table border="1" >'
_TABLE_SUFFIX = "</table></body></html>"


def normalize_table_html(table_html: str) -> str:
    """The official table normalization (module docstring); ``""`` when the string holds no table."""
    if "<table" not in table_html.replace(" ", "").replace("'", '"'):
        return ""
    soup = BeautifulSoup(table_html, "html.parser")
    for cell in soup.find_all("th"):
        cell.name = "td"
    for wrapper in soup.find_all("thead"):
        wrapper.unwrap()
    for math in soup.find_all("math"):
        math.replace_with(f"${math.get('alttext', '')}$")
    for span in soup.find_all("span"):
        span.unwrap()
    text = html_entities.unescape(str(soup)).replace("\n", "")
    text = unicodedata.normalize("NFKC", text).strip()
    text = "".join(_OUTER_TABLE_RE.findall(text))
    for pattern in _DROPPED_ATTRIBUTE_RES:
        text = pattern.sub("", text)
    text = _TBODY_RE.sub("", text)
    text = _WHITESPACE_RE.sub(" ", text)
    text = _TABLE_PREFIX + text + _TABLE_SUFFIX
    for tag in _DROPPED_TAGS:
        text = text.replace(tag, "")
    return _COLGROUP_RE.sub("", text)


@dataclass
class TableNode:
    """One node of a table tree; ``content`` is the cell's token string (one character per token)."""

    tag: str
    colspan: int = 1
    rowspan: int = 1
    content: str = ""
    children: list[TableNode] = field(default_factory=list)


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
    """Maps multi-character tokens (``<br>``, ``</b>``) to single private-use characters.

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


def _cell_tokens(element: etree._Element, tokens: list[str]) -> None:
    """PubTabNet's cell tokenizer: text characters, child tags as tokens, the tails of children."""
    if element.text:
        tokens.extend(element.text)
    for child in element:
        if not isinstance(child.tag, str):
            continue
        tokens.append(f"<{child.tag}>")
        _cell_tokens(child, tokens)
        tokens.append(f"</{child.tag}>")
        if child.tail:
            tokens.extend(child.tail)


def _build_tree(element: etree._Element, codec: _TokenCodec, structure_only: bool) -> TableNode:
    if element.tag == "td":
        content = ""
        if not structure_only:
            raw: list[str] = []
            _cell_tokens(element, raw)
            content = "".join(codec.encode(token) for token in raw)
        # int() as the official code does: a junk span raises and the pair scores 0.
        return TableNode("td", int(element.get("colspan", "1")), int(element.get("rowspan", "1")), content)
    node = TableNode(str(element.tag))
    node.children = [_build_tree(child, codec, structure_only) for child in element if isinstance(child.tag, str)]
    return node


def parse_normalized_table(normalized_html: str) -> etree._Element | None:
    """The ``<table>`` element of a normalized table string; None when there is none."""
    if not normalized_html:
        return None
    parser = html.HTMLParser(remove_comments=True, encoding="utf-8")
    try:
        document = html.fromstring(normalized_html, parser=parser)
    except (etree.LxmlError, ValueError):
        return None
    tables = document.xpath("body/table")
    return tables[0] if tables else None


def table_tree(table_html: str, *, structure_only: bool = False) -> TableNode | None:
    """The TEDS tree of a table after normalization (for inspection and tests); None without a table."""
    table = parse_normalized_table(normalize_table_html(table_html))
    return None if table is None else _build_tree(table, _TokenCodec(), structure_only)


def _teds_elements(pred: etree._Element, gt: etree._Element, structure_only: bool) -> float:
    n_nodes = max(len(pred.xpath(".//*")), len(gt.xpath(".//*")))
    if n_nodes == 0:
        return 0.0
    codec = _TokenCodec()
    try:
        pred_tree = _build_tree(pred, codec, structure_only)
        gt_tree = _build_tree(gt, codec, structure_only)
    except ValueError:
        return 0.0
    if pred_tree == gt_tree:
        return 1.0
    distance = APTED(pred_tree, gt_tree, _TedsConfig()).compute_edit_distance()
    return 1.0 - float(distance) / n_nodes


def teds_normalized(pred_norm: str, gt_norm: str) -> tuple[float, float]:
    """(TEDS, TEDS-S) of two already normalized table strings (``normalize_table_html``)."""
    pred, gt = parse_normalized_table(pred_norm), parse_normalized_table(gt_norm)
    if pred is None or gt is None:
        return 0.0, 0.0
    return _teds_elements(pred, gt, False), _teds_elements(pred, gt, True)


def teds_pair(pred_html: str, gt_html: str) -> tuple[float, float]:
    """(TEDS, TEDS-S) of two raw HTML tables, each normalized first. Never raises on bad HTML."""
    return teds_normalized(normalize_table_html(pred_html or ""), normalize_table_html(gt_html or ""))


def teds(pred_html: str, gt_html: str, *, structure_only: bool = False) -> float:
    """TEDS in [0, 1] (1 = identical); ``structure_only=True`` gives TEDS-S."""
    return teds_pair(pred_html, gt_html)[1 if structure_only else 0]


def teds_structure(pred_html: str, gt_html: str) -> float:
    """TEDS-S: the structure-only variant (cell content ignored)."""
    return teds(pred_html, gt_html, structure_only=True)
