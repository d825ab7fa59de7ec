"""Score Markdown predictions against an OmniDocBench ground-truth JSON, with the v1.5 definitions.

    python -m components.evaluation.omnidocbench --gt OmniDocBench.json --pred-dir DIR
        [--filter language=english ...] [--out result.json] [--formula-metric auto|cdm|edit]
    python -m components.evaluation.omnidocbench --gt OmniDocBench.json --pred-dir DIR --predict \\
        --images DIR [--model DIR] [--decoder ar] [--max-new-tokens 1024]
    python -m components.evaluation.omnidocbench --from-pages PAGES_DIR --gt OUT.json ...

``--from-pages`` first writes one of our page folders as an OmniDocBench ground truth (headers
and page numbers included as the ignored categories they are), so our held-out sets can be run
through the official tooling too.

A page's prediction is ``DIR/<image name without extension>.md`` (also ``.mmd`` and
``<image name>.md``, as the official loader looks); pages without one are skipped with a
warning, as the official code does. ``--predict`` first decodes every page image with one of
our models (the shipped base by default) into ``DIR``, keeping predictions already there.

Prints the official result table — per element (text, display formula, table, reading order:
edit distance as page average, whole-set and sample average; TEDS and TEDS-S) and per page
attribute (``data_source``, ``language``, ``layout``, special issues) — and Overall =
((1 − text edit)·100 + TEDS·100 + formula)/3, the formula term being CDM·100 (the leaderboard's,
:mod:`components.metrics.cdm`) where pdflatex and Ghostscript are installed or
``--formula-metric cdm`` asks for it, else (1 − formula edit)·100, the fallback; the printed
Overall names which.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from components.data.page_store import PageDataset
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.metrics.cdm import ToolchainMissing
from components.metrics.page import (
    PageScores,
    aggregate_scores,
    gt_elements_from_page,
    page_edit,
    resolve_formula_metric,
    score_page_elements,
)

PRED_SUFFIXES = (".md", ".mmd")


@dataclass
class OmniDocBenchResult:
    """Per-element and per-attribute numbers of one evaluation, plus the page scores behind them."""

    elements: dict[str, dict[str, float | None]]
    attributes: dict[str, dict[str, float | None]]
    overall: float | None
    n_pages: int
    skipped: list[str]
    pages: dict[str, PageScores]
    formula_metric: str = "edit"  # the Overall's formula term: "cdm" or the "edit" fallback

    def as_dict(self) -> dict:
        return {"overall": self.overall, "formula_metric": self.formula_metric, "n_pages": self.n_pages,
                "skipped": self.skipped, "elements": self.elements, "attributes": self.attributes}


def load_ground_truth(path: Path, filters: dict[str, str] | None = None) -> list[dict]:
    """OmniDocBench.json pages, keeping those whose page attributes equal every filter."""
    try:
        pages = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read OmniDocBench ground truth {path}: {error}") from error
    if not isinstance(pages, list) or any(not isinstance(p, dict) or "layout_dets" not in p for p in pages):
        raise ValueError(f"{path} is not an OmniDocBench ground truth: expected a list of pages with 'layout_dets'")
    filters = filters or {}
    return [p for p in pages if all(str(p.get("page_info", {}).get("page_attribute", {}).get(k)) == v
                                    for k, v in filters.items())]


_OMNIDOCBENCH_CATEGORY = {"header": "header", "footer": "page_number", "title": "title", "text": "text_block",
                          "table": "table", "formula": "equation_isolated", "code": "code_txt", "figure": "figure"}
_CONTENT_FIELD = {"table": "html", "equation_isolated": "latex"}


def ground_truth_from_pages(pages_dir: Path) -> list[dict]:
    """Our page folder as OmniDocBench.json pages (``layout_dets`` in reading order)."""

    out = []
    for page in PageDataset(pages_dir).pages():
        dets = []
        for element in page.elements:
            category = _OMNIDOCBENCH_CATEGORY.get(element.category)
            if category is None:
                continue
            x0, y0, x1, y1 = element.bbox
            dets.append({"category_type": category, _CONTENT_FIELD.get(category, "text"): element.content,
                         "order": len(dets) + 1, "anno_id": len(dets), "poly": [x0, y0, x1, y0, x1, y1, x0, y1],
                         "ignore": False, "attribute": {}})
        out.append({"layout_dets": dets, "extra": {"relation": []},
                    "page_info": {"image_path": Path(page.image).name, "width": page.width, "height": page.height,
                                  "page_attribute": {"data_source": page.source, "language": "english"}}})
    return out


def image_name(page: dict) -> str:
    return Path(page.get("page_info", {}).get("image_path", "")).name


def prediction_path(pred_dir: Path, name: str) -> Path | None:
    """The official lookup order: ``stem.md``, ``stem.mmd``, ``name.md``."""
    stem = name.rsplit(".", 1)[0]
    for candidate in (pred_dir / f"{stem}.md", pred_dir / f"{stem}.mmd", pred_dir / f"{name}.md"):
        if candidate.exists():
            return candidate
    return None


def _attribute_labels(page: dict) -> list[str]:
    labels = ["ALL"]
    for key, value in page.get("page_info", {}).get("page_attribute", {}).items():
        if isinstance(value, list):
            labels += [str(issue) for issue in value if "table" not in str(issue)]
        else:
            labels.append(f"{key}: {value}")
    return labels


def _element_table(pages: Iterable[PageScores]) -> dict[str, dict[str, float | None]]:
    pages = list(pages)

    def edit_numbers(samples_of) -> dict[str, float | None]:
        per_page = [samples_of(p) for p in pages]
        page_values = [value for value in map(page_edit, per_page) if value is not None]
        flat = [s for ss in per_page for s in ss if s.upper_len]
        return {
            "Edit_dist.ALL_page_avg": sum(page_values) / len(page_values) if page_values else None,
            "Edit_dist.edit_whole": page_edit(flat),
            "Edit_dist.edit_sample_avg": sum(s.edits / s.upper_len for s in flat) / len(flat) if flat else None,
        }

    tables = [t for p in pages for t in p.table_samples]
    table_pages = [p for p in pages if p.table_samples]
    table = edit_numbers(lambda p: [t.edit for t in p.table_samples])
    table |= {
        "TEDS.all": sum(t.teds for t in tables) / len(tables) if tables else None,
        "TEDS_structure_only.all": sum(t.teds_s for t in tables) / len(tables) if tables else None,
        "TEDS.page_avg": sum(p.table_teds for p in table_pages) / len(table_pages) if table_pages else None,
        "TEDS_structure_only.page_avg": (sum(p.table_teds_s for p in table_pages) / len(table_pages)
                                         if table_pages else None),
    }
    return {
        "text_block": edit_numbers(lambda p: p.text_samples + p.formula_as_text if p.text_edit is not None else []),
        "display_formula": edit_numbers(lambda p: p.formula_samples),
        "table": table,
        "reading_order": edit_numbers(lambda p: [p.reading_order] if p.reading_order else []),
    }


def _attribute_table(pages: dict[str, PageScores], gt_pages: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    by_label: dict[str, list[PageScores]] = defaultdict(list)
    for name, scores in pages.items():
        for label in _attribute_labels(gt_pages[name]):
            by_label[label].append(scores)

    def mean(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else None

    return {
        label: {
            "text_edit": mean([p.text_edit for p in group]),
            "formula_edit": mean([p.formula_edit for p in group]),
            "table_teds": mean([p.table_teds for p in group]),
            "table_teds_s": mean([p.table_teds_s for p in group]),
            "reading_order_edit": mean([p.reading_order_edit for p in group]),
        }
        for label, group in sorted(by_label.items())
    }


def evaluate(gt_pages: list[dict], pred_dir: Path, formula_metric: str = "edit") -> OmniDocBenchResult:
    """Score every page that has a prediction; the numbers follow OmniDocBench v1.5 (``formula_metric``:
    "cdm", "edit" or "auto", the Overall's formula term)."""
    formula_metric = resolve_formula_metric(formula_metric)
    scored: dict[str, PageScores] = {}
    by_name: dict[str, dict] = {}
    skipped: list[str] = []
    for page in gt_pages:
        name = image_name(page)
        path = prediction_path(pred_dir, name)
        if path is None:
            skipped.append(name)
            continue
        scored[name] = score_page_elements(path.read_text(encoding="utf-8", errors="replace"),
                                           gt_elements_from_page(page), page.get("page_info", {}).get("page_attribute"))
        by_name[name] = page
    dataset = aggregate_scores(scored.values(), formula_metric)
    pages = dict(zip(scored, dataset.pages, strict=True))
    elements = _element_table(pages.values())
    if dataset.formula_cdm is not None:
        elements["display_formula"]["CDM.all"] = dataset.formula_cdm
    return OmniDocBenchResult(elements=elements, attributes=_attribute_table(pages, by_name),
                              overall=dataset.overall, n_pages=len(pages), skipped=skipped, pages=pages,
                              formula_metric=formula_metric)


def predict(gt_pages: list[dict], images_dir: Path, pred_dir: Path, model_dir: Path, decoder: str,
            max_new_tokens: int) -> int:
    """Decode each page image with our engine into ``pred_dir/<stem>.md``; returns how many were written."""

    engine = DecodingEngine.from_pretrained(model_dir)
    params = DecodeParams(decoder=decoder, max_new_tokens=max_new_tokens)
    engine.check_params(params)
    pred_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    for page in gt_pages:
        name = image_name(page)
        target = pred_dir / f"{name.rsplit('.', 1)[0]}.md"
        if target.exists():
            continue
        image_path = images_dir / name
        try:
            with Image.open(image_path) as image:
                image = image.convert("RGB")
        except OSError as error:
            print(f"skipping {name}: cannot read {image_path}: {error}", file=sys.stderr)
            continue
        target.write_text(engine.generate([image], params)[0].text, encoding="utf-8")
        written += 1
    return written


def format_result(result: OmniDocBenchResult) -> str:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    lines = [f"OmniDocBench v1.5 end-to-end, quick_match, {result.n_pages} pages"]
    for element, numbers in result.elements.items():
        lines.append(f"\n[{element}]")
        lines += [f"  {metric:<32} {fmt(value)}" for metric, value in numbers.items()]
    header = f"\n{'page attribute':<32} {'text edit':>9} {'formula':>9} {'TEDS':>7} {'TEDS-S':>7} {'order':>7}"
    lines.append(header)
    for label, row in result.attributes.items():
        lines.append(f"{label:<32} {fmt(row['text_edit']):>9} {fmt(row['formula_edit']):>9} "
                     f"{fmt(row['table_teds']):>7} {fmt(row['table_teds_s']):>7} {fmt(row['reading_order_edit']):>7}")
    overall = "-" if result.overall is None else f"{result.overall:.2f}"
    term = "CDM" if result.formula_metric == "cdm" else "1 - edit distance, the fallback: CDM not run"
    lines.append(f"\nOverall (formula term = {term}): {overall}")
    if result.skipped:
        lines.append(f"warning: {len(result.skipped)} pages had no prediction and were skipped, e.g. {result.skipped[:3]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gt", type=Path, required=True, help="OmniDocBench.json")
    parser.add_argument("--pred-dir", type=Path, required=True, help="folder of <page>.md predictions")
    parser.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE", help="page attribute filter")
    parser.add_argument("--out", type=Path, help="write the numbers as JSON")
    parser.add_argument("--predict", action="store_true", help="decode the page images with our model first")
    parser.add_argument("--images", type=Path, help="folder of the dataset's page images (with --predict)")
    parser.add_argument("--model", type=Path, default=Path("models/pretrained/docmarkup-base"))
    parser.add_argument("--decoder", default="ar")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--from-pages", type=Path, help="write this page folder as the --gt JSON first")
    parser.add_argument("--formula-metric", choices=("auto", "cdm", "edit"), default="auto",
                        help="the Overall's formula term: CDM (needs ./run setup --cdm), the edit fallback, "
                             "or auto (CDM where installed)")
    args = parser.parse_args(argv)

    if args.from_pages:
        args.gt.parent.mkdir(parents=True, exist_ok=True)
        args.gt.write_text(json.dumps(ground_truth_from_pages(args.from_pages), ensure_ascii=False))
        print(f"wrote {args.gt} from {args.from_pages}")

    try:
        filters = dict(item.split("=", 1) for item in args.filter)
    except ValueError:
        parser.error("--filter takes KEY=VALUE")
    try:
        gt_pages = load_ground_truth(args.gt, filters)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.predict:
        if args.images is None:
            parser.error("--predict needs --images DIR")
        written = predict(gt_pages, args.images, args.pred_dir, args.model, args.decoder, args.max_new_tokens)
        print(f"decoded {written} pages into {args.pred_dir}")
    elif not args.pred_dir.is_dir():
        print(f"error: prediction folder {args.pred_dir} does not exist", file=sys.stderr)
        return 2
    try:
        result = evaluate(gt_pages, args.pred_dir, args.formula_metric)
    except ToolchainMissing as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_result(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result.as_dict(), indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
