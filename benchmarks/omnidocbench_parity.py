"""Our OmniDocBench v1.5 metrics side by side with the official evaluation code, page by page.

    python -m benchmarks.omnidocbench_parity --official DIR --official-python PY [--pages 64] [--seed 91000000]
                                             [--pred-dir DIR [--gt OmniDocBench.json]] [--out FILE]

``DIR`` is a checkout of OmniDocBench at commit 7bd6c2e (the mirror ``pichiu/OmniDocBench``);
``PY`` a Python with its requirements (Levenshtein, apted, lxml, beautifulsoup4, pylatexenc
3.0a30, scipy, pandas, loguru, tabulate, func-timeout, tqdm, matplotlib, pyyaml). Held-out
synthetic pages become an ``OmniDocBench.json`` (with headers, page numbers, captions,
truncated paragraphs and inline math added) and each gets a predicted ``.md`` made by
perturbing the ground truth in the ways models err and format: character noise, split,
merged, dropped, reordered and invented blocks, ``$$``/``\\[``/``$``/``\\(`` formulas with
``\\mathrm``/``\\tag``/``\\left``, HTML tables with ``th``/``thead``/``<b>``/full-width text,
Markdown pipe tables, headers the model kept. With ``--gt`` and ``--pred-dir`` any
OmniDocBench-format set is compared instead (the real benchmark, or our held-out pages
written by ``components.evaluation.omnidocbench --from-pages`` and decoded by ``--predict``).

The official code runs in a subprocess (``End2EndDataset`` with quick_match, ``End2EndEval``);
ours runs here. It prints, per metric, the largest per-page difference and the dataset values
of both, and exits 1 when any differs by more than 0.005.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from components.data.synthetic import SyntheticConfig, generate_page
from components.metrics.matching import Element
from components.metrics.page import (
    aggregate_scores,
    gt_elements_from_page,
    overall_score,
    score_page_elements,
)
from components.services.process import VAR_DIR

TOLERANCE = 0.005
METRICS = ("text_edit", "table_teds", "table_teds_s", "formula_edit", "reading_order_edit")

_OFFICIAL_DRIVER = textwrap.dedent("""
    import json, os, sys, types
    repo, gt, preds = sys.argv[1:4]
    os.makedirs("result", exist_ok=True)
    sys.path.insert(0, repo)
    sys.modules["evaluate"] = types.ModuleType("evaluate")      # BLEU/METEOR only, not used here
    cdm = types.ModuleType("metrics.cdm_metric"); cdm.CDM = object  # CDM needs LaTeX; not run here
    sys.modules["metrics.cdm_metric"] = cdm
    mmeval = types.ModuleType("mmeval"); mmeval.COCODetection = object  # layout detection task only
    sys.modules["mmeval"] = mmeval
    from dataset.end2end_dataset import End2EndDataset
    from task.end2end_run_eval import End2EndEval
    cfg = {"dataset": {"ground_truth": {"data_path": gt}, "prediction": {"data_path": preds}, "match_method": "quick_match"}}
    metrics = {"text_block": {"metric": ["Edit_dist"]}, "display_formula": {"metric": ["Edit_dist"]},
               "table": {"metric": ["TEDS", "Edit_dist"]}, "reading_order": {"metric": ["Edit_dist"]}}
    End2EndEval(End2EndDataset(cfg), metrics, gt, "parity")
