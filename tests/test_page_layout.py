"""The page front end's blocks without OCR: reading order on two-column pages, code
listings, and what layout-model regions make of OCR boxes (boxes built by hand)."""

from __future__ import annotations

from components.data.markup import parse_markup, render_markup
from components.data.pages import LayoutElement, Page
from components.parsing.frontend import Blocks, FrontEndConfig, LineBox
from components.parsing.frontend.code_listing import is_listing, listing_runs, looks_like_code
from components.parsing.layout import LayoutRegion
from components.parsing.reading_order import find_gutter, reading_order

WIDTH, HEIGHT = 1200, 1600


def box(text: str, x0: float, y0: float, x1: float, height: float = 20.0) -> LineBox:
    return LineBox(text, 0.99, x0, y0, x1, y0 + height)


def two_column_boxes() -> list[LineBox]:
    """A title across the page, then two columns of six lines each."""
    boxes = [box("A Title Across Both Columns", 300, 100, 900, 30)]
    for i in range(6):
        boxes.append(box(f"left column line {i} of the paper text", 100, 200 + 30 * i, 560))
        boxes.append(box(f"right column line {i} of the paper text", 640, 200 + 30 * i, 1100))
    return boxes


def layout_markup(boxes, regions=(), **config) -> tuple[str, list]:
    blocks = Blocks(FrontEndConfig(layout_model=None, **config)).build(boxes, (WIDTH, HEIGHT), list(regions))
    elements = [LayoutElement(b.category, b.box, b.content or "") for b in blocks]
    page = Page("p", "", WIDTH, HEIGHT, elements)
    return page.markup, blocks


# ----- reading order ---------------------------------------------------------------------------
def test_gutter_found_on_two_columns_and_not_on_one():
    boxes = [b.box for b in two_column_boxes()]
    gutter = find_gutter(boxes, WIDTH)
    assert gutter is not None and 560 <= gutter <= 640
    one_column = [box(f"a full width line number {i}", 100, 200 + 30 * i, 1100).box for i in range(12)]
    assert find_gutter(one_column, WIDTH) is None


def test_two_column_page_reads_left_column_then_right():
    markup, _ = layout_markup(two_column_boxes())
    text = markup.replace("\n", " ")
    assert text.index("left column line 5") < text.index("right column line 0")
    assert text.index("A Title") < text.index("left column line 0")
    # the mechanism is what makes it pass: without column detection the lines interleave
    interleaved, _ = layout_markup(two_column_boxes(), detect_columns=False)
    assert interleaved.replace("\n", " ").index("right column line 0") < interleaved.replace("\n", " ").index("left column line 5")


def test_side_by_side_blocks_read_left_first_even_when_the_right_starts_higher():
    class Block:
        def __init__(self, name, b):
            self.name, self.box = name, b

    left = Block("left", (100, 220, 500, 400))
    right = Block("right", (600, 200, 1000, 420))
    below = Block("below", (100, 500, 1000, 600))
    assert [b.name for b in reading_order([below, right, left], None)] == ["left", "right", "below"]


# ----- code listings ---------------------------------------------------------------------------
def test_code_lines_and_prose_lines():
    assert looks_like_code("end;") and looks_like_code("for i:=maxint to 0 do")
    assert looks_like_code("> x <- c(10.4, 5.6, 3.1)") and looks_like_code("\\begin{lstlisting}")
    assert not looks_like_code("The index key has in fact two optional arguments, as shown.")
    assert not looks_like_code("Try ?help.search for details and more examples.")
    assert is_listing(["1 for i:=maxint to 0 do", "2 begin", "3   j:=square(root(i));", "4 end;"])
    assert not is_listing(["It is a truth universally acknowledged, that a single man",
                           "in possession of a good fortune, must be in want of a wife."])


def test_listing_runs_absorb_a_lone_keyword_line():
    texts = ["Here is a program that counts down:", "for i:=maxint to 0 do", "begin", "j:=square(root(i));",
             "end;", "It prints nothing at all, as you will see."]
    assert listing_runs(texts) == [(1, 5)]


