"""Metrics checked against values computed by hand from OmniDocBench v1.5's definitions.

Each section covers one way the official end-to-end evaluation (commit 7bd6c2e) differs from a
naive scorer; the arithmetic is in the comments. Exact agreement with the official code on many
pages is measured by ``benchmarks/omnidocbench_parity.py``.
"""

from __future__ import annotations

import json
import re

import pytest

from components.data.pages import LayoutElement
from components.data.synthetic import generate_page
from components.evaluation import omnidocbench
from components.metrics import (
    aggregate_scores,
    box_iou,
    extract_elements,
    formula_edit_distance,
    gt_elements_from_page,
    layout_similarity,
    match_boxes,
    normalize_formula,
    normalize_table_html,
    normalize_text,
    normalized_edit_distance,
    overall_score,
    page_similarity,
    pairwise_consistency,
    score_dataset,
    score_page,
    teds,
    teds_pair,
    teds_structure,
)
from components.metrics.table import table_tree

# 3 rows x 2 columns: 3 <tr> + 6 <td> = 9 nodes below the <table> root.
GT_TABLE = (
    "<table><tr><td>abcd</td><td>b</td></tr>"
    "<tr><td>c</td><td>d</td></tr>"
    "<tr><td>e</td><td>f</td></tr></table>"
)
# 2 x 2: 2 <tr> + 4 <td> = 6 nodes.
TABLE_2X2 = "<table><tr><td>a</td><td>b</td></tr><tr><td>c</td><td>d</td></tr></table>"
GT_PAGE = f"# Intro\n\nhello world\n\n{TABLE_2X2}\n\n$$\nx^{{2}}\n$$"


# ---------------------------------------------------------------- text normalization


def test_normalized_edit_distance_hand_values():
    assert normalized_edit_distance("abcd", "abcd") == 0.0
    assert normalized_edit_distance("abcd", "abxd") == 0.25
    assert normalized_edit_distance("", "abc") == 1.0
    assert normalized_edit_distance("", "") == 0.0
    assert normalized_edit_distance([1, 2, 3], [1, 3]) == pytest.approx(1 / 3)


def test_text_cleaning_drops_every_non_word_character():
    # ASCII and full-width punctuation and all spaces go; letters, digits, "_" and CJK stay.
    assert normalize_text("Hello, world! 你好。") == "Helloworld你好"
    assert normalize_text("# A  title\n") == "Atitle"
    # "_x_" is not unwrapped as emphasis: underscores are word characters.
    assert normalize_text("_x_") == "_x_"
    # So punctuation and spacing errors cost nothing.
    assert normalize_text("a, b; c") == normalize_text("a b c")


def test_inline_math_becomes_unicode_only_when_it_needs_rendering():
    # x^{2} -> pylatexenc "x^2" -> cleaned "x2"; \alpha_i -> "α_i".
    assert normalize_text("area $x^{2}$ m") == "areax2m"
    assert normalize_text("weight $\\alpha_i$") == "weightα_i"
    # No \, ^ or _: the formula stays as written and only loses its "$" and "=".
    assert normalize_text("with $n=3$ rows") == "withn3rows"
    assert normalize_text("\\(\\beta\\) test") == "βtest"


# ---------------------------------------------------------------- extraction


def test_extraction_reads_every_formula_and_table_syntax():
    page = ("Intro text.\n\n\\[a+b\\]\n\n$$c$$\n\n$d^2$\n\ninline \\(e\\) here\n\n"
            "<table><tr><td>1</td></tr></table>\n\n| h | k |\n|---|---|\n| 1 | 2 |")
    kinds = [(e.kind, e.content) for e in extract_elements(page)]
    assert ("text_block", "Intro text.") in kinds
    assert ("equation_isolated", "\\[a+b\\]") in kinds
    assert ("equation_isolated", "\\[c\\]") in kinds          # $$c$$ is rewritten to \[c\]
    assert ("equation_inline", "\\[d^2\\]") in kinds          # $d^2$ on its own line ...
    assert ("equation_isolated", "$d^2$") in kinds             # ... is also a display formula block
    assert ("equation_inline", "\\[e\\]") in kinds            # \(e\) inside text, which keeps it
    assert ("text_block", "inline \\(e\\) here") in kinds
    assert [k for k, _ in kinds].count("html_table") == 1
    assert [k for k, _ in kinds].count("md2html_table") == 1


def test_pipe_table_is_scored_as_the_html_table_it_denotes():
    pred = "| a | b |\n|---|---|\n| c | d |"
    scores = score_page(pred, TABLE_2X2)
    assert scores.table_teds == 1.0 and scores.table_teds_s == 1.0
    assert scores.text_edit is None  # nothing left over as text


# ---------------------------------------------------------------- formula normalization


