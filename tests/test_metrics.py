"""Metrics checked against values computed by hand (arithmetic in the comments)."""

from __future__ import annotations

import pytest

from components.data.markup import MarkupBlock, parse_markup, render_markup
from components.data.pages import LayoutElement
from components.data.synthetic import generate_page
from components.metrics import (
    box_iou,
    formula_edit_distance,
    layout_similarity,
    match_boxes,
    normalize_latex_tokens,
    normalize_text,
    normalized_edit_distance,
    page_similarity,
    pairwise_consistency,
    score_dataset,
    score_page,
    teds,
    teds_pair,
    teds_structure,
    tokenize_latex,
)
from components.metrics.table import table_tree

# 3 rows x 2 columns: 3 <tr> + 6 <td> = 9 nodes below the <table> root.
GT_TABLE = (
    "<table><tr><td>abcd</td><td>b</td></tr>"
    "<tr><td>c</td><td>d</td></tr>"
    "<tr><td>e</td><td>f</td></tr></table>"
)


# ---------------------------------------------------------------- text


def test_normalized_edit_distance_hand_values():
    # kitten -> sitting: k->s, e->i, +g = 3 edits; longer length 7.
    assert normalized_edit_distance("kitten", "sitting") == pytest.approx(3 / 7)
    assert normalized_edit_distance("", "") == 0.0
    assert normalized_edit_distance("", "abc") == 1.0
    assert normalized_edit_distance("abc", "") == 1.0
    # Token lists: one substitution among 3 tokens.
    assert normalized_edit_distance([r"\alpha", "+", "b"], [r"\alpha", "+", "c"]) == pytest.approx(1 / 3)


def test_normalize_text_strips_markdown_but_keeps_words():
    raw = "## Title  with **bold** and *italic*\n\n__strong__ snake_case 2 * 3 ~~gone~~"
    assert normalize_text(raw) == "Title with bold and italic strong snake_case 2 * 3 gone"
    assert normalize_text("  a \n\t b  ") == "a b"
    assert normalize_text("") == ""


# ---------------------------------------------------------------- table


def test_teds_identical_is_one():
    assert teds(GT_TABLE, GT_TABLE) == 1.0
    assert teds_structure(GT_TABLE, GT_TABLE) == 1.0


def test_teds_missing_row_hand_value():
    # pred lacks the last row: delete 1 <tr> + 2 <td> = distance 3; max nodes = max(6, 9) = 9.
    # TEDS = 1 - 3/9 = 2/3, and the structure-only score is the same.
    pred = "<table><tr><td>abcd</td><td>b</td></tr><tr><td>c</td><td>d</td></tr></table>"
    assert teds(pred, GT_TABLE) == pytest.approx(2 / 3)
    assert teds_structure(pred, GT_TABLE) == pytest.approx(2 / 3)


def test_teds_wrong_cell_hand_value_and_structure_ignores_it():
    # "abxd" vs "abcd": 1 substitution / 4 characters = 0.25 rename cost; 9 nodes.
    # TEDS = 1 - 0.25/9 = 35/36. A fully wrong one-character cell ("z" vs "b") costs 1: 1 - 1/9.
    pred = GT_TABLE.replace("abcd", "abxd")
    assert teds(pred, GT_TABLE) == pytest.approx(35 / 36)
    assert teds(GT_TABLE.replace(">b<", ">z<"), GT_TABLE) == pytest.approx(8 / 9)
    assert teds_structure(pred, GT_TABLE) == 1.0
    assert teds_pair(pred, GT_TABLE) == pytest.approx((35 / 36, 1.0))


def test_teds_span_mismatch_costs_one_per_cell():
    # gt: 2 <tr> + 3 <td> = 5 nodes; pred: 2 <tr> + 4 <td> = 6 nodes.
    # Cheapest edit: rename the colspan=2 cell to a colspan=1 cell (1) + insert the empty cell (1) = 2.
    # TEDS = TEDS-S = 1 - 2/6 = 2/3.
    gt = '<table><tr><td colspan="2">h</td></tr><tr><td>a</td><td>b</td></tr></table>'
    pred = "<table><tr><td>h</td><td></td></tr><tr><td>a</td><td>b</td></tr></table>"
    assert teds(pred, gt) == pytest.approx(2 / 3)
    assert teds_structure(pred, gt) == pytest.approx(2 / 3)


