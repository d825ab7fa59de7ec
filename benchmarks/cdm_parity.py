"""Our CDM beside the official CDM code, formula pair by formula pair.

    python -m benchmarks.cdm_parity --official DIR --official-python PY [--out FILE]

``DIR`` is a checkout of UniMERNet (github ``opendatalab/UniMERNet``; its ``cdm/`` folder is what
OmniDocBench runs for CDM); ``PY`` a Python with that folder's requirements (numpy<2,
scikit-image 0.20, opencv-python, scipy, matplotlib, tqdm). The official code needs Node.js,
``pdflatex`` and ImageMagick's ``magick`` with PDF reading allowed (Debian's ImageMagick 6 has
``convert`` and forbids PDF in ``/etc/ImageMagick-6/policy.xml``: this script puts a ``magick``
that calls ``convert`` on the official run's PATH; the policy line is the operator's to change).

The pairs cover what CDM is for: identical formulas, the same formula spelled compactly, one
symbol changed, reordered terms, ``\\mathrm`` against plain letters, ``\\frac`` against ``/``,
spacing macros, ``\\left``/``\\right`` against bare delimiters, matrices, cases, primes, text,
named operators, broken LaTeX, an empty prediction and a formula of over 1,300 tokens. It prints
each pair's two scores and exits 1 when any differs by more than 0.01.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from components.metrics.cdm import cdm_scores

TOLERANCE = 0.01

BASE = [
    r"E = m c ^ { 2 }",
    r"\frac { a + b } { 2 } = \sqrt { x ^ { 2 } + y ^ { 2 } }",
    r"\sum _ { i = 1 } ^ { n } x _ { i } ^ { 2 }",
    r"\int _ { 0 } ^ { \infty } e ^ { - x ^ { 2 } } d x = \frac { \sqrt { \pi } } { 2 }",
    r"f ( x ) = \alpha x + \beta",
    r"\mathbf { A } \mathbf { x } = \mathbf { b }",
    r"\left( \frac { 1 } { n } \right) ^ { k }",
    r"\hat { y } = \arg \max _ { y } p ( y | x )",
    r"\lim _ { n \to \infty } \left( 1 + \frac { 1 } { n } \right) ^ { n } = e",
    r"\begin{array} { c c } { a } & { b } \\ { c } & { d } \end{array}",
    r"\sin ^ { 2 } \theta + \cos ^ { 2 } \theta = 1",
    r"\nabla \cdot \vec { E } = \frac { \rho } { \varepsilon _ { 0 } }",
    r"P ( A \mid B ) = \frac { P ( B \mid A ) P ( A ) } { P ( B ) }",
    r"\mathcal { L } = - \sum _ { c } y _ { c } \log \hat { y } _ { c }",
    r"x _ { 1 , 2 } = \frac { - b \pm \sqrt { b ^ { 2 } - 4 a c } } { 2 a }",
    r"\| \mathbf { v } \| _ { 2 } \leq 1",
    r"\overline { z } = a - i b",
    r"\mathrm { K L } ( p \| q ) = \sum p \log \frac { p } { q }",
    r"a _ { n + 1 } = a _ { n } + d",
    r"\binom { n } { k } = \frac { n ! } { k ! ( n - k ) ! }",
    r"\sqrt [ 3 ] { 8 } = 2",
    r"\phi ( t ) = \exp \left( - \frac { t ^ { 2 } } { 2 \sigma ^ { 2 } } \right)",
    r"y = 2 z + 3 x",
    r"\forall \epsilon > 0 , \exists \delta > 0",
    r"\tilde { x } _ { t } = \gamma \tilde { x } _ { t - 1 } + ( 1 - \gamma ) x _ { t }",
]

PAIRS: list[tuple[str, str, str]] = [(f"identical_{i}", f, f) for i, f in enumerate(BASE)]
PAIRS += [(f"compact_{i}", f, f.replace(" ", "")) for i, f in enumerate(BASE[:10])]
PAIRS += [
    ("one_symbol_0", BASE[0], r"E = m c ^ { 3 }"),
    ("one_symbol_1", BASE[4], r"f ( x ) = \alpha x + \gamma"),
    ("one_symbol_2", BASE[18], r"a _ { n + 1 } = a _ { n } - d"),
    ("one_symbol_3", BASE[2], r"\sum _ { i = 0 } ^ { n } x _ { i } ^ { 2 }"),
    ("one_symbol_4", BASE[14], r"x _ { 1 , 2 } = \frac { - b \pm \sqrt { b ^ { 2 } - 4 a c } } { 2 b }"),
    ("reordered_0", BASE[22], r"y = 3 x + 2 z"),
    ("reordered_1", BASE[4], r"f ( x ) = \beta + \alpha x"),
    ("reordered_2", r"a + b + c = d", r"c + b + a = d"),
    ("mathrm_0", r"\mathrm { d } x", r"d x"),
    ("mathrm_1", r"\mathrm { K L } ( p \| q )", r"K L ( p \| q )"),
    ("mathrm_2", r"e ^ { \mathrm { i } \pi } = - 1", r"e ^ { i \pi } = - 1"),
    ("frac_slash_0", r"\frac { a } { b }", r"a / b"),
    ("frac_slash_1", r"y = \frac { 1 } { x + 1 }", r"y = 1 / ( x + 1 )"),
    ("frac_slash_2", r"\frac { \partial f } { \partial x }", r"\partial f / \partial x"),
    ("spacing_0", r"a \, b \; c \quad d", r"a b c d"),
    ("spacing_1", r"\int f ( x ) \, d x", r"\int f ( x ) d x"),
    ("spacing_2", r"x \qquad y", r"x \! y"),
    ("left_right_0", r"\left( x + y \right)", r"( x + y )"),
    ("left_right_1", r"\left[ \frac { a } { b } \right]", r"[ \frac { a } { b } ]"),
    ("matrix_0", r"\begin{pmatrix} a & b \\ c & d \end{pmatrix}", r"\left( \begin{array} { c c } a & b \\ c & d \end{array} \right)"),
    ("matrix_1", r"\begin{bmatrix} 1 & 0 \\ 0 & 1 \end{bmatrix}", r"\begin{bmatrix} 1 & 0 \\ 0 & 7 \end{bmatrix}"),
    ("cases_0", r"f ( x ) = \begin{cases} 1 & x > 0 \\ 0 & \text { else } \end{cases}",
     r"f(x)=\begin{cases}1&x>0\\0&\text{otherwise}\end{cases}"),
    ("prime_0", r"f ' ( x ) = 2 x", r"f ^ { \prime } ( x ) = 2 x"),
    ("text_0", r"\text { if } x > 0", r"\mathrm { if } \; x > 0"),
    ("operator_0", r"\operatorname { tr } ( A )", r"\mathrm { tr } ( A )"),
    ("aligned_0", r"\begin{aligned} a & = b \\ c & = d \end{aligned}", r"\begin{aligned} a & = b \\ c & = e \end{aligned}"),
    ("broken_0", BASE[1], r"\frac { a + b } { 2 = \sqrt { x ^ { 2 } + y ^ { 2 } }"),
    ("broken_1", BASE[0], r"E = m c ^ { 2 } \undefinedmacro"),
    ("broken_2", BASE[4], r"f ( x ) = \alpha x + \beta }"),
    ("empty_pred", BASE[0], r""),
    ("dropped_half", BASE[3], r"\int _ { 0 } ^ { \infty } e ^ { - x ^ { 2 } } d x"),
    ("extra_terms", BASE[18], r"a _ { n + 1 } = a _ { n } + d + e + f"),
    ("large_0", "+".join(f"x_{{{i}}}" for i in range(400)), "+".join(f"x_{{{i}}}" for i in range(399))),
]


def official_scores(official: Path, python: str, pairs: list[tuple[str, str, str]]) -> tuple[dict[str, float], float]:
    """Run the official ``cdm/evaluation.py`` on the pairs; F1 per pair name, and its seconds."""
    with tempfile.TemporaryDirectory(prefix="cdm-official-") as work:
        folder = Path(work)
        data = [{"img_id": name, "gt": gt, "pred": pred} for name, gt, pred in pairs]
        (folder / "pairs.json").write_text(json.dumps(data))
        shim = folder / "bin"
        shim.mkdir()
        if not shutil.which("magick"):
            (shim / "magick").write_text('#!/bin/sh\nexec convert "$@"\n')
            (shim / "magick").chmod(0o755)
        env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}
        started = time.perf_counter()
        subprocess.run([python, "evaluation.py", "-i", str(folder / "pairs.json"), "-o", str(folder / "out"), "-p", "2"],
                       cwd=official / "cdm", env=env, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - started
        details = json.loads((folder / "out" / "pairs" / "metrics_res.json").read_text())["details"]
    return {name: entry["F1_score"] for name, entry in details.items()}, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", type=Path, required=True, help="a UniMERNet checkout (its cdm/ folder)")
    parser.add_argument("--official-python", default=sys.executable)
    parser.add_argument("--out", type=Path, default=None, help="write the per-pair table as JSON here")
    args = parser.parse_args(argv)

    theirs, their_seconds = official_scores(args.official, args.official_python, PAIRS)
    started = time.perf_counter()
    ours = cdm_scores([(gt, pred) for _, gt, pred in PAIRS], cache_dir=None, workers=2)
    our_seconds = time.perf_counter() - started
    rows, worst = [], 0.0
    print(f"{'pair':<16} {'official':>8} {'ours':>8}")
    for (name, _, _), mine in zip(PAIRS, ours, strict=True):
        official = theirs.get(name)  # absent: the official code left the pair out (ground truth not rendered)
        if official is None or mine is None:
            difference = 0.0 if official is None and mine is None else 1.0
        else:
            difference = abs(official - mine)
        worst = max(worst, difference)
        rows.append({"pair": name, "official": official, "ours": mine, "difference": difference})
        flag = "  <-- differs" if difference > TOLERANCE else ""
        print(f"{name:<16} {official if official is not None else '-':>8} {mine if mine is not None else '-':>8}{flag}")
    print(f"{len(PAIRS)} pairs; largest difference {worst:.3f} (tolerance {TOLERANCE}); "
          f"official {their_seconds:.1f} s, ours {our_seconds:.1f} s (2 workers, no cache)")
    if args.out:
        args.out.write_text(json.dumps({"pairs": rows, "largest_difference": worst}, indent=1))
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
