"""Training step time and peak GPU memory of a ~0.5B random Qwen2.5-VL: what a team sizing a fine-tune needs.

    python -m benchmarks.gpu_training                  # one GPU: 50 bf16 steps, ZeRO-2, checkpointing, chunked CE
    python -m benchmarks.gpu_training --size tiny --steps 3 --deepspeed configs/deepspeed/zero2.json   # CPU smoke run

The model is a random Qwen2.5-VL whose text decoder has Qwen2.5-0.5B's shape (24 x 896, GQA 14/2,
vocabulary padded to 151,936 rows, tied embeddings) and whose vision tower is an 8-layer, 640-wide
version of Qwen2.5-VL's (window attention, 2x2 merge): about 0.53B parameters. It trains Stage 1's
objective mix (AR + DAR + MinerU block diffusion + PA-BDM CSL: four streams in one forward) on
synthetic pages of up to 1,024 markup tokens, through the real trainer (``run_training``) with
``configs/deepspeed/zero2_bf16_gpu.json``, activation checkpointing and the chunked cross-entropy.

Printed and written to ``<out>/gpu_training.json``: parameters, median / p10 / p90 step time of the
steps after the first 5 (warm-up, allocator growth), pages per second, and the peak memory
``torch.cuda`` allocated and reserved. Everything runs from files made here: no download.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from components.data.synthetic import generate_dataset, generate_page
from components.training.config import load_train_config
from components.training.trainer import run_training
from models.hf_adapter import save_tiny_hf_vlm
from models.loading import load_markup_model

ROOT = Path(__file__).resolve().parents[1]

# Qwen2.5-0.5B's decoder shape; head_dim 64, so the M-RoPE sections (t, h, w) sum to 32.
TEXT_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e6}}
VISION_05B = {"depth": 8, "hidden_size": 640, "intermediate_size": 1710, "num_heads": 10, "out_hidden_size": 896,
              "fullatt_block_indexes": [3, 7]}
# ~1B: Qwen2.5-1.5B's width and MLP with 16 of its 28 layers (1.0B with the padded vocabulary).
TEXT_1B = {**TEXT_05B, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 16,
           "num_attention_heads": 12, "num_key_value_heads": 2, "rope_parameters": {**TEXT_05B["rope_parameters"],
                                                                                   "mrope_section": [16, 24, 24]}}
VISION_1B = {**VISION_05B, "out_hidden_size": 1536}
SIZES = {"1b": (TEXT_1B, VISION_1B), "0.5b": (TEXT_05B, VISION_05B), "tiny": ({}, {})}


def build_model(folder: Path, size: str) -> Path:
    text, vision = SIZES[size]
    texts = [generate_page(seed)[0].markup for seed in range(200)]
    return save_tiny_hf_vlm(folder, texts, model_type="qwen2_5_vl", vocab_size=2048, max_pixels=28 * 28 * 256,
                            text_overrides=text, vision_overrides=vision)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--deepspeed", default="configs/deepspeed/zero2_bf16_gpu.json")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "gpu_training")
    args = parser.parse_args(argv)

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    started = time.time()
    folder = build_model(args.out / "model-init", args.size)
    generate_dataset(args.out / "pages", args.pages, seed=900)
    print(f"[gpu_training] model and {args.pages} pages written in {time.time() - started:.1f}s", flush=True)
    config = load_train_config(ROOT / "configs/train/stage1.yaml", {
        "name": "gpu_training", "output_dir": str(args.out / "run"), "model.init_from": str(folder),
        "data.dataset": str(args.out / "pages"), "data.max_tokens": args.max_tokens, "deepspeed": args.deepspeed,
        "train.steps": args.steps, "train.micro_batch_size": args.micro_batch, "train.save_every": None,
        "train.gradient_checkpointing": True, "train.progress": False, "mlflow.enabled": False,
        "optim.lr": 1e-4, "optim.warmup_steps": 5,
    })
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = run_training(config)
    steps = [record["step_seconds"] for record in result.history]
    timed = steps[5:] if len(steps) > 10 else steps
    quantiles = statistics.quantiles(timed, n=10) if len(timed) > 1 else [timed[0]] * 9

    model, _ = load_markup_model(result.model_dir)
    report = {
        "size": args.size, "parameters": sum(p.numel() for p in model.parameters()), "steps": len(steps),
        "micro_batch": args.micro_batch, "max_tokens": args.max_tokens, "deepspeed": args.deepspeed,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "step_seconds_median": statistics.median(timed), "step_seconds_p10": quantiles[0], "step_seconds_p90": quantiles[-1],
        "pages_per_second": args.micro_batch / statistics.median(timed),
        "first_loss": result.losses[0], "last_loss": result.losses[-1],
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "wall_seconds": time.time() - started,
    }
    (args.out / "gpu_training.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
