"""``./run pretrain``: the shipped base checkpoint (``models/pretrained/docmarkup-base``), made from
synthetic pages in one resumable command.

Real teams start from a pretrained document VLM and fine-tune it; no weights can be downloaded
here, so this command makes ours: it draws ``--pages`` synthetic pages (``tiny`` preset) from
seeds no other part of the project uses, trains the ``base`` DocVLM (convolutional stem, see
:func:`models.docvlm.base_config`) on the objective mix of ``configs/train/pretrain.yaml``
through the same DeepSpeed trainer every stage uses, evaluates every decoder on held-out pages
from yet another seed range, and writes the model folder with a model card.

Every step resumes: page generation continues from the last finished chunk, training from the
newest DeepSpeed checkpoint (Ctrl-C saves one), evaluation is redone. A learning curve (AR
Overall on a few held-out pages every ``--curve-every`` steps) is recorded in the card.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from components.data.page_store import PageDataset
from components.data.pages import Page, atomic_write_text
from components.data.synthetic import SyntheticConfig, generate_page
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.evaluate import evaluate_decoder, evaluate_decoders
from components.training.config import PROJECT_ROOT, TrainConfigError, load_train_config
from components.training.runtime import ensure_process_env
from components.training.trainer import latest_checkpoint, run_training
from models.docvlm import count_parameters
from models.loading import load_markup_model

# Seed ranges: the demo and tests draw pages from small seeds; pretraining from 10M up; held-out
# evaluation of the base (and the benchmark's default) from 90M up. Ranges never overlap.
PRETRAIN_SEED = 10_000_000
LINES_SEED = 20_000_000  # the "lines" reading curriculum
HELD_OUT_SEED = 90_000_000
DEFAULT_OUT = PROJECT_ROOT / "models" / "pretrained" / "docmarkup-base"
WORK_DIR = PROJECT_ROOT / "var" / "pretrain"
CHUNK = 500


def generate_pages(root: Path, parts: list[tuple[str, int, int]]) -> PageDataset:
    """Synthetic pages in ``root``: for each ``(preset, n_pages, first_seed)`` the pages of seeds
    ``first_seed ..``; written in chunks, so an interrupted run continues where it stopped."""

    dataset = PageDataset(root)
    chunks = root / "chunks"
    total = sum(n for _, n, _ in parts)
    if dataset.exists() and len(dataset) == total:
        return dataset
    chunks.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    done = {p.stem for p in chunks.glob("*.jsonl")}
    with tqdm(total=total, desc="pages", unit="page", dynamic_ncols=True) as bar:
        for preset, n_pages, seed in parts:
            cfg = SyntheticConfig.preset(preset)
            for index in range((n_pages + CHUNK - 1) // CHUNK):
                name = f"{preset}-{seed}-{index:05d}"
                names.append(name)
                first, last = index * CHUNK, min(n_pages, (index + 1) * CHUNK)
                if name in done:
                    bar.update(last - first)
                    continue
                records = []
                for offset in range(first, last):
                    page_id = None if preset == "tiny" else f"{preset}-{seed + offset:08d}"
                    page, image = generate_page(seed + offset, cfg, page_id=page_id)
                    records.append(replace(page, image=dataset.save_image(page.page_id, image), meta={
                        **page.meta, "preset": preset}))
                    bar.update(1)
                atomic_write_text(chunks / f"{name}.jsonl", "".join(json.dumps(p.to_json()) + "\n" for p in records))
    pages: list[Page] = []
    for name in names:
        lines = (chunks / f"{name}.jsonl").read_text().splitlines()
        pages += [Page.from_json(json.loads(line)) for line in lines if line.strip()]
    dataset.write(pages)
    return dataset


def evaluate_base(model_dir: Path, pages_dir: Path, n_pages: int, max_new_tokens: int, decoders: list[str]) -> dict:
    """Every decoder on the held-out pages, greedy, batch 1, ratios from this run."""

    engine = DecodingEngine.from_pretrained(model_dir)
    params = [DecodeParams(decoder=name, max_new_tokens=max_new_tokens) for name in decoders]
    report = evaluate_decoders(engine, PageDataset(pages_dir), params, limit=n_pages)
    summary = report.as_dict()
    ar_pages = report.decoders["ar"].pages
    summary["ar_eos_fraction"] = sum(not row["truncated"] for row in ar_pages) / len(ar_pages)
    print(report.table())
    return summary


def model_at_checkpoint(train_dir: Path, step: int, source: Path | None = None):
    """The model as of a DeepSpeed checkpoint of this run (ZeRO 0-2 keep whole weights per file);
    ``source``: the folder the run started from (default: the one it bootstrapped)."""

    model, tokenizer = load_markup_model(source or train_dir / "bootstrap_model")
    states = torch.load(train_dir / "checkpoints" / f"step_{step:07d}" / "mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)["module"]
    model.load_state_dict({k.removeprefix("model."): v for k, v in states.items()})
    return model.eval(), tokenizer


def curve_point(train_dir: Path, step: int, held_out_dir: Path, n_pages: int, max_new_tokens: int) -> dict:
    """AR Overall of the checkpoint at ``step`` on the first ``n_pages`` held-out pages."""

    model, tokenizer = model_at_checkpoint(train_dir, step)
    dataset = PageDataset(held_out_dir)
    ev = evaluate_decoder(DecodingEngine(model, tokenizer), dataset, DecodeParams(decoder="ar", max_new_tokens=max_new_tokens),
                          list(dataset.iter_pages(page_ids=dataset.ids(limit=n_pages))))
    history = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [h["loss"] for h in history if step - 50 < h["step"] <= step]
    return {"step": step, "overall": ev.overall, "loss": sum(losses) / max(1, len(losses)),
            "text_edit": ev.scores.get("text_edit"), "table_teds": ev.scores.get("table_teds"),
            "formula_edit": ev.scores.get("formula_edit")}


def write_model_card(out: Path, meta: dict) -> Path:
    """``README.md`` of the model folder: what it is, how it was made, what it scores.

    ``meta`` says how it was made in prose (``data``, ``training``, ``machine``) so the stored-set
    and the streamed pretraining share one card; ``curve`` rows become a table as they are."""
    ev = meta["evaluation"]
    rows = []
    for name, values in ev["decoders"].items():
        scores, speed, ratio = values["scores"], values["speed"], ev["ratios"][name]
        rows.append(
            f"| {name} | {values['overall']:.2f} | {scores.get('text_edit', float('nan')):.3f} | "
            f"{scores.get('table_teds', float('nan')):.3f} | {scores.get('formula_edit', float('nan')):.3f} | "
            f"{speed['tokens_per_forward']:.2f} | {ratio['forward_reduction']:.2f}x | {ratio['same_output_as_ar']:.2f} |"
        )
    curve_rows = meta.get("curve", [])
    columns = list(curve_rows[0]) if curve_rows else []
    curve = "\n".join(
        ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        + ["| " + " | ".join(f"{row.get(c):.4g}" if isinstance(row.get(c), float) else str(row.get(c)) for c in columns)
           + " |" for row in curve_rows]) if columns else "(none recorded)"
    card = f"""# docmarkup-base

