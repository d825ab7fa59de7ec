"""The annotation loop's learning curve: does correcting the consistency-mined hard pages improve
the model more than correcting the least confident or random pages, at the same budget?

    python -m benchmarks.annotation_loop [--rounds 3] [--budget 32] [--seeds 0,1,2]
        [--policies mined,confidence,random] [--pool 128] [--eval-pages 32] [--steps 30]
        [--out var/bench/annotation_loop]

Annotators are simulated: a page they "correct" gets its exact ground truth (the generator's).
The pages come from the ``tiny`` layout with the full lexicon, three times the words the shipped
base (``models/pretrained/docmarkup-base``) was trained on: a domain shift whose fixes are learnable.
Per seed, the pool and the held-out evaluation pages are fixed and shared by every policy. Each
round, from the current model: pre-annotate the pool's unannotated pages, pick ``budget`` of them
by the policy (``mined``: lowest consistency C(x) over T=4 samples; ``confidence``: lowest mean
token probability of the greedy read; ``random``), add their corrections (``--check-share`` of
them set aside for the stage check, never trained on), retrain Stage 2 from the current model with
the whole annotated set as its hard pages, half of every batch, beside replayed pages of the base's own distribution (same steps, learning rate and
seed for every policy; the 1+β(1−C) weighting off, so only the choice of pages differs), keep the
retrained model only if its AR Overall on the check pages is at least its input's, and score
AR Overall on the evaluation pages. One MLflow run per (policy, seed) (experiment
``annotation-loop``), Overall by round; ``<out>/annotation_loop.json`` and ``.md`` hold the table
(median over seeds, min-max) and ``annotation_loop.png`` the curves.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks.annotation_loop.report import log_curve, plot, summary_table
from benchmarks.annotation_loop.rounds import keep_better, set_aside
from components.curation.mining import mine_consistency
from components.curation.storage import write_subset
from components.data.page_store import PageDataset
from components.data.synthetic import LEXICON, SyntheticConfig, generate_dataset
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.evaluate import evaluate_decoders
from components.training.config import load_train_config
from components.training.trainer import run_training

ROOT = Path(__file__).resolve().parents[2]
BASE_MODEL = ROOT / "models" / "pretrained" / "docmarkup-base"
POOL_SEED = 60_000_000  # + 100_000 x seed; outside every recorded training seed
EVAL_SEED = 61_000_000
REPLAY_SEED = 62_000_000  # the base's own distribution (tiny preset), replayed beside the corrections
POLICIES = ("mined", "confidence", "random")


def page_config():
    return replace(SyntheticConfig.preset("tiny"), lexicon_size=len(LEXICON))


def make_store(path: Path, n: int, seed: int):
    store = PageDataset(path)
    if not store.exists() or len(store) != n:
        generate_dataset(path, n, seed=seed, cfg=page_config())
    return store


def choose(policy: str, engine, pool, candidates: list[str], budget: int, rng: np.random.Generator,
           max_new_tokens: int, journal: str) -> tuple[list[str], dict[str, float]]:
    """The ``budget`` pages the policy sends to annotators, and the score it ranked them by."""

    if policy == "random":
        order = rng.permutation(len(candidates))[:budget]
        return [candidates[i] for i in order], {}
    if policy == "confidence":
        scores = {}
        pages = list(pool.iter_pages(page_ids=candidates))
        for first in range(0, len(pages), 8):
            chunk = pages[first:first + 8]
            results = engine.generate([pool.load_image(p) for p in chunk], DecodeParams(max_new_tokens=max_new_tokens))
            scores |= {p.page_id: r.stats.mean_confidence for p, r in zip(chunk, results, strict=True)}
    elif policy == "mined":
        report = mine_consistency(engine, pool, T=4, temperature=1.0, tau_train=0.0, max_new_tokens=max_new_tokens,
                                  page_ids=candidates, resume=False, journal_name=journal)
        scores = report.scores
    else:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    ranked = sorted(candidates, key=lambda pid: (scores[pid], pid))
    return ranked[:budget], scores


def replay_store(args):
    store = PageDataset(args.out / "replay-256")
    if not store.exists() or len(store) != 256:
        generate_dataset(store.root, 256, seed=REPLAY_SEED, cfg=SyntheticConfig.preset("tiny"))
    return store


def retrain(model_dir: Path, annotated: Path, out: Path, seed: int, args) -> Path:
    config = load_train_config(ROOT / "configs/train/stage2.yaml", {
        "name": out.name, "seed": seed, "output_dir": str(out), "model.init_from": str(model_dir),
        "data.dataset": str(replay_store(args).root), "data.hard_examples": str(annotated), "data.hard_ratio": 0.5,
        "data.consistency_beta": 0.0, "train.steps": args.steps, "train.micro_batch_size": 8,
        "train.save_every": None, "train.progress": False, "optim.lr": args.lr, "optim.warmup_steps": 5,
        "mlflow.enabled": False, "deepspeed": "configs/deepspeed/zero0.json", "train.threads": args.threads,
    })
    return run_training(config).model_dir


def overall(model_dir: Path, eval_store, max_new_tokens: int) -> float:
    report = evaluate_decoders(DecodingEngine.from_pretrained(model_dir), eval_store,
                               [DecodeParams(decoder="ar", max_new_tokens=max_new_tokens)])
    return report.decoders["ar"].overall


def run_policy(policy: str, seed: int, args, start_overall: float) -> list[float]:
    """Overall after each round (round 0: the start model) for one (policy, seed)."""

    pool = make_store(args.out / f"pool-seed{seed}-{args.pool}", args.pool, POOL_SEED + 100_000 * seed)
    eval_store = make_store(args.out / f"eval-{args.eval_pages}", args.eval_pages, EVAL_SEED)
    rng = np.random.default_rng([seed, 7])
    model_dir, annotated_ids, check_ids, curve = args.base, [], [], [start_overall]
    for round_index in range(1, args.rounds + 1):
        run_dir = args.out / "runs" / f"{policy}-seed{seed}" / f"round{round_index}"
        taken = set(annotated_ids) | set(check_ids)
        candidates = [pid for pid in pool.ids() if pid not in taken]
        engine = DecodingEngine.from_pretrained(model_dir)
        chosen, _ = choose(policy, engine, pool, candidates, args.budget, rng, args.max_new_tokens,
                           f"loop-{policy}-seed{seed}-round{round_index}.journal.jsonl")
        to_train, to_check = set_aside(chosen, args.check_share, rng)
        annotated_ids += to_train
        check_ids += to_check
        annotated = write_subset(pool, pool.iter_pages(page_ids=annotated_ids), run_dir / "annotated")
        trained = retrain(model_dir, annotated.root, run_dir / "train", seed, args)
        kept = ""
        if check_ids:
            check_pages = write_subset(pool, pool.iter_pages(page_ids=check_ids), run_dir / "check")
            score = partial(overall, eval_store=check_pages, max_new_tokens=args.max_new_tokens)
            trained, decision = keep_better(model_dir, trained, score, higher_is_better=True)
            kept = ", kept" if decision["kept_output"] else ", below its input on the check pages: not kept"
        model_dir = trained
        curve.append(overall(model_dir, eval_store, args.max_new_tokens))
        print(f"[loop] {policy} seed {seed} round {round_index}: {len(annotated_ids) + len(check_ids)} pages "
              f"corrected{kept}; Overall {curve[-1]:.2f}", flush=True)
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--pool", type=int, default=128)
    parser.add_argument("--eval-pages", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--check-share", type=float, default=0.25,
                        help="share of each round's corrected pages kept for the stage check instead of training (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--base", type=Path, default=BASE_MODEL)
    parser.add_argument("--mlflow", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "annotation_loop")
    args = parser.parse_args(argv)
    if args.rounds * args.budget > args.pool:
        parser.error(f"{args.rounds} rounds x {args.budget} pages need a pool of at least {args.rounds * args.budget}")
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    eval_store = make_store(args.out / f"eval-{args.eval_pages}", args.eval_pages, EVAL_SEED)
    start = overall(args.base, eval_store, args.max_new_tokens)
    print(f"[loop] start model {args.base}: Overall {start:.2f} on {args.eval_pages} held-out pages", flush=True)
    curves: dict[str, dict[int, list[float]]] = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for policy in args.policies.split(","):
            curve = run_policy(policy, seed, args, start)
            curves.setdefault(policy, {})[seed] = curve
            if args.mlflow:
                log_curve(f"{policy}-seed{seed}", {"policy": policy, "seed": seed, "budget": args.budget,
                                                   "steps": args.steps, "lr": args.lr, "pool": args.pool,
                                                   "check_share": args.check_share},
                          [{"overall": value} for value in curve], args.budget)
    table = summary_table(curves, args.budget)
    report = {"curves": curves, "table": table, "start_overall": start, "seconds": round(time.time() - started, 1),
              "settings": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "annotation_loop.json").write_text(json.dumps(report, indent=2))
    (args.out / "annotation_loop.md").write_text(table + "\n")
    plot(curves, args.budget, args.out / "annotation_loop.png", "AR Overall (held-out pages)")
    print(table)
    print(f"\n{report['seconds']:.0f}s; written: {args.out / 'annotation_loop.json'}")
    return 0


