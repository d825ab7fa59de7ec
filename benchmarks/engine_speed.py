"""Decoding speed of our engine against Hugging Face ``generate()`` on the same weights, interleaved.

    python -m benchmarks.engine_speed [--model DIR] [--pages 8] [--repeats 3] [--windows 4,8,16]
                                      [--batch 8] [--max-new-tokens 256] [--threads 2] [--out FILE]

Every contender decodes every page at batch 1, greedy; for each page the contenders run one after
another in a rotating order, and the whole pass repeats, so machine load hits all of them alike.
Contenders: ``generate()`` of the text model on the same image prefix (the peer a user would pick),
our AR on the static KV cache, AR on the transformers ``DynamicCache`` path (what the adapters
use), and SDB at each window. Outputs are checked: AR (both caches) must equal ``generate()``
token for token, SDB must equal AR. Then batch ``--batch`` against batch 1 for AR and SDB.

Reported per contender: median tokens/s over the repeats with (min–max), tokens per forward, and
the median of the per-repeat ratio to ``generate()``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.decoding import BENCH_SEED, benchmark_pages, resolve_model
from benchmarks.interleave import interleave, summary
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.services.process import VAR_DIR


def hf_generate(engine: DecodingEngine, image, max_new_tokens: int) -> tuple[list[int], float]:
    """Greedy ``generate()`` of the DocVLM's text model after the page's image prefix; (ids, seconds)."""
    model, ids = engine.model, engine.ids
    started = time.perf_counter()
    with torch.inference_mode():
        prefix = model.encode_images(model.preprocess([image])).embeds
        embeds = torch.cat([prefix, model.embed_tokens(torch.tensor([[ids.bos]], device=model.device))], dim=1)
        out = model.language_model.generate(
            inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=ids.eos, pad_token_id=ids.pad,
            suppress_tokens=[ids.bos, ids.pad, ids.init, ids.mask],
        )
    return out[0].tolist(), time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the demo's, else the shipped base)")
    parser.add_argument("--pages", type=int, default=8)
    parser.add_argument("--seed", type=int, default=BENCH_SEED)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", default="4,8,16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=VAR_DIR / "bench" / "engine_speed.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    fast = DecodingEngine.from_pretrained(model_dir)
    dynamic = DecodingEngine(fast.model, fast.tokenizer, static_cache=False)
    dataset = benchmark_pages(args.pages, seed=args.seed)
    images = [dataset.load_image(p) for p in dataset.pages()[: args.pages]]
    windows = [int(w) for w in args.windows.split(",") if w.strip()]
    cap = args.max_new_tokens

    def ours(engine: DecodingEngine, params: DecodeParams):
        def run(image):
            started = time.perf_counter()
            [result] = engine.generate([image], params)
            return result.token_ids, time.perf_counter() - started, result.stats.forward_passes
        return run

    def generate_run(image):
        ids, seconds = hf_generate(fast, image, cap)
        return ids, seconds, len(ids)  # generate() on embeddings returns only the new tokens, one forward each

    contenders = {
        "hf_generate": generate_run,
        "ar_static": ours(fast, DecodeParams(decoder="ar", max_new_tokens=cap)),
        "ar_dynamic": ours(dynamic, DecodeParams(decoder="ar", max_new_tokens=cap)),
        **{f"sdb_w{w}": ours(fast, DecodeParams(decoder="sdb", window=w, max_new_tokens=cap)) for w in windows},
    }
    names = list(contenders)
    ours(fast, DecodeParams(decoder="ar", max_new_tokens=8))(images[0])  # warm up
    hf_generate(fast, images[0], 8)

    totals, outputs = interleave(contenders, images, args.repeats)
    mismatches: list[str] = []
    for name in names[1:]:  # outputs of the first repeat
        reference = "hf_generate" if name.startswith("ar") else "ar_static"
        same = sum(a == b for a, b in zip(outputs[0][name], outputs[0][reference], strict=True))
        if same != len(images):
            mismatches.append(f"{name}: {same}/{len(images)} pages equal to {reference}")

    rows = {name: summary(totals[name], totals["hf_generate"]) for name in names}

    batch_rows = {}
    batch_images = (images * ((args.batch + len(images) - 1) // len(images)))[: args.batch]
    for label, params in [("ar", DecodeParams(decoder="ar", max_new_tokens=cap)),
                          (f"sdb_w{windows[0]}", DecodeParams(decoder="sdb", window=windows[0], max_new_tokens=cap))]:
        ratios = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            batched = fast.generate(batch_images, params)
            batch_rate = sum(r.stats.new_tokens for r in batched) / (time.perf_counter() - started)
            started = time.perf_counter()
            single = [fast.generate([image], params)[0] for image in batch_images]
            single_rate = sum(r.stats.new_tokens for r in single) / (time.perf_counter() - started)
            ratios.append(batch_rate / single_rate)
            if [r.token_ids for r in batched] != [r.token_ids for r in single]:
                mismatches.append(f"{label}: batch {args.batch} output differs from batch 1")
        batch_rows[label] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}

    print(f"model: {model_dir}\n{len(images)} held-out pages, batch 1, greedy, {args.threads} threads, "
          f"{args.repeats} interleaved repeats, max {cap} new tokens\n")
    print(f"{'contender':<12} {'tokens/s':>9} {'(min–max)':>15} {'tok/fwd':>8} {'vs generate':>12} {'(min–max)':>13}")
    for name, row in rows.items():
        print(f"{name:<12} {row['tokens_per_second']:9.1f} {row['min']:7.1f}–{row['max']:<7.1f} "
              f"{row['tokens_per_forward']:8.2f} {row['vs_generate']:11.2f}x {row['vs_generate_min']:6.2f}–{row['vs_generate_max']:.2f}")
    for label, row in batch_rows.items():
        print(f"batch {args.batch} / batch 1 throughput, {label}: {row['median']:.2f}x ({row['min']:.2f}–{row['max']:.2f})")
    for mismatch in mismatches:
        print("MISMATCH", mismatch)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(model_dir), "pages": len(images), "repeats": args.repeats,
                                    "threads": args.threads, "rows": rows, "batch": batch_rows,
                                    "mismatches": mismatches}, indent=2))
    print(f"\nJSON: {args.out}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