def test_teds_header_wrappers_th_inline_tags_and_unclosed_tags_are_normalized():
    with_header = (
        "<table><thead><tr><th><b>abcd</b></th><th> b </th></tr></thead>"
        "<tbody><tr><td>c</td><td>d</td></tr><tr><td>e</td><td>f</td></tr></tbody></table>"
    )
    assert teds(with_header, GT_TABLE) == 1.0
    unclosed = "<table><tr><td>abcd<td>b<tr><td>c<td>d<tr><td>e<td>f"
    assert teds(unclosed, GT_TABLE) == 1.0
    tree = table_tree(with_header)
    assert tree is not None
    assert [child.tag for child in tree.children] == ["tr", "tr", "tr"]
    assert tree.children[0].children[0].content == "abcd"


@pytest.mark.parametrize("bad", ["", "   ", "no table here", "<<<>>> </td>", "<table", "\x00\x01"])
def test_teds_garbage_scores_zero_without_raising(bad):
    assert teds(bad, GT_TABLE) == 0.0
    assert teds_structure(bad, GT_TABLE) == 0.0
    assert teds(GT_TABLE, bad) == 0.0


def test_teds_junk_span_attribute_reads_as_one():
    # colspan="x" is unreadable -> 1, so the table equals the plain one.
    assert teds(GT_TABLE.replace("<td>b</td>", '<td colspan="x">b</td>'), GT_TABLE) == 1.0


# ---------------------------------------------------------------- formula


def test_formula_normalization_removes_delimiters_sizing_and_spacing():
    assert normalize_latex_tokens(r"$$ x^{2} + \left( y \right) \, $$") == ["x", "^", "2", "+", "(", "y", ")"]
    assert formula_edit_distance(r"$$ x^{2} + \left( y \right) $$", "x^2+(y)") == 0.0
    assert formula_edit_distance(r"\displaystyle \sum_{i=1}^{n} x_{i}", r"\sum_{i=1}^n x_i") == 0.0
    assert tokenize_latex(r"\alpha\beta\\ \{") == [r"\alpha", r"\beta", "\\\\", r"\{"]


def test_formula_edit_distance_hand_values():
    # Commands are single tokens: [\alpha, +, b] vs [\beta, +, b] -> 1 edit / 3 tokens.
    assert formula_edit_distance(r"\beta + b", r"\alpha + b") == pytest.approx(1 / 3)
    # [\frac, {, a, }, {, b, }] vs the same with c: 1 edit / 7 tokens.
    assert formula_edit_distance(r"\frac{a}{c}", r"\frac{a}{b}") == pytest.approx(1 / 7)
    assert formula_edit_distance("", "") == 0.0
    assert formula_edit_distance("", "x") == 1.0


# ---------------------------------------------------------------- layout


def test_box_iou_hand_values():
    # overlap 5x10 = 50; union 100 + 100 - 50 = 150.
    assert box_iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(1 / 3)
    assert box_iou((0, 0, 10, 10), (20, 20, 30, 30)) == 0.0
    assert box_iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert box_iou((5, 5, 5, 5), (5, 5, 5, 5)) == 1.0
    with pytest.raises(ValueError, match="four numbers"):
        box_iou((0, 0, 1), (0, 0, 1, 1))


def test_layout_matching_and_similarity_hand_values():
    gt = [(0, 0, 10, 10), (20, 0, 30, 10)]
    pred = [(20, 0, 30, 10), (0, 0, 10, 5), (100, 100, 110, 110)]
    matches = sorted((m.pred_index, m.gt_index, m.iou) for m in match_boxes(pred, gt))
    # pred 0 = gt 1 exactly; pred 1 covers half of gt 0 (50 / 100); pred 2 overlaps nothing.
    assert matches == [(0, 1, 1.0), (1, 0, 0.5)]
    # (1 + 0.5) / max(3, 2) = 0.5
    assert layout_similarity(pred, gt) == pytest.approx(0.5)
    assert layout_similarity(pred[:2], gt) == pytest.approx(0.75)
    assert layout_similarity([], []) == 1.0
    assert layout_similarity([], gt) == 0.0


def test_layout_boxes_match_only_within_a_category():
    box = (0, 0, 10, 10)
    assert layout_similarity([LayoutElement("table", box)], [LayoutElement("text", box)]) == 0.0
    assert layout_similarity([LayoutElement("text", box)], [LayoutElement("text", box)]) == 1.0


# ---------------------------------------------------------------- page

GT_TABLE_2X2 = "<table><tr><td>a</td><td>b</td></tr><tr><td>c</td><td>d</td></tr></table>"
GT_PAGE = f"# Intro\n\nhello world\n\n{GT_TABLE_2X2}\n\n$$\nx^{{2}}\n$$"


