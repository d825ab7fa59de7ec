"""CDM, the formula term of OmniDocBench's Overall (components/metrics/cdm).

The expected tokenisations are what the official code's KaTeX normaliser printed for the same
input, and the expected scores are the official code's (benchmarks/cdm_parity.py runs both on
68 pairs). Tests that render need pdflatex and Ghostscript (``./run setup --cdm``; CI installs them).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from components.metrics import aggregate_scores, resolve_formula_metric, score_page
from components.metrics.cdm import cdm_available, cdm_score, cdm_scores
from components.metrics.cdm import rendering as render_module
from components.metrics.cdm.latex import FormulaError, colour_tokens, normalize, tokenize
from components.metrics.cdm.matching import consistent_pairs, f1, same_symbol
from components.metrics.cdm.rendering import document, token_colours

needs_toolchain = pytest.mark.skipif(not cdm_available(), reason="CDM's toolchain is not installed (./run setup --cdm)")


# ----- preparing the LaTeX (no toolchain) ------------------------------------------------------
@pytest.mark.parametrize(("latex", "official"), [
    (r"x^2", r"x ^ { 2 }"),
    (r"\frac12", r"\frac 1 2"),
    (r"\dfrac{1}{2}", r"\frac { 1 } { 2 }"),
    (r"123.45", r"1 2 3 . 4 5"),
    (r"f'(x)=f''(x)", r"f ^ { \prime } ( x ) = f ^ { \prime \prime } ( x )"),
    (r"x^2_i", r"x _ { i } ^ { 2 }"),
    (r"\text{if } x>0", r"\mathrm { i f ~ } x > 0"),
    (r"\mbox{box}", r"\mathrm { b o x }"),
    (r"\lim_{n\to\infty} a_n", r"\operatorname* { l i m } _ { n \to \infty } a _ { n }"),
    (r"\max_y p", r"\operatorname* { m a x } _ { y } p"),
    (r"\log_2 y", r"\log _ { 2 } y"),
    (r"\operatorname{tr}(A)", r"\operatorname { t r } ( A )"),
    (r"\begin{pmatrix} a & b \\ c & d \end{pmatrix}",
     r"\left( \begin{array} { l l } { a } & { b } \\ { c } & { d } \end{array} \right)"),
    (r"f(x)=\begin{cases} 1 & x>0 \\ 0 & \text{else} \end{cases}",
     r"f ( x ) = \left\{ \begin{array} { l l } { 1 } & { x > 0 } \\ { 0 } & { \mathrm { e l s e } } \end{array} \right."),
    (r"\begin{aligned} a &= b \\ c &= d \end{aligned}",
     r"\begin{array} { r l } { a } & { { } = b } \\ { c } & { { } = d } \end{array}"),
    (r"\begin{array}{c|c} a & \\ & \\ b & c \end{array}", r"\begin{array} { c c } { a } & \\ { b } & { c } \end{array}"),
    (r"\overline{AB}", r"\overline { { A B } }"),
    (r"\hat\theta \bar x", r"\hat { \theta } \bar { x }"),
    (r"\sum\limits_{i} x", r"\sum _ { i } x"),
    (r"\sqrt[3]{8}", r"\sqrt [ 3 ] { 8 }"),
    (r"\big( x \big)", r"\big ( x \big )"),
    (r"a \\ b", r"a \, b"),
    (r"{\rm d}x", r"\mathrm { d } x"),
    (r"x^", r"x"),
])
def test_tokenising_prints_what_the_official_katex_normaliser_prints(latex, official):
    assert tokenize(latex) == official


@pytest.mark.parametrize("broken", [r"\frac{a}", r"f ( x ) = \beta }", r"\left( x", r"\color{red}{x}"])
def test_latex_the_normaliser_rejects_stays_as_written(broken):
    assert tokenize(broken) == broken


def test_normalising_spells_named_functions_upright_and_fills_missing_braces_and_unbalanced_latex_fails():
    assert normalize(r"\sin x \ldots \big ( y \big )").split() == \
        r"\mathrm { s i n } x . . . \big( y \big)".split()
    assert normalize(r"\frac 1 2 + \sqrt x").split() == r"\frac { 1 } { 2 } + \sqrt { x }".split()
    with pytest.raises(FormulaError):
        colour_tokens(normalize(r"\frac { a + b } { 2 = x"))


def test_only_visible_tokens_get_a_colour_of_their_own():
    coloured, tokens = colour_tokens(normalize(tokenize(r"\mathrm{K L} \, \left( \frac{x}{2} \right)_{i}")))
    assert tokens == ["K", "L", "\\left(", "\\frac", "x", "2", "\\right)", "i"]
    assert coloured.count("\\mathcolor[RGB]") == len(tokens)
    assert "<color_7>" in coloured and "<color_8>" not in coloured


def test_colours_are_distinct_never_black_and_paper_grows_with_the_formula():
    colours = token_colours(5800)
    assert len(set(colours)) == 5800 and (0, 0, 0) not in colours
    assert colours[:3] == [(0, 0, 15), (0, 0, 30), (0, 0, 45)]
    assert "a5paper" in document("x + y")[0]
    assert "a3paper" in document("+".join(f"x_{{{i}}}" for i in range(450)))[0]


# ----- matching (no toolchain) -------------------------------------------------------------------
def _boxes(tokens: str, shift: tuple[int, int] = (0, 0), scale: float = 1.0) -> list[tuple[str, list[int]]]:
    """Tokens laid out left to right, 30 px apart, optionally shifted and scaled as a whole."""
    out = []
    for k, token in enumerate(tokens.split()):
        x0, y0 = 10 + 30 * k, 20
        box = [x0, y0, x0 + 20, y0 + 25]
        out.append((token, [round(v * scale) + shift[i % 2] for i, v in enumerate(box)]))
    return out


def test_the_same_symbol_spelled_differently_matches():
    assert same_symbol("\\leq") == same_symbol("\\le")
    assert same_symbol("\\left(") == "(" and same_symbol("\\big(") == "("
    assert same_symbol("\\varepsilon") == "\\epsilon" and same_symbol("\\widehat") == "\\hat"
    assert same_symbol("\\left\\langle") == "\\langle"
    gt = _boxes("x \\leq 1")
    assert f1(gt, _boxes("x \\le 1"), (200, 60), (200, 60)) == 1.0


def test_a_shifted_and_scaled_rendering_of_the_same_tokens_scores_one():
    gt = _boxes("a + b = c d e")
    moved = _boxes("a + b = c d e", shift=(40, 12), scale=1.3)
    assert f1(gt, moved, (260, 60), (340, 90)) == 1.0


def test_a_token_that_matches_by_identity_but_not_by_place_is_not_counted():
    gt = _boxes("a b c d e f g h")
    pred = _boxes("a b c d e f g h")
    pred[7] = ("h", [pred[7][1][0], pred[7][1][1] + 400, pred[7][1][2], pred[7][1][3] + 400])  # far below the rest
    pairs = [(k, k) for k in range(8)]
    assert consistent_pairs(pairs, [b for _, b in gt], [b for _, b in pred]).tolist() == [True] * 7 + [False]
    assert f1(gt, pred, (260, 60), (260, 460)) == round(2 * 7 / 16, 3)


def test_different_tokens_never_count_and_an_empty_prediction_scores_zero():
    assert f1(_boxes("x + 1"), _boxes("x - 1"), (120, 60), (120, 60)) == round(2 * 2 / 6, 3)
    assert f1(_boxes("x + 1"), [], (120, 60), (1, 1)) == 0.0


def test_spatial_consistency_is_seeded():
    rng = np.random.default_rng(0)
    gt = [[int(x), 10, int(x) + 9, 30] for x in rng.integers(0, 900, 40)]
    pred = [[b[0] + int(rng.integers(-40, 40)), 10, b[2], 30] for b in gt]
    pairs = [(k, k) for k in range(40)]
    assert consistent_pairs(pairs, gt, pred).tolist() == consistent_pairs(pairs, gt, pred).tolist()


# ----- rendering (toolchain) ---------------------------------------------------------------------
@needs_toolchain
@pytest.mark.parametrize(("gt", "pred", "official"), [
    (r"E = m c ^ { 2 }", r"E=mc^{2}", 1.0),
    (r"E = m c ^ { 2 }", r"E = m c ^ { 3 }", 0.8),
    (r"\mathrm { d } x", r"d x", 1.0),
    (r"\frac { a } { b }", r"a / b", 0.333),
    (r"y = 2 z + 3 x", r"y = 3 x + 2 z", 0.857),
    (r"a \, b \; c \quad d", r"a b c d", 1.0),
    (r"\left( x + y \right)", r"( x + y )", 1.0),
])
def test_cdm_scores_pairs_as_the_official_code_does(tmp_path, gt, pred, official):
    assert cdm_score(gt, pred, cache_dir=tmp_path) == pytest.approx(official, abs=0.01)


@needs_toolchain
def test_predictions_that_cannot_be_rendered_score_zero_and_unrenderable_truth_is_left_out(tmp_path):
    assert cdm_score(r"\frac{a+b}{2}", r"\frac { a + b } { 2 = x", cache_dir=tmp_path) == 0.0  # does not prepare
    assert cdm_score(r"E = m c ^ { 2 }", "", cache_dir=tmp_path) == 0.0
    assert cdm_score("", r"E = m c ^ { 2 }", cache_dir=tmp_path) is None
    assert cdm_score(r"\frac { a } { b", r"\frac { a } { b }", cache_dir=tmp_path) is None


@needs_toolchain
def test_a_formula_wider_than_the_paper_keeps_only_the_tokens_drawn_on_it(tmp_path):
    latex = "+".join(f"x_{{{i}}}" for i in range(700))
    rendering = render_module.render(latex, tmp_path)
    assert rendering is not None and "a3paper" in document(latex)[0]
    assert 0 < len(rendering.drawn()) < len(rendering.tokens)  # the tail runs off the page and draws nothing
    assert cdm_score(latex, latex, cache_dir=tmp_path) == 1.0


@needs_toolchain
def test_a_formula_too_large_for_tex_is_left_out_as_truth_and_scores_zero_as_prediction(tmp_path):
    huge = "+".join(f"x_{{{i}}}" for i in range(1400))  # one line longer than TeX's 200,000-character buffer
    assert render_module.render(huge, tmp_path) is None
    assert cdm_score(huge, "x", cache_dir=tmp_path) is None
    assert cdm_score("x_{0}+x_{1}", huge, cache_dir=tmp_path) == 0.0


@needs_toolchain
def test_renderings_are_cached_by_content(tmp_path, monkeypatch):
    first = render_module.render(r"\sum _ { i } x _ { i }", tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1

    def no_subprocess(*_args, **_kwargs):
        raise AssertionError("a cached formula was rendered again")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert render_module.render(r"\sum _ { i } x _ { i }", tmp_path) == first


@needs_toolchain
def test_the_batch_form_equals_pair_by_pair(tmp_path):
    pairs = [(r"x ^ { 2 }", r"x ^ { 3 }"), (r"\alpha + \beta", r"\alpha + \beta"), (r"x ^ { 2 }", "")]
    assert cdm_scores(pairs, cache_dir=tmp_path, workers=2) == [cdm_score(g, p, cache_dir=tmp_path) for g, p in pairs]


@needs_toolchain
def test_overall_uses_cdm_when_asked_and_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr("components.metrics.cdm.DEFAULT_CACHE", tmp_path)
    gt = "Some words here.\n\n$$\n\\frac { a } { b }\n$$"
    pred = "Some words here.\n\n$$\na / b\n$$"
    page = score_page(pred, gt)
    edit = aggregate_scores([page], "edit")
    cdm = aggregate_scores([page], "cdm")
    assert cdm.formula_metric == "cdm" and cdm.formula_cdm == pytest.approx(0.333, abs=0.001)
    assert cdm.overall == pytest.approx(((1 - cdm.text_edit) * 100 + 0 + 33.3) / 3, abs=0.01)
    assert cdm.overall_formula_edit == pytest.approx(edit.overall)
    assert cdm.as_dict()["formula_metric_cdm"] == 1.0 and edit.as_dict()["formula_metric_cdm"] == 0.0
    assert resolve_formula_metric("auto") == "cdm"
    with pytest.raises(ValueError, match="formula_metric"):
        aggregate_scores([page], "bleu")


@needs_toolchain
def test_a_page_ghostscript_cannot_rasterise_draws_nothing(tmp_path, monkeypatch):
    real_run = subprocess.run

    def failing_gs(command, *args, **kwargs):
        if command[0] == "gs":
            raise subprocess.CalledProcessError(1, command)
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", failing_gs)
    assert render_module.render(r"x ^ { 2 }", None) is None