def test_formula_normalization_works_on_characters():
    # \mathrm's name goes, its braces stay; \tag{...} and spaces go.
    assert normalize_formula("\\mathrm{d}x \\tag{1}") == "{d}x"
    # \left / \right go, and everything is lowercased.
    assert normalize_formula("\\left( A \\right)") == "(a)"
    # every \begin{...} / \end{...} goes; delimiters go.
    assert normalize_formula("$$\\begin{aligned} a \\end{aligned}$$") == "a"
    assert normalize_formula("\\[ x^{2} \\quad \\]") == "x^{2}"
    # \, is not special: it stays (the official list does not have it).
    assert normalize_formula("a\\,b") == "a\\,b"


def test_formula_edit_distance_is_per_character():
    # "\alpha" (6) -> "\beta" (5): a->b, l->e, p->t, delete h = 4 edits / 6.
    assert formula_edit_distance("\\alpha", "\\beta") == pytest.approx(4 / 6)
    assert formula_edit_distance("X^{2}", "x^{2}") == 0.0
    assert formula_edit_distance("\\mathbf{x}+1", "{x}+1") == 0.0


def test_extra_predicted_formula_is_ignored_and_every_display_syntax_matches():
    gt = "$$\nx^{2}\n$$"
    for pred in ("\\[x^{2}\\]", "$$x^{2}$$", "$x^{2}$", "\\(x^{2}\\)"):
        assert score_page(pred, gt).formula_edit == 0.0, pred
    # A second predicted formula with no ground truth costs nothing.
    assert score_page("$$x^{2}$$\n\n$$y+z$$", gt).formula_edit == 0.0


# ---------------------------------------------------------------- tables


def test_teds_identical_and_missing_row_hand_values():
    assert teds(GT_TABLE, GT_TABLE) == 1.0
    # deleting one row costs its <tr> and 2 <td> = 3 edits over 9 nodes.
    pred = GT_TABLE.replace("<tr><td>e</td><td>f</td></tr>", "")
    assert teds(pred, GT_TABLE) == pytest.approx(1 - 3 / 9)


def test_teds_wrong_cell_and_span_hand_values():
    # "abcd" vs "abxd": rename cost 1/4 over 9 nodes; structure unchanged.
    wrong = GT_TABLE.replace("abcd", "abxd")
    assert teds(wrong, GT_TABLE) == pytest.approx(1 - 0.25 / 9)
    assert teds_structure(wrong, GT_TABLE) == 1.0
    spanned = GT_TABLE.replace("<td>abcd</td>", '<td colspan="2">abcd</td>')
    assert teds_structure(spanned, GT_TABLE) == pytest.approx(1 - 1 / 9)


def test_teds_cell_normalization_nfkc_kept_bold_and_edge_spaces():
    # NFKC: a full-width "１" equals "1".
    assert teds(TABLE_2X2.replace(">a<", ">１<"), TABLE_2X2.replace(">a<", ">1<")) == 1.0
    # <b> stays: the cell reads <b> a </b> (3 tokens) vs a (1) = 2/3, and the <b> element
    # counts as a node: n = 7. TEDS = 1 - (2/3)/7 = 19/21.
    assert teds(TABLE_2X2.replace("<td>a</td>", "<td><b>a</b></td>"), TABLE_2X2) == pytest.approx(19 / 21)
    # Cell-edge spaces stay: " a " vs "a" = 2/3 over 6 nodes.
    assert teds(TABLE_2X2.replace("<td>a</td>", "<td> a </td>"), TABLE_2X2) == pytest.approx(1 - (2 / 3) / 6)
    # <sup>/<sub>/<span> are removed as tags, th/thead are plain cells and rows.
    assert teds(TABLE_2X2.replace("<td>a</td>", "<td>a<sup>2</sup></td>"), TABLE_2X2.replace(">a<", ">a2<")) == 1.0
    header = "<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>c</td><td>d</td></tr></tbody></table>"
    assert teds(header, TABLE_2X2) == 1.0
    assert normalize_table_html("no table here") == ""


@pytest.mark.parametrize("bad", ["", "not a table", "<table", "<table></table>", '<table><tr><td colspan="x">a</td></tr></table>'])
def test_teds_garbage_scores_zero_without_raising(bad):
    assert teds(bad, GT_TABLE) == 0.0
    assert teds_pair(bad, GT_TABLE) == (0.0, 0.0)


def test_table_tree_shows_normalized_cells():
    tree = table_tree("<table><tr><th>x</th></tr></table>")
    assert tree is not None and [c.tag for c in tree.children[0].children] == ["td"]


# ---------------------------------------------------------------- matching


def test_prediction_only_blocks_are_dropped():
    assert score_page("alpha beta\n\nnoise words here", "alpha beta").text_edit == 0.0