""")


# --- ground truth and predictions ----------------------------------------------------------------

def _noisy(text: str, rng: random.Random, rate: float) -> str:
    chars = list(text)
    for i in range(len(chars)):
        roll = rng.random()
        if roll < rate / 3:
            chars[i] = rng.choice("abcdefghijklmnopqrstuvwxyz0123456789.,")
        elif roll < 2 * rate / 3:
            chars[i] = ""
        elif roll < rate:
            chars[i] += rng.choice("abcdefghij ,.;")
    return "".join(chars)


def build_page(seed: int, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """OmniDocBench ``layout_dets`` (and truncation relations) for one synthetic page."""
    page, _ = generate_page(seed, SyntheticConfig.preset(rng.choice(["tiny", "standard"])))
    dets: list[dict] = []
    relations: list[dict] = []

    def add(category: str, field: str, value: str) -> None:
        dets.append({"category_type": category, field: value, "order": len(dets) + 1, "anno_id": len(dets),
                     "attribute": {}, "poly": [0, 0, 1, 0, 1, 1, 0, 1]})

    for element in page.elements:
        if element.category == "header":
            add("header", "text", element.content)
        elif element.category == "footer":
            add("page_number", "text", element.content)
        elif element.category == "title":
            add("title", "text", element.content)
        elif element.category == "table":
            add("table", "html", element.content)
        elif element.category == "formula":
            add("equation_isolated", "latex", element.content)
        else:
            text = element.content
            if rng.random() < 0.3:
                words = text.split()
                at = rng.randrange(len(words) + 1)
                text = " ".join([*words[:at], rng.choice(["$x^{2}$", "$\\alpha_i$", "$n=3$", "\\(\\beta\\)"]), *words[at:]])
            if rng.random() < 0.2 and len(text.split()) > 6:
                words = text.split()
                cut = len(words) // 2
                add("text_block", "text", " ".join(words[:cut]))
                add("text_block", "text", " ".join(words[cut:]))
                relations.append({"source_anno_id": len(dets) - 2, "target_anno_id": len(dets) - 1,
                                  "relation_type": "truncated"})
            else:
                add("text_block", "text", text)
    if rng.random() < 0.3:
        add("figure_caption", "text", "Figure 1: " + " ".join(rng.sample(["a", "plot", "of", "data", "results"], 3)))
    return dets, relations


def _pred_table(html: str, rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.2:  # Markdown pipe table

        rows = re.findall(r"<tr>(.*?)</tr>", html, re.S)
        cells = [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S) for row in rows]
        if cells and all(cells):
            lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
            lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
            return "\n".join(lines)
    if roll < 0.4:
        html = html.replace("<td>", "<th>", 2).replace("</td>", "</th>", 2)
        html = html.replace("<table>", "<table><thead>", 1).replace("</table>", "</thead></table>", 1)
    if roll < 0.5:
        html = html.replace("<td>", "<td><b>", 1).replace("</td>", "</b></td>", 1)
    if roll < 0.6:
        html = html.replace("1", "１").replace("a", "ａ", 1)
    if rng.random() < 0.5:
        html = html.replace("</td>", "x</td>", 1) if rng.random() < 0.5 else _noisy(html, rng, 0.01)
    return html


def _pred_formula(latex: str, rng: random.Random) -> str:
    if rng.random() < 0.3:
        latex = rng.choice(["\\mathrm{d} ", "\\left( x \\right) + ", ""]) + latex + rng.choice([" \\tag{1}", " \\quad", ""])
    if rng.random() < 0.4:
        latex = _noisy(latex, rng, 0.05)
    if rng.random() < 0.2:
        latex = latex.upper()
    wrapper = rng.choice(["$$\n{}\n$$", "\\[{}\\]", "$${}$$", "${}$", "\\({}\\)"])
    return wrapper.format(latex)


def build_prediction(dets: list[dict], rng: random.Random) -> str:
    """A predicted page: the ground truth rendered with the errors and formats models produce."""
    blocks: list[str] = []
    for det in sorted(dets, key=lambda d: d["order"]):
        category = det["category_type"]
        if category in ("header", "page_number", "figure_caption") and rng.random() < 0.5:
            continue
        if rng.random() < 0.07:
            continue  # dropped block
        if category == "table":
            blocks.append(_pred_table(det["html"], rng))
        elif category == "equation_isolated":
            blocks.append(_pred_formula(det["latex"], rng))
        else:
            text = _noisy(det["text"], rng, rng.choice([0.0, 0.02, 0.1, 0.4]))
            if category == "title":
                text = "# " + text
            if rng.random() < 0.15 and len(text) > 20:
                cut = len(text) // 2
                blocks.extend([text[:cut], text[cut:]])
                continue
            if rng.random() < 0.1:
                text = f"**{text}**"
            blocks.append(text)
    if len(blocks) > 2 and rng.random() < 0.3:
        i = rng.randrange(len(blocks) - 1)
        blocks[i], blocks[i + 1] = blocks[i + 1], blocks[i]
    if len(blocks) > 2 and rng.random() < 0.15:
        i = rng.randrange(len(blocks) - 1)
        blocks[i:i + 2] = [blocks[i] + " " + blocks[i + 1]]
    if rng.random() < 0.2:
        blocks.insert(rng.randrange(len(blocks) + 1), "Invented paragraph that is not on the page at all.")
    if rng.random() < 0.1:
        blocks.append("<table><tr><td>extra</td><td>9</td></tr></table>")
    return "\n\n".join(blocks)


def write_dataset(root: Path, n_pages: int, seed: int, pred_dir: Path | None) -> tuple[Path, Path, list[dict]]:
    rng = random.Random(seed)
    pages, preds_root = [], pred_dir or root / "pred"
    preds_root.mkdir(parents=True, exist_ok=True)
    for index in range(n_pages):
        name = f"page_{seed + index}"
        dets, relations = build_page(seed + index, rng)
        pages.append({"layout_dets": dets, "extra": {"relation": relations},
                      "page_info": {"image_path": f"{name}.png", "page_no": index,
                                    "page_attribute": {"data_source": rng.choice(["academic", "book"]),
                                                       "language": "english"}}})
        if pred_dir is None:
            (preds_root / f"{name}.md").write_text(build_prediction(dets, rng))
    gt_path = root / "OmniDocBench.json"
    gt_path.write_text(json.dumps(pages, ensure_ascii=False))
    return gt_path, preds_root, pages


# --- both sides -----------------------------------------------------------------------------------

def ours(gt_pages: list[dict], pred_dir: Path) -> tuple[dict[str, dict], dict]:
    per_page, scored = {}, []
    for page in gt_pages:
        name = Path(page["page_info"]["image_path"]).stem
        pred_file = pred_dir / f"{name}.md"
        elements: list[Element] = gt_elements_from_page(page)
        scores = score_page_elements(pred_file.read_text() if pred_file.exists() else "", elements)
        scored.append(scores)
    dataset = aggregate_scores(scored)
    for page, scores in zip(gt_pages, dataset.pages, strict=True):
        name = Path(page["page_info"]["image_path"]).stem
        per_page[name] = {metric: getattr(scores, metric) for metric in METRICS}
    return per_page, {metric: getattr(dataset, metric) for metric in (*METRICS, "overall")}


def official(repo: Path, python: str, gt_path: Path, pred_dir: Path, work: Path) -> tuple[dict[str, dict], dict]:
    driver = work / "official_driver.py"
    driver.write_text(_OFFICIAL_DRIVER)
    run = subprocess.run([python, str(driver), str(repo), str(gt_path), str(pred_dir)], cwd=work,
                         capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(f"official evaluation failed:\n{run.stderr[-3000:]}")
    result = work / "result"
    per_page: dict[str, dict] = {}

    def page_values(element: str, metric: str) -> None:
        path = result / f"parity_{element}_per_page_edit.json"
        if path.exists():
            for image, value in json.loads(path.read_text()).items():
                per_page.setdefault(Path(image).stem, {})[metric] = value

    page_values("text_block", "text_edit")
    page_values("display_formula", "formula_edit")
    page_values("reading_order", "reading_order_edit")
    tables: dict[str, list] = {}
    for sample in json.loads((result / "parity_table_result.json").read_text()):
        tables.setdefault(Path(sample["img_id"]).stem, []).append(sample["metric"])
    for name, scores in tables.items():
        per_page.setdefault(name, {})["table_teds"] = sum(s["TEDS"] for s in scores) / len(scores)
        per_page[name]["table_teds_s"] = sum(s["TEDS_structure_only"] for s in scores) / len(scores)
    summary = json.loads((result / "parity_metric_result.json").read_text())

    def all_page(element: str) -> float | None:
        value = summary.get(element, {}).get("all", {}).get("Edit_dist", {}).get("ALL_page_avg")
        return None if value in (None, "NaN") else float(value)

    page_split = summary.get("table", {}).get("page", {})
    dataset = {
        "text_edit": all_page("text_block"),
        "formula_edit": all_page("display_formula"),
        "reading_order_edit": all_page("reading_order"),
        "table_teds": page_split.get("TEDS", {}).get("ALL"),
        "table_teds_s": page_split.get("TEDS_structure_only", {}).get("ALL"),
    }
    dataset["overall"] = overall_score(dataset["text_edit"], dataset["table_teds"], dataset["formula_edit"])
    return per_page, dataset


def compare(ours_pages, ours_dataset, official_pages, official_dataset) -> tuple[dict, list[str]]:
    report, failures = {}, []
    for metric in METRICS:
        diffs = []
        for name in sorted(set(ours_pages) | set(official_pages)):
            a, b = ours_pages.get(name, {}).get(metric), official_pages.get(name, {}).get(metric)
            if a is None and b is None:
                continue
            if a is None or b is None:
                failures.append(f"{name} {metric}: ours {a} official {b}")
                diffs.append(float("inf"))
                continue
            diffs.append(abs(a - b))
            if abs(a - b) > TOLERANCE:
                failures.append(f"{name} {metric}: ours {a:.4f} official {b:.4f}")
        report[metric] = {"pages": len(diffs), "max_page_diff": max(diffs) if diffs else 0.0,
                          "ours": ours_dataset.get(metric), "official": official_dataset.get(metric)}
    for metric in (*METRICS, "overall"):
        a, b = ours_dataset.get(metric), official_dataset.get(metric)
        scale = 100.0 if metric == "overall" else 1.0
        if (a is None) != (b is None) or (a is not None and abs(a - b) > TOLERANCE * scale):
            failures.append(f"dataset {metric}: ours {a} official {b}")
    report["overall"] = {"ours": ours_dataset.get("overall"), "official": official_dataset.get("overall")}
    return report, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", type=Path, required=True, help="OmniDocBench checkout (commit 7bd6c2e)")
    parser.add_argument("--official-python", default=sys.executable, help="a Python with its requirements")
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--seed", type=int, default=91_000_000)
    parser.add_argument("--pred-dir", type=Path, help="real predictions <page>.md instead of perturbations")
    parser.add_argument("--gt", type=Path, help="an OmniDocBench.json to use (with --pred-dir) instead of synthetic pages")
    parser.add_argument("--out", type=Path, default=VAR_DIR / "bench" / "omnidocbench_parity.json")
    parser.add_argument("--keep", type=Path, help="keep the generated data and the official results here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="odb-parity-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.gt:
            if not args.pred_dir:
                parser.error("--gt needs --pred-dir")
            gt_path, pred_dir = args.gt.resolve(), args.pred_dir.resolve()
            gt_pages = json.loads(gt_path.read_text())
        else:
            gt_path, pred_dir, gt_pages = write_dataset(work, args.pages, args.seed, args.pred_dir)
        official_pages, official_dataset = official(args.official.resolve(), args.official_python, gt_path, pred_dir, work)
        ours_pages, ours_dataset = ours(gt_pages, pred_dir)
    report, failures = compare(ours_pages, ours_dataset, official_pages, official_dataset)

    source = f"{args.gt} + {args.pred_dir}" if args.gt else f"{args.pages} synthetic pages (seed {args.seed})"
    print(f"{source}, tolerance {TOLERANCE}\n")
    print(f"{'metric':<20} {'pages':>5} {'max page diff':>14} {'ours':>10} {'official':>10}")
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    for metric, row in report.items():
        print(f"{metric:<20} {row.get('pages', '')!s:>5} {fmt(row.get('max_page_diff')):>14} "
              f"{fmt(row['ours']):>10} {fmt(row['official']):>10}")
    for failure in failures[:40]:
        print("DIFF", failure)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"pages": args.pages, "seed": args.seed, "report": report, "failures": failures}, indent=2))
    print(f"\n{'PARITY' if not failures else f'{len(failures)} differences'}; report in {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
