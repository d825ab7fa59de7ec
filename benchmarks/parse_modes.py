"""Page mode against element mode (two-stage parsing), interleaved on the same held-out pages.

    python -m benchmarks.parse_modes --page-model DIR --element-model DIR [--pages 32] [--seed N]
        [--decoders ar,sdb] [--repeats 2] [--out var/bench/parse_modes.json]

Contenders, per decoder: the page model reading whole pages; the element model reading each
page's elements (one engine batch per page) with the page's ground-truth boxes; and with
rapid-layout's boxes. On every page all contenders run back to back in rotating order (machine
load hits them alike). Reported per contender: Overall (OmniDocBench), forwards per page, pages/s
(median over repeats, min-max), and against page mode the pages/s ratio; the gap between
ground-truth and rapid-layout boxes is split into recognition error (100 − Overall with
ground-truth boxes) and layout error (ground-truth boxes − rapid-layout boxes). The comparison
itself is :mod:`components.evaluation.parse_modes` (the demo runs it too).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.decoding import benchmark_pages, decoder_names, default_decoders
from components.data.page_store import PageDataset
from components.decoding.engine import DecodingEngine
from components.evaluation.evaluate import assert_held_out
from components.evaluation.parse_modes import compare_parse_modes, table
from components.services.process import VAR_DIR

BENCH_SEED = 950_000


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
    pages = list(dataset.pages())
    report = compare_parse_modes(DecodingEngine.from_pretrained(args.page_model),
                                 DecodingEngine.from_pretrained(args.element_model), pages,
                                 [dataset.load_image(p) for p in pages], decoders, args.repeats,
                                 [name for name in args.layouts.split(",") if name])
    report |= {"page_model": str(args.page_model), "element_model": str(args.element_model),
               "threads": args.threads}
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
