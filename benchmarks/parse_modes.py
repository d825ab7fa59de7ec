"""Page mode against element mode (two-stage parsing), interleaved on the same held-out pages.

    python -m benchmarks.parse_modes --page-model DIR --element-model DIR [--pages 32] [--seed N]
        [--decoders ar,sdb] [--repeats 2] [--out var/bench/parse_modes.json]

Contenders, per decoder: the page model reading whole pages; the element model reading each
page's elements (one engine batch per page) with the page's ground-truth boxes; and with
rapid-layout's boxes. On every page all contenders run back to back in rotating order (machine
load hits them alike). Reported per contender: Overall (OmniDocBench), forwards per page, pages/s
(median over repeats, min-max), and against page mode the pages/s ratio; the gap between
ground-truth and rapid-layout boxes is split into recognition error (100 − Overall with
ground-truth boxes) and layout error (ground-truth boxes − rapid-layout boxes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.decoding import benchmark_pages, decoder_names, default_decoders
from components.data.page_store import PageDataset
from components.decoding.engine import DecodingEngine
from components.evaluation.evaluate import assert_held_out
from components.metrics import aggregate_scores, score_page
from components.parsing import ParseSettings, make_layout, read_pages
from components.services.process import VAR_DIR

BENCH_SEED = 950_000


def contenders(page_engine, element_engine, layouts: dict) -> dict:
    """name -> (engine, settings, layout) for every mode compared."""
    out = {"page": (page_engine, None, None)}
    for name, layout in layouts.items():
        out[f"elements/{name}"] = (element_engine, ParseSettings("elements", name), layout)
    return out


def run(page_engine, element_engine, dataset: PageDataset, decoders, repeats: int, layouts: list[str]) -> dict:
    pages = list(dataset.pages())
    images = [dataset.load_image(p) for p in pages]
    built = {name: make_layout(name) for name in layouts}
    report: dict = {"n_pages": len(pages), "repeats": repeats, "decoders": {}}
    for params in decoders:
        modes = contenders(page_engine, element_engine, built)
        names = list(modes)
        seconds = {name: [0.0] * repeats for name in names}
        results: dict[str, list] = {name: [None] * len(pages) for name in names}
        for repeat in range(repeats):
            for index, (page, image) in enumerate(zip(pages, images, strict=True)):
                shift = (index + repeat) % len(names)
                for name in names[shift:] + names[:shift]:
                    engine, settings, layout = modes[name]
                    started = time.perf_counter()
                    [result] = read_pages(engine, [image], params, settings, [page], layout)
                    seconds[name][repeat] += time.perf_counter() - started
                    results[name][index] = result
        rows = {}
        for name in names:
            scores = aggregate_scores([score_page(r.text, p.markup) for r, p in zip(results[name], pages, strict=True)])
            rates = [len(pages) / s for s in seconds[name]]
            rows[name] = {
                "overall": scores.overall, "text_edit": scores.text_edit, "table_teds": scores.table_teds,
                "formula_edit": scores.formula_edit,
                "forwards_per_page": statistics.mean(r.stats.forward_passes for r in results[name]),
                "tokens_per_forward": (sum(r.stats.new_tokens for r in results[name])
                                       / max(1, sum(r.stats.forward_passes for r in results[name]))),
                "pages_per_second": statistics.median(rates), "pages_per_second_min": min(rates),
                "pages_per_second_max": max(rates),
                "elements_per_page": (statistics.mean(len(r.parse.decoded) for r in results[name])
                                      if results[name][0].parse is not None else None),
            }
        for name, row in rows.items():
            ratios = [p / e for p, e in zip(seconds["page"], seconds[name], strict=True)]
            row["pages_per_second_vs_page"] = statistics.median(ratios)
            row["vs_page_min"], row["vs_page_max"] = min(ratios), max(ratios)
        if "elements/ground-truth" in rows and "elements/rapid-layout" in rows:
            gt, detected = rows["elements/ground-truth"]["overall"], rows["elements/rapid-layout"]["overall"]
            report.setdefault("error_split", {})[params.decoder] = {
                "recognition_error": 100.0 - gt, "layout_error": gt - detected}
        report["decoders"][params.decoder] = rows
    return report


def table(report: dict) -> str:
    lines = ["| decoder | mode | Overall | forwards/page | tokens/forward | pages/s (min-max) | vs page |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for decoder, rows in report["decoders"].items():
        for name, r in rows.items():
            lines.append(f"| {decoder} | {name} | {r['overall']:.2f} | {r['forwards_per_page']:.1f} | "
                         f"{r['tokens_per_forward']:.2f} | {r['pages_per_second']:.2f} ({r['pages_per_second_min']:.2f}-"
                         f"{r['pages_per_second_max']:.2f}) | {r['pages_per_second_vs_page']:.2f}x |")
    for decoder, split in report.get("error_split", {}).items():
        lines.append(f"\n{decoder}: recognition error {split['recognition_error']:.2f} points, "
                     f"layout error {split['layout_error']:.2f} points")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-model", required=True, type=Path)
    parser.add_argument("--element-model", required=True, type=Path)
    parser.add_argument("--pages", type=int, default=32)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--pages-dir", type=Path)
    source.add_argument("--seed", type=int, default=BENCH_SEED)
    parser.add_argument("--decoders", default="ar,sdb")
    parser.add_argument("--layouts", default="ground-truth,rapid-layout")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=VAR_DIR / "bench" / "parse_modes.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dataset = PageDataset(args.pages_dir) if args.pages_dir else benchmark_pages(args.pages, seed=args.seed)
    for model in (args.page_model, args.element_model):
        assert_held_out(model, dataset)
    decoders = default_decoders(args.max_new_tokens, 16, 0.95, 32, 16, decoder_names(args.decoders))
    report = run(DecodingEngine.from_pretrained(args.page_model), DecodingEngine.from_pretrained(args.element_model),
                 dataset, decoders, args.repeats, [name for name in args.layouts.split(",") if name])
    report |= {"page_model": str(args.page_model), "element_model": str(args.element_model),
               "threads": args.threads}
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
