"""Write a checkpoint folder of a supported family without downloading anything.

    python -m recipes.tiny_checkpoint --family qwen2_5_vl --out var/models/tiny-qwen25     # tiny, random weights
    python -m recipes.tiny_checkpoint --family qwen2_5_vl --preset 3b --out var/models/qwen25-3b-config

``tiny`` folders (random weights, a Qwen-like tokenizer trained on synthetic pages, processor
files) load and decode through the engine exactly like a real checkpoint: for tests, demos and
for anyone trying the platform without weights. ``3b`` writes only the ``config.json`` of
Qwen2.5-VL-3B (its published config values): enough for the training launcher's ``--dry-run``
to count parameters and estimate memory, with no weights anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from components.data.synthetic import generate_page
from models.hf_adapter import SUPPORTED_MODEL_TYPES, save_tiny_hf_vlm
from models.loading import new_tiny_model, save_markup_model
from models.tokenizer import train_markup_tokenizer

# Our own DocVLM plus every Hugging Face family the adapter trains and decodes.
TINY_FAMILIES = ("docvlm", *SUPPORTED_MODEL_TYPES)

# Qwen2.5-VL-3B-Instruct's config.json values (text: 36 x 2048, GQA 16/2, vocab 151936, tied
# embeddings; vision: 32 x 1280 with window attention).
QWEN2_5_VL_3B = {
    "model_type": "qwen2_5_vl",
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "text_config": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
        "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": True,
}
PRESETS = {("qwen2_5_vl", "3b"): QWEN2_5_VL_3B}


def write_tiny(family: str, out: Path, seed: int = 0, n_texts: int = 300) -> Path:
    """A tiny random checkpoint of ``family`` whose tokenizer has seen ``n_texts`` synthetic pages."""

    if family not in TINY_FAMILIES:
        raise ValueError(f"unsupported family {family!r}; supported: {', '.join(TINY_FAMILIES)}")
    texts = [generate_page(s)[0].markup for s in range(n_texts)]
    if family == "docvlm":
        tokenizer = train_markup_tokenizer(texts, vocab_size=512)
        return save_markup_model(new_tiny_model(tokenizer, seed=seed), tokenizer, out)

    return save_tiny_hf_vlm(out, texts, model_type=family, seed=seed)


def write_config_preset(family: str, preset: str, out: Path) -> Path:
    """Only ``config.json`` of a published model size (for ``--dry-run``; no weights)."""
    if (family, preset) not in PRESETS:
        raise ValueError(f"no {preset!r} preset for {family!r}; presets: {sorted(f'{f}:{p}' for f, p in PRESETS)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(PRESETS[(family, preset)], indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.tiny_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--family", required=True, help=f"one of {', '.join(TINY_FAMILIES)}")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--preset", default="tiny", help="tiny (random weights) or 3b (config only, qwen2_5_vl)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.preset == "tiny":
            path = write_tiny(args.family, args.out, seed=args.seed)
        else:
            path = write_config_preset(args.family, args.preset, args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.family} ({args.preset}) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
