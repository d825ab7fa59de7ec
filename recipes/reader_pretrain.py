"""``./run pretrain --reader``: the shipped real-document reader (``models/pretrained/docmarkup-reader``).

One resumable command: it builds the real-document corpus if it is not there
(:mod:`components.data.corpus`, Debian's PDF manuals), makes the fresh reader (the pretrained
PP-OCRv6 line recogniser as its frozen tower, a new byte-level decoder: :mod:`models.reader`),
trains it on the corpus's train split as element crops through the DeepSpeed trainer every stage
uses, in two phases (``configs/train/reader.yaml``: AR + the DARL window stream; then with both
mask-block denoisers added, so block decoding and PPC read too), scores every checkpoint on
held-out elements for the learning curve (character error against examples seen), evaluates every
decoder on the held-out documents, and installs the model folder with its card.

Interrupt it at any point and run it again: the corpus build, both phases and the curve resume.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from components.data.corpus import build_corpus
from components.data.page_store import PageDataset
from components.data.pages import atomic_write_text
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.element_reading import read_store, summarize_readings
from components.training.config import PROJECT_ROOT, TrainConfigError, load_train_config
from components.training.runtime import ensure_process_env
from components.training.trainer import run_training
from models.loading import load_markup_model
from models.reader import TOWER_CACHE_ENV, new_reader_model
from recipes.build_corpus import rapid_layout_regions
from recipes.pretrain import model_at_checkpoint, pretrain_parser

DEFAULT_OUT = PROJECT_ROOT / "models" / "pretrained" / "docmarkup-reader"
WORK_DIR = PROJECT_ROOT / "var" / "reader"
DEFAULT_CORPUS = PROJECT_ROOT / "var" / "corpus"
# The corpus the committed reader was trained on (held-out packages and documents: see corpus.py).
CORPUS_PACKAGES = ("freefem-doc", "why3-doc-pdf", "python-reportlab-doc", "shared-mime-info", "r-doc-pdf",
                   "auto-multiple-choice-doc-pdf", "texlive-latex-recommended-doc", "docbook-xsl-doc-pdf",
                   "siscone-doc-pdf", "gri-pdf-doc")
# Phase 2: the block denoisers join once the decoder reads (their streams cost 2.7x an AR step on CPU).
PHASE_2 = ["objectives={ar: 1.0, dar: 0.5, block_diffusion: 0.25, pabdm_csl: 0.25}", "optim.lr=3.0e-4",
           "optim.warmup_steps=10", "train.save_every=50"]


def ensure_corpus(corpus: Path, max_pages: int | None) -> None:
    if PageDataset(corpus / "train").exists():
        return

    print(f"[reader] building the corpus in {corpus} from {len(CORPUS_PACKAGES)} Debian packages")
    build_corpus(list(CORPUS_PACKAGES), corpus, cache=PROJECT_ROOT / "var" / "debian", max_pages=max_pages,
                 pages_per_document=16, regions=rapid_layout_regions())


def ensure_init(init_dir: Path) -> None:
    if (init_dir / "config.json").is_file():
        return

    model, tokenizer = new_reader_model()
    model.save_folder(init_dir, tokenizer)


def checkpoint_steps(train_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (train_dir / "checkpoints").glob("step_*"))


def curve_point(source: Path, train_dir: Path, step: int, held_out: PageDataset, elements: int) -> dict:
    """Held-out character error of the checkpoint at ``step`` (greedy AR, first ``elements`` elements)."""

    model, tokenizer = model_at_checkpoint(train_dir, step, source)
    readings, _ = read_store(DecodingEngine(model, tokenizer), held_out, DecodeParams(max_new_tokens=768),
                             limit=elements)
    summary = summarize_readings(readings)
    history = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [h["loss"] for h in history if step - 50 < h["step"] <= step]
    return {"step": step, "cer": summary["cer"], "loss": sum(losses) / max(1, len(losses)),
            **{f"{c}_cer": v["cer"] for c, v in summary["by_category"].items()}}


def evaluate_reader(model_dir: Path, held_out: PageDataset, decoders: list[str], limit: int | None) -> dict:
    """Every decoder on the held-out elements, batch 16, greedy; SDB's tokens compared with AR's."""

    engine = DecodingEngine.from_pretrained(model_dir)
    results, outputs = {}, {}
    for name in decoders:
        readings, seconds = read_store(engine, held_out, DecodeParams(decoder=name, max_new_tokens=768), limit=limit)
        results[name] = summarize_readings(readings, seconds)
        outputs[name] = [r.markup for r in readings]
        print(f"[reader] {name}: CER {results[name]['cer']:.4f}, {results[name]['tokens_per_forward']:.2f} tokens/forward",
              flush=True)
    for name in decoders:
        same = sum(a == b for a, b in zip(outputs[name], outputs["ar"], strict=True))
        results[name]["same_output_as_ar"] = same / max(1, len(outputs["ar"]))
        results[name]["forward_reduction"] = results["ar"]["forwards"] / max(1, results[name]["forwards"])
    return results


def write_card(out: Path, meta: dict) -> None:
    ev = meta["evaluation"]
    rows = [f"| {name} | {v['cer'] * 100:.2f} | " + " | ".join(
        f"{v['by_category'].get(c, {}).get('cer', float('nan')) * 100:.2f}" for c in ("text", "title", "code"))
        + f" | {v['tokens_per_forward']:.2f} | {v['forward_reduction']:.2f}x | {v['same_output_as_ar']:.2f} |"
        for name, v in ev.items()]
    curve = "\n".join(f"| {p['step']} | {p['examples']} | {p['cer'] * 100:.2f} | {p['loss']:.3f} |" for p in meta["curve"])
    card = f"""# docmarkup-reader