def test_split_paragraph_is_merged_back_truncation():
    gt = "the quick brown fox jumps over the lazy dog\n\nsecond paragraph here"
    pred = "the quick brown fox\n\njumps over the lazy dog\n\nsecond paragraph here"
    assert score_page(pred, gt).text_edit == 0.0


def test_prediction_holding_two_blocks_absorbs_the_second_fuzzy_many_to_one():
    # "delta" has no pair; it is inside the first prediction, which then covers both blocks.
    assert score_page("alpha beta gamma delta", "alpha beta gamma\n\ndelta").text_edit == 0.0


def test_ignored_categories_claim_predictions_and_are_not_scored():
    page = {"layout_dets": [
        {"category_type": "header", "text": "Journal of Things", "order": 1, "anno_id": 0},
        {"category_type": "text_block", "text": "real body text", "order": 2, "anno_id": 1},
        {"category_type": "page_number", "text": "17", "order": 3, "anno_id": 2},
    ], "page_info": {"image_path": "p.png"}}
    scores = omnidocbench.score_page_elements("Journal of Things\n\nreal body text", gt_elements_from_page(page))
    assert scores.text_edit == 0.0 and len(scores.text_samples) == 1
    # The header claims the only prediction (distance 0 < 0.25), so the body block is unmatched
    # (edit 1) instead of being paired with the header's text (4/16).
    page["layout_dets"] = [{"category_type": "header", "text": "Annual report 2024", "order": 1, "anno_id": 0},
                           {"category_type": "text_block", "text": "Annual report", "order": 2, "anno_id": 1}]
    assert omnidocbench.score_page_elements("Annual report 2024", gt_elements_from_page(page)).text_edit == 1.0


def test_truncated_ground_truth_blocks_are_merged():
    page = {"layout_dets": [
        {"category_type": "text_block", "text": "first half ", "order": 1, "anno_id": "a"},
        {"category_type": "text_block", "text": "second half", "order": 2, "anno_id": "b"},
    ], "extra": {"relation": [{"source_anno_id": "a", "target_anno_id": "b", "relation_type": "truncated"}]}}
    elements = gt_elements_from_page(page)
    assert [(e.category, e.content) for e in elements] == [("text_block", "first half second half")]


# ---------------------------------------------------------------- page and dataset


def test_text_edit_is_sum_of_edits_over_sum_of_lengths():
    # "abcd"/"abxd": 1 edit of 4; "efghijkl" exact: 0 of 8 -> 1/12 (a mean per block would be 1/8).
    assert score_page("abxd\n\nefghijkl", "abcd\n\nefghijkl").text_edit == pytest.approx(1 / 12)


def test_reading_order_counts_text_blocks_only():
    gt = "first block\n\nsecond block\n\nthird block"
    swapped = "second block\n\nfirst block\n\nthird block"
    # orders [2, 1, 3] against [1, 2, 3]: 2 substitutions / 3.
    assert score_page(swapped, gt).reading_order_edit == pytest.approx(2 / 3)
    # A table or formula out of place does not move the text order.
    gt_mixed = f"first block\n\n{TABLE_2X2}\n\nsecond block"
    assert score_page(f"{TABLE_2X2}\n\nfirst block\n\nsecond block", gt_mixed).reading_order_edit == 0.0


def test_overall_counts_a_missing_term_as_zero():
    assert overall_score(0.0, None, None) == pytest.approx(100 / 3)
    assert overall_score(None, 1.0, 0.0) == pytest.approx(200 / 3)
    assert overall_score(0.1, 0.8, 0.2) == pytest.approx((90 + 80 + 80) / 3)
    assert overall_score(0.1, 0.8, 0.2, formula_cdm=0.5) == pytest.approx((90 + 80 + 50) / 3)
    assert score_page("hello", "hello").overall == pytest.approx(100 / 3)


def test_dataset_teds_is_page_level():
    wrong = TABLE_2X2.replace(">a<", ">z<").replace(">b<", ">y<").replace(">c<", ">x<").replace(">d<", ">w<")
    page_a = score_page(f"{TABLE_2X2}\n\n{wrong}", f"{TABLE_2X2}\n\n{TABLE_2X2}")
    page_b = score_page(TABLE_2X2, TABLE_2X2)
    # page A: tables 1 and 1 - 4/6 = 1/3, mean 2/3; page B: 1. Page level: (2/3 + 1)/2 = 5/6,
    # while the mean over the three tables would be (1 + 1/3 + 1)/3 = 7/9.
    assert page_a.table_teds == pytest.approx(2 / 3)
    assert aggregate_scores([page_a, page_b]).table_teds == pytest.approx(5 / 6)


