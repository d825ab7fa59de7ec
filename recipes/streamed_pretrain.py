"""Pretraining on pages rendered while the model trains: the base checkpoint on one accelerator.

``./run pretrain`` trains through the DeepSpeed trainer over a stored page set, which is what a
2-core CPU can afford. One GPU consumes pages far faster than a stored set can be rendered ahead
of time, and a lent GPU machine may have nothing but torch and transformers, so this loop:

* renders pages in DataLoader workers while training runs (deterministic per data step:
  ``tiny`` seeds ``PRETRAIN_SEED + step * batch + i``, ``lines`` pages from ``LINES_SEED`` likewise),
  so no page is stored and none repeats unless the replay buffer reuses it;
* keeps the last fresh batches on the device and replays one of them when rendering falls behind
  (at most ``--reuse`` replayed steps per fresh one), so the accelerator never waits idle;
* trains the same :class:`components.training.mix.ObjectiveMix` as every stage (objectives from
  ``configs/train/pretrain.yaml``), in bf16 autocast on CUDA;
* can train several learning rates side by side on the same batches (``--lr 1.5e-3,3e-3``):
  rendering, not the accelerator, is the bottleneck, so a sweep costs little extra;
* schedules the learning rate over ``--steps`` or over a wall-clock budget (``--minutes``),
  checkpoints every ``--save-every`` seconds and resumes from the last checkpoint.

It writes one model folder per learning rate (``<work-dir>/lr-<lr>/model``) with a
``streamed.json`` of how it was made; ``python -m recipes.pretrain --publish DIR``
then evaluates a folder and makes it the shipped base.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import platform
import queue
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from components.data.pages import atomic_write_text
from components.data.synthetic import SyntheticConfig, generate_page
from components.training.config import PROJECT_ROOT, load_train_config
from components.training.data import Batch, encode_markup
from components.training.mix import ObjectiveMix
from components.training.objectives import ar_loss
from models.docvlm import DocVLMForConditionalGeneration, page_pixels
from models.interface import PagePrefix
from models.loading import new_tiny_model
from models.tokenizer import load_tokenizer
from recipes.pretrain import LINES_SEED, PRETRAIN_SEED  # the same seed ranges

VALIDATION_SEED = 95_000_000  # validation loss only; held-out evaluation uses 90M+
TOKENIZER_DIR = PROJECT_ROOT / "models" / "pretrained" / "docmarkup-base"


@dataclass(frozen=True)
class PageMix:
    """Which preset each page of a data step uses: ``lines`` pages (one or two short blocks, a
    reading curriculum) make up ``early_lines`` of a batch for the first ``early_steps`` data
    steps and ``lines`` after."""

    lines: float = 0.2
    early_lines: float = 0.5
    early_steps: int = 500

    def presets(self, step: int, batch: int, seed: int) -> list[str]:
        share = self.early_lines if step < self.early_steps else self.lines
        rng = random.Random(seed * 1_000_003 + step)
        return ["lines" if rng.random() < share else "tiny" for _ in range(batch)]


def page_seed(preset: str, step: int, batch: int, index: int) -> int:
    return (LINES_SEED if preset == "lines" else PRETRAIN_SEED) + step * batch + index


class RenderedBatches(torch.utils.data.Dataset):
    """Item ``k`` is the whole batch of data step ``first + k``, rendered in the worker."""

    def __init__(self, tokenizer_dir: Path, batch: int, first: int, total: int, mix: PageMix, seed: int,
                 image_size: tuple[int, int], ink_scale: float, max_tokens: int):
        self.tokenizer_dir, self.batch, self.first, self.total = tokenizer_dir, batch, first, total
        self.mix, self.seed, self.image_size, self.ink_scale, self.max_tokens = mix, seed, image_size, ink_scale, max_tokens
        self._tokenizer = None
        self._configs = {name: SyntheticConfig.preset(name) for name in ("tiny", "lines")}

    def __len__(self) -> int:
        return self.total - self.first

    def __getitem__(self, k: int) -> Batch:
        if self._tokenizer is None:  # one per worker process
            self._tokenizer = load_tokenizer(self.tokenizer_dir)
        step = self.first + k
        pages, images = [], []
        for index, preset in enumerate(self.mix.presets(step, self.batch, self.seed)):
            page, image = generate_page(page_seed(preset, step, self.batch, index), self._configs[preset])
            pages.append(page)
            images.append(image)
        return make_batch(self._tokenizer, pages, images, self.image_size, self.ink_scale, self.max_tokens)


def make_batch(tokenizer, pages, images, image_size, ink_scale: float, max_tokens: int) -> Batch:
    rows = [encode_markup(tokenizer, page.markup, max_tokens) for page in pages]
    tokens = torch.full((len(rows), max(len(ids) for ids, _ in rows)), tokenizer.pad_token_id, dtype=torch.long)
    for i, (ids, _) in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids)
    return Batch(
        pages=page_pixels(images, image_size, ink_scale), tokens=tokens,
        lengths=torch.tensor([len(ids) for ids, _ in rows]), ends_with_eos=torch.tensor([eos for _, eos in rows]),
        weights=torch.ones(len(rows)), page_ids=[page.page_id for page in pages],
    )


class BatchFeed:
    """Fresh batches from a background thread; a replayed recent one when none is ready."""

    def __init__(self, loader, device: torch.device, replay: int, reuse: float):
        self._queue: queue.Queue = queue.Queue(maxsize=8)
        self._buffer: collections.deque[Batch] = collections.deque(maxlen=max(1, replay))
        self.device, self.replay, self.reuse = device, replay, reuse
        self.fresh = self.replayed = 0
        self._thread = threading.Thread(target=self._pull, args=(loader,), daemon=True)
        self._thread.start()

    def _pull(self, loader) -> None:
        try:
            for batch in loader:
                self._queue.put(batch)
        except Exception as exc:  # surfaced in the training thread
            self._queue.put(exc)
        self._queue.put(None)

    def _take(self, block: bool) -> Batch | None:
        item = self._queue.get(block=block)
        if isinstance(item, Exception):
            raise RuntimeError("page rendering failed") from item
        return item

    def next(self) -> tuple[Batch | None, bool]:
        """(batch, fresh); (None, True) once the data steps are exhausted."""
        may_replay = self.replay > 0 and self._buffer and self.replayed < self.reuse * self.fresh
        try:
            item = self._take(block=not may_replay)
        except queue.Empty:
            self.replayed += 1
            return random.choice(self._buffer), False
        if item is None:
            return None, True
        batch = item.to(self.device)
        self._buffer.append(batch)
        self.fresh += 1
        return batch, True


def lr_factor(progress: float, warmup: float, min_ratio: float) -> float:
    """Linear warm-up over the first ``warmup`` of training, then cosine down to ``min_ratio``."""
    if progress < warmup:
        return max(progress / warmup, 1e-3)
    rest = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * rest))


@torch.no_grad()
def validation_losses(model, batch: Batch) -> dict[str, float]:
    """AR loss with each page's own image and with another page's: their gap is how much the model
    uses the image; token accuracy under teacher forcing."""
    model.eval()
    prefix = model.encode_pages(batch.pages)
    own = model(prefix=prefix, input_ids=batch.tokens)["logits"]
    other = model(prefix=PagePrefix(prefix.embeds.roll(1, 0)), input_ids=batch.tokens)["logits"]
    valid = torch.arange(1, batch.tokens.shape[1], device=batch.tokens.device)[None] < batch.lengths[:, None]
    correct = (own[:, :-1].argmax(-1) == batch.tokens[:, 1:]) & valid
    model.train()
    return {"val_ar": ar_loss(own.float(), batch.tokens, batch.lengths).mean().item(),
            "val_ar_other_image": ar_loss(other.float(), batch.tokens, batch.lengths).mean().item(),
            "val_token_accuracy": (correct.sum() / valid.sum()).item()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipes.streamed_pretrain",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, default=PROJECT_ROOT / "var" / "pretrain-streamed")
    parser.add_argument("--config", default="configs/train/pretrain.yaml", help="objective mix and optimiser")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, help="optimizer steps")
    budget.add_argument("--minutes", type=float, help="wall-clock training budget (schedule over time)")
    parser.add_argument("--lr", default="1e-3", help="one or more comma-separated learning rates, trained side by side "
                        "(1e-3 made the shipped base at batch 64; 3e-3 diverged)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=0.05, help="fraction of training")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--replay", type=int, default=256, help="recent fresh batches kept on the device (0: off)")
    parser.add_argument("--reuse", type=float, default=2.0, help="at most this many replayed steps per fresh one")
    parser.add_argument("--lines", type=float, default=0.2, help="share of lines pages after the early steps")
    parser.add_argument("--early-lines", type=float, default=0.5)
    parser.add_argument("--early-steps", type=int, default=500, help="data steps with the early lines share")
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--val-pages", type=int, default=64, help="validation pages (seeds 95M+)")
    parser.add_argument("--save-every", type=float, default=120.0, help="seconds between checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", type=Path, default=None, help="start from this model folder's weights")
    parser.add_argument("--first-data-step", type=int, default=0,
                        help="data step to start from (with --init: past the pages the init model saw)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    config = load_train_config(args.config, check_paths=False)
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    rates = [float(v) for v in args.lr.split(",")]
    work = args.work_dir.resolve()
    runs = []
    for lr in rates:
        model = new_tiny_model(tokenizer, seed=args.seed, architecture="base")
        if args.init is not None:  # (weights only: a loaded model may opt into hub kernels on .train())
            model.load_state_dict(DocVLMForConditionalGeneration.from_pretrained(str(args.init)).state_dict())
        model = model.to(device).train()
        mix = ObjectiveMix(model, config).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.optim.weight_decay,
                                      betas=(0.9, 0.98), fused=device.type == "cuda")
        runs.append({"lr": lr, "dir": work / f"lr-{lr:g}", "model": model, "mix": mix, "optimizer": optimizer})
    state = {"step": 0, "data_step": args.first_data_step, "seconds": 0.0, "fresh": 0, "replayed": 0, "curve": []}
    checkpoint = work / "checkpoint.pt"
    if checkpoint.exists():
        saved = torch.load(checkpoint, map_location=device, weights_only=False)
        if saved["rates"] != rates:
            print(f"{checkpoint} holds learning rates {saved['rates']}, not {rates}", file=sys.stderr)
            return 2
        for run, blob in zip(runs, saved["runs"], strict=True):
            run["model"].load_state_dict(blob["model"])
            run["optimizer"].load_state_dict(blob["optimizer"])
        state = saved["state"]
        print(f"[streamed] resumed at step {state['step']} ({state['seconds']:.0f}s trained)", flush=True)

    def save() -> None:
        work.mkdir(parents=True, exist_ok=True)
        blob = {"rates": rates, "state": state,
                "runs": [{"model": r["model"].state_dict(), "optimizer": r["optimizer"].state_dict()} for r in runs]}
        torch.save(blob, checkpoint.with_suffix(".tmp"))
        checkpoint.with_suffix(".tmp").replace(checkpoint)

    mix_plan = PageMix(args.lines, args.early_lines, args.early_steps)
    height, width = runs[0]["model"].config.image_size
    ink = runs[0]["model"].config.ink_scale
    max_data_steps = state["data_step"] + (args.steps or 1_000_000) - state["step"]
    dataset = RenderedBatches(TOKENIZER_DIR, args.batch, state["data_step"], max_data_steps, mix_plan, args.seed,
                              (height, width), ink, args.max_tokens)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False, num_workers=args.workers,
                                         prefetch_factor=4 if args.workers else None,
                                         # spawned, not forked: the feed thread starts them while
                                         # the main thread may hold tokenizer / allocator locks
                                         multiprocessing_context="spawn" if args.workers else None,
                                         pin_memory=device.type == "cuda")
    val_pages = [generate_page(VALIDATION_SEED + i, SyntheticConfig.preset("tiny")) for i in range(args.val_pages)]
    val_batch = make_batch(tokenizer, [p for p, _ in val_pages], [im for _, im in val_pages], (height, width), ink,
                           args.max_tokens).to(device)
    feed = BatchFeed(loader, device, args.replay, args.reuse)
    feed.fresh, feed.replayed = state["fresh"], state["replayed"]
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    generator = torch.Generator().manual_seed(args.seed + state["step"])
    started, last_save, first_batch = time.time() - state["seconds"], time.time(), True

    def progress() -> float:
        if args.minutes is not None:
            return (time.time() - started) / (args.minutes * 60)
        return state["step"] / args.steps

    print(f"[streamed] {len(runs)} model(s), lr {rates}, batch {args.batch}, {args.workers} render workers, "
          f"device {device}", flush=True)
    while progress() < 1.0 and not stop["now"]:
        batch, fresh = feed.next()
        if batch is None:
            break
        if first_batch:  # the clock starts with the first batch, not with the workers' start-up
            started, first_batch = time.time() - state["seconds"], False
        state["data_step"] += int(fresh)
        factor = lr_factor(progress(), args.warmup, config.optim.min_lr_ratio)
        losses = []
        for run in runs:
            for group in run["optimizer"].param_groups:
                group["lr"] = run["lr"] * factor
            with autocast:
                loss, _ = run["mix"](batch, generator)
            run["optimizer"].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(run["model"].parameters(), config.optim.grad_clip)
            run["optimizer"].step()
            losses.append(loss.detach())
        state["step"] += 1
        state["seconds"] = time.time() - started
        state["fresh"], state["replayed"] = feed.fresh, feed.replayed
        if state["step"] % args.eval_every == 0 or state["step"] == 1:
            with autocast:
                points = [validation_losses(run["model"], val_batch) for run in runs]
            point = {"step": state["step"], "seconds": round(state["seconds"], 1), "progress": round(progress(), 4),
                     "fresh_batches": feed.fresh, "replayed_batches": feed.replayed,
                     "train_loss": [round(v.item(), 4) for v in losses],
                     **{k: [round(p[k], 4) for p in points] for k in points[0]}}
            state["curve"].append(point)
            eta = state["seconds"] / max(progress(), 1e-9) * (1 - progress())
            print(json.dumps(point), f"ETA {eta / 60:.1f} min", flush=True)
        if time.time() - last_save > args.save_every:
            save()
            last_save = time.time()
    save()
    for index, run in enumerate(runs):
        out = run["dir"] / "model"
        run["model"].eval().to("cpu").float().save_folder(out, tokenizer)
        meta = {
            "command": "python -m recipes.streamed_pretrain " + " ".join(argv if argv is not None else sys.argv[1:]),
            "lr": run["lr"], "batch": args.batch, "steps": state["step"], "train_seconds": state["seconds"],
            "fresh_batches": feed.fresh, "replayed_batches": feed.replayed, "objectives": config.active_objectives,
            "page_mix": vars(mix_plan), "machine": machine_name(device),
            "seen_seeds": [[PRETRAIN_SEED, PRETRAIN_SEED + state["data_step"] * args.batch - 1],
                           [LINES_SEED, LINES_SEED + state["data_step"] * args.batch - 1]],
            "init": (json.loads((args.init / "streamed.json").read_text())
                     if args.init is not None and (args.init / "streamed.json").is_file() else None),
            "curve": [{**p, **{k: v[index] for k, v in p.items() if isinstance(v, list)}}
                      for p in state["curve"]],
        }
        atomic_write_text(out / "streamed.json", json.dumps(meta, indent=2))
        print(f"[streamed] wrote {out}", flush=True)
    return 3 if stop["now"] else 0


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{platform.machine()} GPU {torch.cuda.get_device_name(device)}"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


if __name__ == "__main__":
    raise SystemExit(main())