The real-document element reader: {meta['parameters'] / 1e6:.2f}M trained parameters (a 4-layer,
192-wide Qwen2 decoder over byte tokens and the prefix projections, `models/reader.py`) on the frozen
PP-OCRv6 line recogniser that ships in the rapidocr wheel (2.8M parameters, its sha256 in
`config.json`; not stored here). It reads element crops (two-stage parsing: layout, then each
element at native resolution); `parse: auto` picks element mode from `training_meta.json`.

Made by `{meta['command']}`.

- Data: {meta['data']}
- Training: {meta['training']}
- Machine: {meta['machine']}; training wall time {meta['train_seconds'] / 60:.1f} min.

## Held-out evaluation

{meta['held_out']} Character error rate (%) pooled over characters, whitespace collapsed; batch 16,
greedy, max 768 new tokens.

| decoder | CER all | text | title | code | tokens/forward | forwards vs AR | = AR output |
| --- | --- | --- | --- | --- | --- | --- | --- |
{chr(10).join(rows)}

## Learning curve

Held-out character error (AR, first {meta['curve_elements']} held-out elements) against examples seen.

| step | examples | CER (%) | train loss |
| --- | --- | --- | --- |
{curve}
"""
    atomic_write_text(out / "README.md", card)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = pretrain_parser("./run pretrain --reader", __doc__.split("\n")[0], config="configs/train/reader.yaml",
                             out=DEFAULT_OUT, work_dir=WORK_DIR, decoders="ar,sdb,ppc,block")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--corpus-max-pages", type=int, default=None)
    parser.add_argument("--init-from", type=Path, default=None,
                        help="a reader folder to start phase 1 from instead of a fresh reader (warm start)")
    parser.add_argument("--phase1-steps", type=int, default=None, help="default: configs/train/reader.yaml")
    parser.add_argument("--phase2-steps", type=int, default=150)
    parser.add_argument("--curve-elements", type=int, default=150)
    parser.add_argument("--eval-elements", type=int, default=None, help="held-out elements to evaluate (default all)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work_dir.resolve()
    init_dir, phase1_dir, phase2_dir = work / "init", work / "train", work / "train2"
    ensure_corpus(args.corpus, args.corpus_max_pages)
    if args.init_from is None:
        ensure_init(init_dir)
    start = args.init_from.resolve() if args.init_from else init_dir
    phase1 = [f"train.steps={args.phase1_steps}"] if args.phase1_steps else []
    phases = [(start, phase1_dir, phase1), (phase1_dir / "model", phase2_dir, [*PHASE_2, f"train.steps={args.phase2_steps}"])]

    ensure_process_env()

    os.environ.setdefault(TOWER_CACHE_ENV, str(work / "tower_frames.pt"))  # the frozen tower runs once per line

    sessions_file = work / "sessions.json"
    sessions = json.loads(sessions_file.read_text()) if sessions_file.exists() else []
    configs = []
    for source, output, extra in phases:
        # --set applies to both phases; phase 2's own recipe (objectives, lr, steps) wins over it
        overrides = [f"model.init_from={source}", f"data.dataset={args.corpus / 'train'}", f"output_dir={output}",
                     *args.overrides, *extra]
        try:
            config = load_train_config(args.config, overrides)
        except TrainConfigError as exc:
            print(exc, file=sys.stderr)
            return 2
        configs.append(config)
        if (output / "model" / "config.json").is_file():
            continue
        result = run_training(config)
        sessions.append({"phase": len(configs), "start_step": result.start_step, "final_step": result.final_step,
                         "train_seconds": result.train_seconds, "machine": platform.node()})
        atomic_write_text(sessions_file, json.dumps(sessions, indent=2))
        if result.model_dir is None:
            print(f"[reader] stopped at step {result.final_step}; run the same command again to resume")
            return 3

    held_out = PageDataset(args.corpus / "test")
    curve_file = work / "curve.jsonl"
    curve = [json.loads(line) for line in curve_file.read_text().splitlines()] if curve_file.exists() else []
    done = {(p["phase"], p["step"]) for p in curve}
    batch = configs[0].train.micro_batch_size
    phase1_steps = configs[0].train.steps
    for phase, (source, output, _) in enumerate(phases, start=1):
        for step in checkpoint_steps(output):
            if (phase, step) in done:
                continue
            point = curve_point(source, output, step, held_out, args.curve_elements)
            seen = (step if phase == 1 else phase1_steps + step) * batch
            point |= {"phase": phase, "examples": seen}
            print(f"[reader] phase {phase} step {step}: held-out CER {point['cer'] * 100:.2f} %", flush=True)
            with curve_file.open("a") as handle:
                handle.write(json.dumps(point) + "\n")
            curve.append(point)
    curve.sort(key=lambda p: p["examples"])

    final = phase2_dir / "model"
    evaluation = evaluate_reader(final, held_out, args.decoders.split(","), args.eval_elements)

    model, _ = load_markup_model(final)
    train = PageDataset(args.corpus / "train")
    documents = {p.meta.get("document_id") for p in train.iter_pages()}
    meta = {
        "command": "./run pretrain --reader " + " ".join(argv if argv is not None else sys.argv[1:]),
        "parameters": sum(p.numel() for p in model.parameters()),
        "data": f"the corpus's train split: {len(train)} pages of {len(documents)} documents from Debian packages "
                f"{', '.join(sorted({p.meta.get('package') for p in train.iter_pages()}))}, rendered at 144 dpi; "
                "their text, title and code elements as crops (furniture is layout-only).",
        "training": (f"from {'a fresh reader' if args.init_from is None else args.init_from}: phase 1 {phase1_steps} "
                     f"steps of {configs[0].active_objectives} (lr {configs[0].optim.lr}), phase 2 "
                     f"{configs[1].train.steps} steps of {configs[1].active_objectives} (lr {configs[1].optim.lr}); "
                     f"batch {batch} elements, AdamW, cosine, DeepSpeed ZeRO-0."),
        "held_out": f"Every text, title and code element of the held-out documents ({len(held_out)} pages: "
                    "packages freefem-doc, why3-doc-pdf, python-reportlab-doc, shared-mime-info and the "
                    "pre-annotation benchmark's R-intro.pdf), cropped from the ground-truth boxes.",
        "machine": f"{platform.machine()} {'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}"
                   f", {torch.get_num_threads()} threads",
        "train_seconds": sum(s["train_seconds"] for s in sessions), "curve": curve,
        "curve_elements": args.curve_elements, "evaluation": evaluation, "made_at": time.strftime("%Y-%m-%d %H:%M"),
    }
    out = args.out.resolve()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(final, staging)
    (staging / "pretrain.json").write_text(json.dumps(meta | {"unit": "element"}, indent=2, default=str))
    write_card(staging, meta)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    print(f"[reader] wrote {out} (held-out CER {evaluation['ar']['cer'] * 100:.2f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