The base checkpoint the demo and the benchmark start from (as a real team starts from dots.ocr or
MinerU2.5): a {meta['parameters'] / 1e6:.1f}M-parameter DocVLM (`models/docvlm.py`, `base_config`:
convolutional stem, 2-layer ViT, 4-layer Qwen2 decoder from `transformers` configs) with its own
markup BPE tokenizer ({meta['vocab_size']} tokens incl. `<INIT>` / `<MASK>`).

Made by `{meta['command']}`.

- Data: {meta['data']} (the demo uses seeds below 1M; held-out evaluation uses {meta['held_out_seed']}+;
  `pretrain.json` lists every seed run the weights saw).
- Training: {meta['training']}.
- Machine: {meta['machine']}; training wall time {meta['train_seconds'] / 60:.1f} min.

## Held-out evaluation

{ev['n_pages']} `tiny` pages, seeds {meta['held_out_seed']}.., greedy, batch 1, max {meta['max_new_tokens']} new tokens;
AR pages ending with `<eos>` inside the budget: {ev['ar_eos_fraction'] * 100:.1f} %.

| decoder | Overall | text edit | table TEDS | formula edit | tokens/forward | forwards vs AR | = AR output |
| --- | --- | --- | --- | --- | --- | --- | --- |
{chr(10).join(rows)}

## Learning curve

{meta.get('curve_note', '')}