def test_line_numbered_listing_becomes_one_fenced_block_never_a_table():
    boxes = [box("The program reads:", 100, 100, 500)]
    for i, code in enumerate(["for i:=maxint to 0 do", "begin", "  j:=square(root(i));", "end;"]):
        boxes += [box(str(i + 1), 100, 140 + 25 * i, 115), box(code, 160 + (40 if code.startswith(" ") else 0),
                                                                 140 + 25 * i, 500)]
    markup, blocks = layout_markup(boxes)
    assert "<table" not in markup and [b.category for b in blocks] == ["text", "code"]
    [code] = [b for b in parse_markup(markup) if b.category == "code"]
    assert code.content.splitlines()[3].startswith("4") and "end;" in code.content
    assert "j:=square(root(i));" in code.content.splitlines()[2]


def test_code_fence_round_trips_through_markup():
    from components.data.markup import MarkupBlock

    blocks = [MarkupBlock("text", "before"), MarkupBlock("code", "if x:\n\n    y = 1"), MarkupBlock("text", "after")]
    assert parse_markup(render_markup(blocks)) == blocks


# ----- layout-model regions ----------------------------------------------------------------------
def test_header_footer_and_figure_regions_are_layout_only():
    boxes = [box("Journal of Examples, Vol. 3", 100, 40, 600), box("Body text of the page goes here.", 100, 300, 1000),
             box("Axis label", 200, 600, 300), box("17", 590, 1540, 610)]
    regions = [LayoutRegion("header", (95, 35, 605, 65), 0.9), LayoutRegion("figure", (150, 500, 700, 800), 0.9),
               LayoutRegion("footer", (585, 1535, 615, 1565), 0.8)]
    markup, blocks = layout_markup(boxes, regions)
    assert markup == "Body text of the page goes here."
    assert sorted(b.category for b in blocks) == ["figure", "footer", "header", "text"]


def test_table_region_keeps_its_header_row_inside_the_table():
    rows = [("Command", "A Number", "Comments"), ("\\author", "100", "Author"), ("\\table", "300", "For tables")]
    boxes = [box(cell, x, 400 + 30 * r, x + 150) for r, row in enumerate(rows) for cell, x in zip(row, (100, 400, 700), strict=True)]
    markup, _ = layout_markup(boxes, [LayoutRegion("table", (90, 395, 860, 490), 0.9)])
    assert markup.startswith("<table><tr><td>Command</td><td>A Number</td><td>Comments</td></tr>")
    assert markup.count("<tr>") == 3


def test_prose_line_ending_in_a_symbol_inside_a_text_region_is_not_a_formula():
    boxes = [box("The resistance of the wire is measured in units of Ω", 100, 300, 1000)]
    markup, _ = layout_markup(boxes, [LayoutRegion("text", (90, 290, 1010, 330), 0.95)])
    assert "$$" not in markup
    without_region, _ = layout_markup([box("R = 5 Ω", 500, 300, 600)])
    assert without_region.startswith("$$")  # a short math line outside any text region still is one


def test_a_title_pages_title_and_author_called_header_and_footer_are_read_as_text():
    """On a title page the layout model labels the title "header" and the author "footer"; outside
    the margins neither is a running head or foot, so both stay in the markup."""
    boxes = [box("The GLPK Reference Manual", 250, 420, 950, 48), box("Andrew Makhorin", 450, 900, 750, 24),
             box("Version 5.0", 520, 960, 680, 22), box("3", 595, 1540, 605)]
    regions = [LayoutRegion("header", (240, 410, 960, 475), 0.7), LayoutRegion("footer", (440, 890, 760, 990), 0.6),
               LayoutRegion("footer", (585, 1535, 615, 1565), 0.8)]
    markup, _ = layout_markup(boxes, regions)
    assert "The GLPK Reference Manual" in markup and "Andrew Makhorin" in markup
    assert "3" not in markup.split()  # the folio in the bottom margin is still furniture
