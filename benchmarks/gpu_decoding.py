"""Decoding on one GPU: forward cost by query length, our engine against ``generate()``, host syncs, memory.

    python -m benchmarks.gpu_decoding                      # ~1B random Qwen2.5-VL in bf16 on one GPU (a few minutes)
    python -m benchmarks.gpu_decoding --size tiny --device cpu --pages 1 --max-new-tokens 8 --repeats 1   # smoke run

The model is a random Qwen2.5-VL (``benchmarks.gpu_training``'s ``1b`` size: Qwen2.5-1.5B's width with
16 layers, 1.0B parameters) built from files made here, so nothing is downloaded. With random
weights every drafted token is rejected, so an SDB step of window ``w`` is exactly one forward of
``Q = w + 1`` tokens: seconds per forward of AR (Q = 1) and of SDB at w = 4 / 16 / 32 are the
per-forward cost at Q = 1, 5, 17, 33 through the whole engine step.

Contenders run page by page in rotating order, repeated: ``generate()`` of the same weights (greedy,
the same suppressed tokens; its output must equal our AR's), our AR, and SDB at each window.
Reported: median tokens/s (min-max) and the median ratio to ``generate()``; seconds per forward by
Q (the engine's decoding seconds, prefill excluded); host syncs per decoding step (``torch.cuda.set_sync_debug_mode`` warnings counted over one AR page);
peak memory. The engine has no CUDA-graph mode yet, so that column is absent. Written to
``<out>/gpu_decoding.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks.gpu_training import SIZES, build_model
from benchmarks.interleave import interleave, summary
from components.data.synthetic import generate_page
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from models.loading import load_markup_model

ROOT = Path(__file__).resolve().parents[1]
PAGE_SEED = 93_000_000


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(engine: DecodingEngine, image, max_new_tokens: int) -> tuple[list[int], float]:
    """Greedy ``generate()`` of the checkpoint itself on the page; (new ids, seconds)."""
    model = engine.model
    inputs = model.page_inputs([image]).to(model.device)
    _sync(model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.hf.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=engine.ids.eos,
                                pad_token_id=engine.ids.pad, suppress_tokens=engine.ids.banned_outputs.tolist())
    _sync(model.device)
    return out[0, inputs["input_ids"].shape[1]:].tolist(), time.perf_counter() - started


def ours(engine: DecodingEngine, image, params: DecodeParams) -> tuple[list[int], float, int, float]:
    """(ids, wall seconds with the page's prefill, forwards, the engine's decoding seconds)."""
    _sync(engine.model.device)
    started = time.perf_counter()
    [result] = engine.generate([image], params)
    _sync(engine.model.device)
    return result.token_ids, time.perf_counter() - started, result.stats.forward_passes, result.stats.seconds


def syncs_per_step(engine: DecodingEngine, image, params: DecodeParams) -> float | None:
    """Synchronising CUDA calls per decoding step, counted by PyTorch's sync debug mode."""
    if engine.model.device.type != "cuda":
        return None
    torch.cuda.set_sync_debug_mode(1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            [result] = engine.generate([image], params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs / max(1, result.stats.forward_passes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_decoding", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pages", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", default="4,16,32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "gpu_decoding")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    folder = build_model(args.out / "model", args.size)
    model, tokenizer = load_markup_model(folder, device=device,
                                         dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    engine = DecodingEngine(model, tokenizer)
    images = [generate_page(PAGE_SEED + i)[1] for i in range(args.pages)]
    windows = [int(w) for w in args.windows.split(",")]
    contenders = {"ar": DecodeParams(decoder="ar", max_new_tokens=args.max_new_tokens),
                  **{f"sdb_w{w}": DecodeParams(decoder="sdb", window=w, max_new_tokens=args.max_new_tokens)
                     for w in windows}}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for params in contenders.values():  # warm-up: kernels, allocator
        ours(engine, images[0], params)
    hf_generate(engine, images[0], args.max_new_tokens)

    decode_seconds: dict[str, float] = dict.fromkeys(contenders, 0.0)

    def generate_run(image):
        ids, seconds = hf_generate(engine, image, args.max_new_tokens)
        return ids, seconds, len(ids)

    def engine_run(name: str):
        def run(image):
            ids, seconds, forwards, decoding = ours(engine, image, contenders[name])
            decode_seconds[name] += decoding
            return ids, seconds, forwards
        return run

    totals, outputs = interleave({"generate": generate_run, **{name: engine_run(name) for name in contenders}},
                                 images, args.repeats)
    same_pages = sum(hf[: len(ar)] == ar for repeat in outputs for hf, ar in zip(repeat["generate"], repeat["ar"],
                                                                                   strict=True))
    rows = {name: summary(per_repeat, totals["generate"]) for name, per_repeat in totals.items()}
    for name, row in rows.items():
        forwards = sum(f for _, _, f in totals[name])
        row["seconds_per_forward"] = decode_seconds[name] / max(1, forwards) if name in decode_seconds else None
    query = {1: rows["ar"]["seconds_per_forward"], **{w + 1: rows[f"sdb_w{w}"]["seconds_per_forward"] for w in windows}}
    report = {
        "size": args.size, "parameters": sum(p.numel() for p in model.hf.parameters()), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(model.dtype), "pages": args.pages, "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
        "contenders": rows, "seconds_per_forward_by_query": query,
        "generate_equals_ar_pages": same_pages, "compared_pages": args.pages * args.repeats,
        "host_syncs_per_step": {"ar": syncs_per_step(engine, images[0], contenders["ar"]),
                                f"sdb_w{windows[0]}": syncs_per_step(engine, images[0], contenders[f"sdb_w{windows[0]}"])},
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        # CUDA graphs and torch.compile need the lean fixed-shape step, which Qwen2.5-VL (M-RoPE)
        # has not: the shipped part of gpu_check measures them on the DocVLM family.
        "cuda_graphs": "n/a: no lean decoder for this family (see gpu_check's shipped switches)",
        "wall_seconds": time.time() - started,
    }
    (args.out / "gpu_decoding.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