def test_absent_categories_are_none_and_empty_prediction_scores_worst():
    scores = score_page("hello", "hello")
    assert scores.table_teds is None and scores.formula_edit is None
    empty = score_page("", f"hello\n\n{TABLE_2X2}\n\n$$\nx\n$$")
    assert empty.text_edit == 1.0 and empty.table_teds == 0.0 and empty.formula_edit == 1.0
    assert empty.overall == 0.0


def test_synthetic_pages_self_perfect_and_corruption_strictly_worse():
    markups = [generate_page(seed)[0].markup for seed in range(6)]
    perfect = score_dataset((m, m) for m in markups)
    assert perfect.text_edit == 0.0 and perfect.formula_edit == 0.0
    assert perfect.table_teds == 1.0 and perfect.table_teds_s == 1.0
    assert perfect.overall == pytest.approx(100.0)
    assert perfect.n_tables > 0 and perfect.n_formula_pairs > 0
    corrupted = score_dataset((_corrupt(m), m) for m in markups)
    assert corrupted.text_edit > 0.0 and corrupted.formula_edit > 0.0
    assert corrupted.table_teds < 1.0 and corrupted.table_teds_s == 1.0  # only cell text was damaged
    assert corrupted.overall < perfect.overall


def _corrupt(markup: str) -> str:
    # "e" -> "q" outside tags, \\frac -> \\sqrt, and one extra letter in every cell.
    return re.sub(r"e(?![^<]*>)", "q", markup).replace("\\frac", "\\sqrt").replace("<td>", "<td>w")


# ---------------------------------------------------------------- OmniDocBench-format CLI


def _write_benchmark(tmp_path):
    pages = [
        {"layout_dets": [{"category_type": "text_block", "text": "abcd", "order": 1, "anno_id": 0},
                         {"category_type": "table", "html": TABLE_2X2, "order": 2, "anno_id": 1}],
         "page_info": {"image_path": "images/one.jpg", "page_attribute": {"language": "english"}}},
        {"layout_dets": [{"category_type": "equation_isolated", "latex": "$$x^{2}$$", "order": 1, "anno_id": 0},
                         {"category_type": "text_block", "text": "efgh", "order": 2, "anno_id": 1}],
         "page_info": {"image_path": "two.png", "page_attribute": {"language": "simplified_chinese"}}},
        {"layout_dets": [], "page_info": {"image_path": "three.png", "page_attribute": {"language": "english"}}},
    ]
    gt = tmp_path / "OmniDocBench.json"
    gt.write_text(json.dumps(pages))
    preds = tmp_path / "preds"
    preds.mkdir()
    (preds / "one.md").write_text(f"abxd\n\n{TABLE_2X2}")
    (preds / "two.md").write_text("\\[x^{2}\\]\n\nefgh")
    return gt, preds


def test_omnidocbench_cli_scores_a_prediction_folder(tmp_path, capsys):
    gt, preds = _write_benchmark(tmp_path)
    out = tmp_path / "result.json"
    assert omnidocbench.main(["--gt", str(gt), "--pred-dir", str(preds), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    # text: page one 1/4, page two 0 -> 0.125; TEDS 1; formula 0.
    assert result["elements"]["text_block"]["Edit_dist.ALL_page_avg"] == pytest.approx(0.125)
    assert result["elements"]["table"]["TEDS.page_avg"] == 1.0
    assert result["elements"]["display_formula"]["Edit_dist.ALL_page_avg"] == 0.0
    assert result["attributes"]["language: english"]["text_edit"] == pytest.approx(0.25)
    assert result["overall"] == pytest.approx((87.5 + 100 + 100) / 3)
    assert result["skipped"] == ["three.png"] and "skipped" in printed and "Overall" in printed
    assert omnidocbench.main(["--gt", str(gt), "--pred-dir", str(preds), "--filter", "language=english"]) == 0


def test_omnidocbench_cli_bad_input_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    assert omnidocbench.main(["--gt", str(bad), "--pred-dir", str(tmp_path)]) == 2
    assert "not an OmniDocBench ground truth" in capsys.readouterr().err
    gt, _ = _write_benchmark(tmp_path)
    assert omnidocbench.main(["--gt", str(gt), "--pred-dir", str(tmp_path / "missing")]) == 2


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
    # normalized "\alpha+b" vs "\alpha+c": 1 character of 8 -> 1 - 1/8.
    assert pairwise_consistency([r"\alpha + b", r"\alpha + c"], "formula") == pytest.approx(7 / 8)
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


def test_fenced_code_blocks_score_as_text_and_a_verbatim_prediction_is_perfect():
    gt = "A listing follows.\n\n```text\nfor x in range(3):\n    print(x)\n```"
    assert score_page(gt, gt).text_edit == 0.0
    assert 0.0 < score_page("A listing follows.\n\nfor x in range(3):\n    print(x)", gt).text_edit < 0.2
    assert score_page("A listing follows.", gt).text_edit > 0.5