def test_score_page_identical_is_perfect():
    scores = score_page(GT_PAGE, GT_PAGE)
    assert scores.text_edit == 0.0
    assert scores.table_teds == 1.0 and scores.table_teds_s == 1.0
    assert scores.formula_edit == 0.0
    assert scores.reading_order_edit == 0.0
    assert scores.overall == pytest.approx(100.0)
    assert scores.gt_counts == {"text": 2, "table": 1, "formula": 1}


def test_score_page_hand_values():
    pred = "# Intro\n\nhello word\n\n<table><tr><td>a</td><td>b</td></tr></table>"
    scores = score_page(pred, GT_PAGE)
    # text: "Intro"+"hello world" (16 chars) vs "Intro"+"hello word": 1 deletion -> 1/16.
    assert scores.text_edit == pytest.approx(1 / 16)
    # table: one row missing from a 2x2 table: (1 tr + 2 td) / 6 nodes -> TEDS 0.5.
    assert scores.table_teds == pytest.approx(0.5)
    assert scores.table_teds_s == pytest.approx(0.5)
    # formula: not predicted -> distance 1.
    assert scores.formula_edit == 1.0
    # overall = ((1 - 1/16)·100 + 0.5·100 + 0·100) / 3 = (93.75 + 50) / 3
    assert scores.overall == pytest.approx((93.75 + 50.0) / 3)
    assert scores.reading_order_edit == 0.0


def test_score_page_reading_order_hand_value():
    # pred swaps the title and the paragraph: gt indices in predicted order [1, 0, 2, 3] vs [0, 1, 2, 3]
    # -> 2 edits / 4 = 0.5. Text edit compares in gt order, so it stays 0.
    pred = f"hello world\n\n# Intro\n\n{GT_TABLE_2X2}\n\n$$\nx^2\n$$"
    scores = score_page(pred, GT_PAGE)
    assert scores.reading_order_edit == pytest.approx(0.5)
    assert scores.text_edit == 0.0
    assert scores.overall == pytest.approx(100.0)


def test_score_page_hallucinated_text_counts():
    # gt "hello" vs pred "hello"+"extra" concatenated: 5 insertions / 10 characters.
    assert score_page("hello\n\nextra", "hello").text_edit == pytest.approx(0.5)


def test_score_page_absent_categories_are_none_not_zero():
    scores = score_page(f"hello\n\n{GT_TABLE_2X2}", "hello")
    assert scores.text_edit == 0.0
    assert scores.table_teds is None and scores.table_teds_s is None
    assert scores.formula_edit is None
    assert scores.overall == pytest.approx(100.0)
    empty_gt = score_page("anything", "")
    assert empty_gt.text_edit is None and empty_gt.overall is None and empty_gt.reading_order_edit is None


def test_score_page_empty_and_garbage_predictions():
    empty = score_page("", GT_PAGE)
    assert empty.text_edit == 1.0
    assert empty.table_teds == 0.0
    assert empty.formula_edit == 1.0
    assert empty.overall == 0.0
    assert empty.reading_order_edit is None
    garbage = score_page("<table><tr><td>a</td><td\n\n$$ \\frac{ $$ <<<", GT_PAGE)
    assert garbage.table_teds == 0.0
    assert 0.0 <= garbage.overall < 100.0


def test_score_dataset_aggregates_over_existing_categories():
    # page 1 perfect; page 2 empty prediction -> text 1, TEDS 0, formula 1; page 3 text only.
    dataset = score_dataset([(GT_PAGE, GT_PAGE), ("", GT_PAGE), ("hello", "hello")])
    # text: mean over 3 pages of (0, 1, 0) = 1/3; tables: mean over 2 gt tables (1, 0) = 0.5;
    # formulas: mean over 2 pairs (0, 1) = 0.5. overall = ((2/3)·100 + 50 + 50) / 3 = (500/3) / 3 = 500/9.
    assert dataset.text_edit == pytest.approx(1 / 3)
    assert dataset.table_teds == pytest.approx(0.5)
    assert dataset.formula_edit == pytest.approx(0.5)
    assert dataset.overall == pytest.approx(500 / 9)
    # reading order only where something matched: pages 1 and 3.
    assert dataset.reading_order_edit == 0.0
    assert dataset.n_pages_with_reading_order == 2
    flat = dataset.as_dict()
    assert {"text_edit", "table_teds", "table_teds_s", "formula_edit", "reading_order_edit", "overall"} <= set(flat)
    assert all(isinstance(value, float) for value in flat.values())
    assert flat["n_gt_table"] == 2.0 and flat["n_pred_table"] == 1.0 and flat["n_tables"] == 2.0

    text_only = score_dataset([("hello", "hello")]).as_dict()
    assert "table_teds" not in text_only and "formula_edit" not in text_only
    assert text_only["overall"] == 100.0
    assert score_dataset([]).as_dict()["n_pages"] == 0.0


