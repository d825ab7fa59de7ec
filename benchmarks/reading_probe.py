"""What keeps a fresh base DocVLM from reading: a short, controlled training probe.

A page reader must learn two things: *recognise* the word under an image cell, and *point*, token
after token, at the cells of the next word. This probe trains a freshly initialised ``base``
DocVLM (``models/docvlm.py``) for a few hundred AR steps on synthetic pages and prints, every
``--every`` steps, the validation loss with each page's own image and with another page's (their
gap is how much the model uses the image). Two switches separate the two skills:

* ``--preset oneword``: pages holding a single word, so pointing is trivial;
* ``--dense W``: an auxiliary per-patch loss (a linear head on the vision tower's patches
  predicting the token of the word covering the patch, labels from the renderer's word boxes,
  :func:`components.data.synthetic.render_page`), whose value says how well the encoder
  recognises words where they are; ``--stem-context N`` adds N 3x7 convolutions after the stem
  (horizontal context for each patch).

It is a measurement, not the pretraining recipe (``./run pretrain`` is); results are in the
base model's card. Example: ``python -m benchmarks.reading_probe --preset tiny --dense 1
--stem-context 2 --steps 700 --every 100``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from torch import nn

from components.data.synthetic import RenderedPage, SyntheticConfig, render_page
from components.training.data import encode_markup
from models.interface import PagePrefix
from models.loading import new_tiny_model
from models.tokenizer import load_tokenizer

BASE_DIR = Path(__file__).resolve().parents[1] / "models" / "pretrained" / "docmarkup-base"
TRAIN_SEED, VAL_SEED = 96_000_000, 95_000_000  # outside every other seed range (components.data.seeds)


def page_config(preset: str) -> SyntheticConfig:
    if preset == "oneword":  # one word per page: recognition without the need to point
        return dataclasses.replace(SyntheticConfig.preset("lines"), max_body_elements=1, paragraph_words=(1, 1),
                                   p_header=0.0, p_footer=0.0, category_weights=(("text", 1.0),))
    return SyntheticConfig.preset(preset)


def patch_labels(page: RenderedPage, tokenizer, grid: tuple[int, int], patch: int, none_id: int) -> torch.Tensor:
    """Per patch: the first token of the word whose box covers it, else ``none_id``."""
    labels = torch.full(grid, none_id)
    for word, (x0, y0, x1, y1) in page.words:
        token = tokenizer(" " + word, add_special_tokens=False)["input_ids"][0]
        r0, r1 = int(y0 // patch), min(int((y1 - 1) // patch), grid[0] - 1)
        c0, c1 = int(x0 // patch), min(int((x1 - 1) // patch), grid[1] - 1)
        labels[max(r0, 0): r1 + 1, max(c0, 0): c1 + 1] = token
    return labels.flatten()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reading_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", help="tiny, lines or oneword")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--dense", type=float, default=0.0, help="weight of the per-patch word loss (0: off)")
    parser.add_argument("--stem-context", type=int, default=0, help="3x7 convolutions appended to the stem")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the curve as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(BASE_DIR)
    model = new_tiny_model(tokenizer, seed=0, architecture="base")
    channels = model.config.vision_config.num_channels
    for _ in range(args.stem_context):
        model.stem.extend([nn.Conv2d(channels, channels, (3, 7), padding=(1, 3)), nn.GroupNorm(8, channels), nn.GELU()])
    height, width = model.config.image_size
    patch = model.config.pixel_patch
    grid = (height // patch, width // patch)
    head = nn.Linear(model.config.vision_config.hidden_size, len(tokenizer)) if args.dense > 0 else None
    cfg = page_config(args.preset)

    def batch_of(pages: list[RenderedPage]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = [encode_markup(tokenizer, p.page.markup, 256)[0] for p in pages]
        ids = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_token_id)
        labels = torch.full_like(ids, -100)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = labels[i, : len(row)] = torch.tensor(row)
        return model.preprocess([p.image for p in pages]), ids, labels

    val_pixels, val_ids, val_labels = batch_of([render_page(VAL_SEED + i, cfg) for i in range(16)])
    params = list(model.parameters()) + (list(head.parameters()) if head is not None else [])
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    curve, started = [], time.time()
    model.train()
    for step in range(1, args.steps + 1):
        pages = [render_page(TRAIN_SEED + step * args.batch + i, cfg) for i in range(args.batch)]
        pixels, ids, labels = batch_of(pages)
        patches = model.patch_features(pixels)
        ar = model(prefix=model.prefix_from_patches(patches), input_ids=ids, labels=labels)["loss"]
        loss, dense = ar, None
        if head is not None:
            targets = torch.stack([patch_labels(p, tokenizer, grid, patch, tokenizer.pad_token_id) for p in pages])
            dense = nn.functional.cross_entropy(head(patches.flatten(1, 2)).flatten(0, 1), targets.flatten())
            loss = ar + args.dense * dense
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if step % args.every == 0:
            model.eval()
            with torch.no_grad():
                prefix = model.encode_images(val_pixels)
                own = model(prefix=prefix, input_ids=val_ids, labels=val_labels)["loss"].item()
                other = model(prefix=PagePrefix(prefix.embeds.roll(1, 0)), input_ids=val_ids,
                              labels=val_labels)["loss"].item()
            model.train()
            point = {"step": step, "train_ar": ar.item(), "val_own_image": own, "val_other_image": other,
                     "image_gap": other - own, "dense": None if dense is None else dense.item(),
                     "seconds": time.time() - started}
            curve.append(point)
            print(json.dumps(point), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
