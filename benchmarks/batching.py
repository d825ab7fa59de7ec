"""Batching benchmark: what decoding several pages per engine call buys (Triton's dynamic batching).

    .venv/bin/python -m benchmarks.batching [--model DIR] [--pages 16] [--batch-size 8]

For each decoder, decodes the same held-out pages one per call and ``--batch-size`` per call,
in one run, and prints wall time, pages/s, model calls (one forward of the whole batch counts
once) and whether every page's tokens are the same either way, with ratios batch / single.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.decoding import benchmark_pages, decoder_names, resolve_model, write_report
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.services.process import VAR_DIR


def decode_in_batches(engine: DecodingEngine, images: list, params: DecodeParams, batch_size: int) -> dict:
    """Wall time, model calls and per-page token ids of decoding ``images`` ``batch_size`` at a time."""
    started = time.perf_counter()
    model_calls, outputs = 0, []
    for first in range(0, len(images), batch_size):
        results = engine.generate(images[first : first + batch_size], params)
        model_calls += max(r.stats.forward_passes for r in results)  # rows share every forward of their batch
        outputs.extend(r.token_ids for r in results)
    wall = time.perf_counter() - started
    return {"wall_seconds": wall, "pages_per_second": len(images) / wall, "model_calls": model_calls,
            "new_tokens": sum(len(tokens) for tokens in outputs), "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder, or an MLflow URI like models:/docmarkup@champion")
    parser.add_argument("--pages", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--decoders", default="ar,sdb", help="comma-separated decoders (greedy)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the Triton backend's default is 1)")
    parser.add_argument("--out", type=Path, default=VAR_DIR / "bench" / "batching.json")
    args = parser.parse_args(argv)
    if args.batch_size < 2:
        parser.error("--batch-size must be at least 2 (it is compared with 1)")

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    engine = DecodingEngine.from_pretrained(model_dir)
    dataset = benchmark_pages(args.pages)
    images = [dataset.load_image(page) for page in dataset.pages()]
    report = {"model": str(model_dir), "pages": len(images), "batch_size": args.batch_size, "decoders": {}}
    print(f"model: {model_dir}\npages: {len(images)}, batch size {args.batch_size} vs 1, {args.threads} thread(s)\n")
    print(f"{'decoder':8} {'batch':>5} {'wall s':>8} {'pages/s':>8} {'calls':>7} {'pages/s x':>9} {'calls x':>8} {'same':>5}")
    for name in decoder_names(args.decoders):
        params = DecodeParams(decoder=name, max_new_tokens=args.max_new_tokens)
        single = decode_in_batches(engine, images, params, 1)
        batched = decode_in_batches(engine, images, params, args.batch_size)
        same = sum(a == b for a, b in zip(single["outputs"], batched["outputs"], strict=True)) / len(images)
        throughput = batched["pages_per_second"] / single["pages_per_second"]
        fewer_calls = single["model_calls"] / batched["model_calls"]
        for size, run in ((1, single), (args.batch_size, batched)):
            ratio = f"{throughput:9.2f} {fewer_calls:8.2f} {same:5.0%}" if size > 1 else f"{1.0:9.2f} {1.0:8.2f} {'':>5}"
            print(f"{name:8} {size:5d} {run['wall_seconds']:8.1f} {run['pages_per_second']:8.2f} {run['model_calls']:7d} {ratio}")
        report["decoders"][name] = {
            "single": {k: v for k, v in single.items() if k != "outputs"},
            "batched": {k: v for k, v in batched.items() if k != "outputs"},
            "throughput_ratio": throughput, "model_call_reduction": fewer_calls, "same_output_fraction": same,
        }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