{curve}
{meta.get('notes', '')}"""
    atomic_write_text(out / "README.md", card)
    return out / "README.md"


def install_base(model_dir: Path, out: Path, held_out_dir: Path, made: dict, args: argparse.Namespace) -> dict:
    """Evaluate ``model_dir`` on the held-out pages and install it at ``out`` with ``pretrain.json``
    and its card (staged, then renamed, so a failed run never leaves half a base)."""

    generate_pages(held_out_dir, [("tiny", args.eval_pages, HELD_OUT_SEED)])
    print(f"[pretrain] evaluating {model_dir} on {args.eval_pages} held-out pages")
    evaluation = evaluate_base(model_dir, held_out_dir, args.eval_pages, args.max_new_tokens, args.decoders.split(","))
    model, tokenizer = load_markup_model(model_dir)
    meta = {
        "held_out_seed": HELD_OUT_SEED, "preset": "tiny", "parameters": count_parameters(model),
        "vocab_size": len(tokenizer), "max_new_tokens": args.max_new_tokens,
        "machine": f"{platform.machine()} {'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}"
                   f", {torch.get_num_threads()} threads",
        **made, "evaluation": evaluation,
    }
    if args.notes is not None:
        meta["notes"] = "\n" + args.notes.read_text()
    out = out.resolve()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(model_dir, staging, ignore=shutil.ignore_patterns("streamed.json"))
    (staging / "pretrain.json").write_text(json.dumps(meta, indent=2, default=str))
    write_model_card(staging, meta)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    print(f"[pretrain] wrote {out} (AR Overall {evaluation['decoders']['ar']['overall']:.2f})")
    return meta


def streamed_made(model_dir: Path) -> dict:
    """How a :mod:`recipes.streamed_pretrain` folder was made, from its ``streamed.json``
    (following ``init`` back through the runs it continued)."""
    chain, meta = [], json.loads((model_dir / "streamed.json").read_text())
    while meta is not None:
        chain.insert(0, meta)
        meta = meta.get("init")
    curve, base = [], 0
    for run in chain:
        curve += [{"step": base + p["step"], "lr": run["lr"], "train loss": p["train_loss"], "val AR loss": p["val_ar"],
                   "val AR loss, other page's image": p["val_ar_other_image"], "val token accuracy": p["val_token_accuracy"]}
                  for p in run["curve"]]
        base += run["steps"]
    last = chain[-1]
    runs = "; then ".join(
        f"{r['steps']} steps at lr {r['lr']:g} ({r['fresh_batches']} fresh batches, {r['replayed_batches']} replayed)"
        for r in chain)
    mix = last["page_mix"]
    return {
        "command": " && ".join(r["command"] for r in chain), "steps": sum(r["steps"] for r in chain),
        "micro_batch_size": last["batch"], "objectives": last["objectives"], "seen_seeds": last["seen_seeds"],
        "train_seconds": sum(r["train_seconds"] for r in chain), "curve": curve, "machine": last["machine"],
        "data": (f"synthetic pages rendered while training (`tiny` seeds {PRETRAIN_SEED}+, easy `lines` pages from "
                 f"{LINES_SEED}+ making up {mix['early_lines']:.0%} of each batch for the first {mix['early_steps']} "
                 f"data steps and {mix['lines']:.0%} after), no page used twice except by the replay buffer"),
        "training": (f"batch {last['batch']}, objectives {last['objectives']}, AdamW, warm-up then cosine; {runs}"),
        "curve_note": "Validation on 64 `tiny` pages (seeds 95M+), teacher-forced; the gap to the loss with "
                      "another page's image is how much the model reads the page.",
    }


def pretrain_parser(prog: str, description: str, *, config: str, out: Path, work_dir: Path,
                    decoders: str) -> argparse.ArgumentParser:
    """The options every pretraining command has: its config and overrides, where the model is
    installed, where the run works, and the decoders evaluated at the end."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=config)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--work-dir", type=Path, default=work_dir)
    parser.add_argument("--decoders", default=decoders)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = pretrain_parser("./run pretrain", __doc__.split("\n")[0], config="configs/train/pretrain.yaml",
                             out=DEFAULT_OUT, work_dir=WORK_DIR, decoders="ar,sdb,block,ppc")
    parser.add_argument("--pages", type=int, default=12_000, help="synthetic training pages (tiny preset)")
    parser.add_argument("--lines-pages", type=int, default=6_000,
                        help="extra easy pages (lines preset: one or two short blocks) mixed in as a reading curriculum")
    parser.add_argument("--eval-pages", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--curve-every", type=int, default=500, help="score a checkpoint every N steps")
    parser.add_argument("--stop-at-step", type=int, default=None, help="checkpoint and stop at this step (resume later)")
    parser.add_argument("--publish", type=Path, default=None, metavar="MODEL_DIR",
                        help="evaluate a model folder made by recipes.streamed_pretrain and install it "
                             "as the base (no training)")
    parser.add_argument("--notes", type=Path, default=None, help="markdown appended to the model card")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work_dir.resolve()
    pages_dir, held_out_dir, train_dir = work / "pages", work / "held_out", work / "train"
    if args.publish is not None:
        if not (args.publish / "streamed.json").is_file():
            print(f"{args.publish} has no streamed.json: not a streamed_pretrain model folder", file=sys.stderr)
            return 2
        install_base(args.publish.resolve(), args.out, held_out_dir, streamed_made(args.publish.resolve()), args)
        return 0
    overrides = [f"data.dataset={pages_dir}", f"output_dir={train_dir}", *args.overrides]
    try:
        config = load_train_config(args.config, overrides)
    except TrainConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"[pretrain] pages -> {pages_dir}; checkpoints and log -> {train_dir} (metrics.jsonl)")
    generate_pages(pages_dir, [("tiny", args.pages, PRETRAIN_SEED), ("lines", args.lines_pages, LINES_SEED)])
    generate_pages(held_out_dir, [("tiny", args.eval_pages, HELD_OUT_SEED)])

    ensure_process_env()

    curriculum_file = work / "curriculum.json"
    if not curriculum_file.exists():  # from which step the lines pages were in the data

        found = latest_checkpoint(train_dir)
        atomic_write_text(curriculum_file, json.dumps({"lines_from_step": found[1] if found else 0}))
    sessions_file, curve_file = work / "sessions.json", train_dir / "curve.jsonl"
    sessions = json.loads(sessions_file.read_text()) if sessions_file.exists() else []
    started = time.time()
    total = config.train.steps
    stop = min(args.stop_at_step or total, total)
    # Train in segments of --curve-every steps; after each, score the checkpoint for the curve.
    while True:
        done = {json.loads(line)["step"] for line in curve_file.read_text().splitlines()} if curve_file.exists() else set()
        target = min(stop, (max(done, default=0) // args.curve_every + 1) * args.curve_every)
        result = run_training(config, stop_at_step=target if target < total else None)
        sessions.append({"start_step": result.start_step, "final_step": result.final_step,
                         "train_seconds": result.train_seconds, "machine": platform.node()})
        atomic_write_text(sessions_file, json.dumps(sessions, indent=2))
        if result.final_step < target:  # Ctrl-C / SIGTERM: the trainer saved a checkpoint
            print(f"[pretrain] stopped at step {result.final_step}; run the same command again to resume")
            return 3
        if result.final_step < total:
            point = curve_point(train_dir, result.final_step, held_out_dir, 16, args.max_new_tokens)
            with curve_file.open("a") as handle:
                handle.write(json.dumps(point) + "\n")
            print(f"[pretrain] step {point['step']}/{total}: AR Overall {point['overall']:.2f} on 16 held-out pages "
                  f"(loss {point['loss']:.3f})", flush=True)
        if result.final_step >= stop:
            break
    if result.model_dir is None:
        print(f"[pretrain] checkpointed at step {result.final_step}; run the same command again to continue")
        return 3
    print(f"[pretrain] trained in {time.time() - started:.0f}s")
    history = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [json.loads(line) for line in curve_file.read_text().splitlines()] if curve_file.exists() else []
    lines_from = json.loads(curriculum_file.read_text())["lines_from_step"]
    zero = json.loads(config.path(config.deepspeed).read_text())["zero_optimization"]["stage"]
    made = {
        "command": "python -m recipes.pretrain " + " ".join(argv if argv is not None else sys.argv[1:]),
        "pages": args.pages, "seed": PRETRAIN_SEED, "lines_pages": args.lines_pages, "lines_seed": LINES_SEED,
        "steps": result.final_step, "micro_batch_size": config.train.micro_batch_size,
        "objectives": config.active_objectives, "lr": config.optim.lr, "schedule": config.optim.schedule,
        "zero_stage": zero, "train_seconds": sum(s["train_seconds"] for s in sessions), "sessions": len(sessions),
        "final_loss": history[-1]["loss"] if history else None, "curve": curve, "curve_pages": 16,
        "lines_from_step": lines_from,
        "seen_seeds": [[PRETRAIN_SEED, PRETRAIN_SEED + args.pages - 1], [LINES_SEED, LINES_SEED + args.lines_pages - 1]],
        "data": (f"{args.pages} synthetic `tiny` pages, seeds {PRETRAIN_SEED}..{PRETRAIN_SEED + args.pages - 1}, plus "
                 f"{args.lines_pages} easy `lines` pages (one or two short blocks; seeds {LINES_SEED}+) mixed in from "
                 f"step {lines_from} as a reading curriculum"),
        "training": (f"{result.final_step} optimizer steps, batch {config.train.micro_batch_size}, objectives "
                     f"{config.active_objectives}, AdamW lr {config.optim.lr} ({config.optim.schedule}), DeepSpeed "
                     f"ZeRO-{zero}, in {len(sessions)} segments (AR Overall on 16 held-out pages after each)"),
    }
    install_base(result.model_dir, args.out, held_out_dir, made, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