def _corrupt(markup: str) -> str:
    """Damage every block: extra word in text, a wrong first cell in tables, an extra term in formulas."""
    damaged = []
    for block in parse_markup(markup):
        if block.category in ("text", "title"):
            damaged.append(MarkupBlock(block.category, block.content + " zzz"))
        elif block.category == "table":
            start = block.content.index("<td>") + len("<td>")
            end = block.content.index("</td>", start)
            damaged.append(MarkupBlock("table", block.content[:start] + "qqqq" + block.content[end:]))
        else:
            damaged.append(MarkupBlock("formula", block.content + r" + \omega"))
    return render_markup(damaged)


def test_synthetic_pages_self_perfect_and_corruption_strictly_worse():
    markups = [generate_page(seed)[0].markup for seed in range(6)]
    perfect = score_dataset((m, m) for m in markups)
    assert perfect.text_edit == 0.0
    assert perfect.table_teds == 1.0 and perfect.table_teds_s == 1.0
    assert perfect.formula_edit == 0.0
    assert perfect.overall == pytest.approx(100.0)
    assert perfect.n_tables > 0 and perfect.n_formula_pairs > 0

    corrupted_pages = [score_page(_corrupt(m), m) for m in markups]
    for page in corrupted_pages:
        assert page.overall is not None and page.overall < 100.0
    corrupted = score_dataset((_corrupt(m), m) for m in markups)
    assert corrupted.text_edit > 0.0
    assert corrupted.table_teds < 1.0
    assert corrupted.table_teds_s == 1.0  # only cell text was damaged
    assert corrupted.formula_edit > 0.0
    assert corrupted.overall < perfect.overall


# ---------------------------------------------------------------- consistency


def test_consistency_identical_outputs_are_one():
    assert pairwise_consistency(["abc"] * 3, "text") == 1.0
    assert pairwise_consistency([r"\frac{a}{b}"] * 2, "formula") == 1.0
    assert pairwise_consistency([GT_TABLE] * 4, "table") == 1.0
    assert pairwise_consistency([[(0, 0, 1, 1), (2, 2, 3, 3)]] * 2, "layout") == 1.0
    assert pairwise_consistency([GT_PAGE] * 3, "page") == 1.0


def test_consistency_hand_values():
    # pairs: (abcd, abcd) = 1, (abcd, abxd) = 0.75 twice -> 2.5 / 3.
    assert pairwise_consistency(["abcd", "abcd", "abxd"], "text") == pytest.approx(2.5 / 3)
    # one token of three differs -> 1 - 1/3.
    assert pairwise_consistency([r"\alpha + b", r"\alpha + c"], "formula") == pytest.approx(2 / 3)
    # TEDS of the wrong-cell table is 35/36: (1 + 35/36 + 35/36) / 3.
    wrong = GT_TABLE.replace("abcd", "abxd")
    assert pairwise_consistency([GT_TABLE, GT_TABLE, wrong], "table") == pytest.approx((1 + 70 / 36) / 3)
    # IoU pairs: 1, 0.5, 0.5 -> 2/3.
    box, half = [(0, 0, 10, 10)], [(0, 0, 10, 5)]
    assert pairwise_consistency([box, box, half], "layout") == pytest.approx(2 / 3)


def test_page_similarity_hand_value_and_symmetry():
    # text group: {T, hello} matched both ways (1 + 1); formula group: 1 block vs none (0).
    # blocks counted: max(2, 2) + max(1, 0) = 3 -> 2/3.
    a = "# T\n\nhello\n\n$$\nx\n$$"
    b = "hello\n\n# T"
    assert page_similarity(a, b) == pytest.approx(2 / 3)
    assert page_similarity(b, a) == pytest.approx(2 / 3)
    assert page_similarity("", "") == 1.0
    assert pairwise_consistency([a, b], "page") == pytest.approx(2 / 3)


def test_consistency_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 2"):
        pairwise_consistency(["only one"], "text")
    with pytest.raises(ValueError, match="unknown consistency kind"):
        pairwise_consistency(["a", "b"], "speech")
    with pytest.raises(TypeError, match="compares strings"):
        pairwise_consistency([[(0, 0, 1, 1)], [(0, 0, 1, 1)]], "table")
    # Garbage tables still compare without raising: different garbage scores 0.
    assert pairwise_consistency(["<table", "<<<"], "table") == 0.0
