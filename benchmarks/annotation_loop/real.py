"""The annotation loop on real documents: does correcting a team's pages make the reader read the
rest of their documents better, round after round, and do mined pages beat random ones?

    python -m benchmarks.annotation_loop --real [--rounds 3] [--budget 16] [--seeds 0,1,2]
        [--policies mined,confidence,random] [--pool 64] [--eval-pages 32] [--steps-per-page 2]
        [--lr 1e-4] [--model models/pretrained/docmarkup-reader] [--out var/bench/annotation_loop_real]

Document families the reader never saw: Debian documentation packages (:data:`FAMILIES`) outside
the corpus it was trained on and outside every held-out list, fetched and read from their text
layer as the corpus is (:mod:`components.data.corpus`). Each family's documents are split by
document: about a third of them (by a hash of the document) are held out, the rest are the pool.
Every policy and seed works on the same pool and held-out pages.

Annotators are simulated: a page they correct gets its text layer's exact elements. Each round,
from the current model: pre-annotate the pool's unannotated pages (the elements' ground-truth
crops, as the mining flow reads them), pick ``budget`` pages by the policy (``mined``: lowest
consistency C over T=4 samples at temperature 1, per element as the mining flow scores them, the
page's C the mean; the samples are decoded with SDB, each committed token a draw from AR's own
conditional, so they follow AR's sampling distribution at a fraction of the forwards; ``confidence``: lowest token-weighted confidence of the greedy read; ``random``),
add their corrections, retrain Stage 2 from the current model (the corrected pages as its hard
share beside replayed pages of the reader's own corpus; steps proportional to the new pages; the
1+β(1−C) weighting off, so only the choice of pages differs), keep the retrained model only if it
reads the corrected pages set aside for checking (``--check-share`` of each round's, never trained
on) at least as well as its input, as the chain's stage check does, and score the held-out pages:
**body text edit** (per page, the normalised edit distance between the text/title/code elements read
and the truth, whitespace collapsed; mean over pages) and CER per category. Reads are greedy and
decoded with SDB, which commits only tokens AR's greedy pass verifies; the start model's AR and SDB
readings of the held-out pages are compared once and the agreement printed.

The frozen tower's frames of every line are computed once and reused by every round, policy and
seed (:func:`models.reader.keep_frames_at_inference`): only the decoder changes.

Writes ``<out>/annotation_loop_real.json`` (``{"metric": "body_text_edit", "budget": B, "policies":
{policy: [[round0 seeds...], [round1 seeds...], ...]}, ...}``, lower is better) and ``.md``, the plot
``annotation_loop_real.png``, and one MLflow run per (policy, seed) (experiment ``annotation-loop``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import torch
from rapidfuzz.distance import Levenshtein

from benchmarks.annotation_loop.report import log_curve, plot, summary_table
from benchmarks.annotation_loop.rounds import keep_better, set_aside
from components.curation.mining import mine_consistency
from components.curation.storage import write_subset
from components.data.corpus import HELD_OUT_DOCUMENTS, HELD_OUT_PACKAGES, build_corpus
from components.data.page_store import PageDataset
from components.data.pages import Page
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.element_reading import ElementReading, read_store, summarize_readings
from components.parsing.parse import ParseSettings
from components.training.config import load_train_config
from components.training.trainer import run_training
from models.reader import keep_frames_at_inference
from recipes.build_corpus import rapid_layout_regions
from recipes.reader_pretrain import CORPUS_PACKAGES

ROOT = Path(__file__).resolve().parents[2]
READER = ROOT / "models" / "pretrained" / "docmarkup-reader"
RESULT = ROOT / "benchmarks" / "results" / "annotation_loop_real.json"
# Families the reader never saw: none is in its corpus or in a held-out list (checked at start).
FAMILIES = ("pari-doc", "asymptote-doc", "octave-doc")
# The reader's own corpus, replayed beside the corrections (a part of its training packages).
REPLAY_PACKAGES = ("r-doc-pdf", "gri-pdf-doc", "siscone-doc-pdf", "docbook-xsl-doc-pdf", "auto-multiple-choice-doc-pdf")
HELD_OUT_SHARE = 1 / 3  # of each family's documents, at least one
POLICIES = ("mined", "confidence", "random")
MINING_SAMPLES = 4
METRIC = "body_text_edit"


def check_families(families: tuple[str, ...]) -> None:
    """A family the reader trained on, or one the corpus holds out for other benchmarks, measures nothing new."""
    held = set(HELD_OUT_PACKAGES) | {package for package, _ in HELD_OUT_DOCUMENTS}
    seen = [f for f in families if f in CORPUS_PACKAGES or f in held]
    if seen:
        raise ValueError(f"{seen} are in the reader's corpus or a held-out list: pick families it never saw")


def document_rank(document_id: str) -> str:
    return hashlib.sha256(f"annotation-loop:{document_id}".encode()).hexdigest()


def split_by_document(pages: list[Page]) -> tuple[list[Page], list[Page]]:
    """(pool, held-out): per family (package), the documents ranked by a hash; the first third held out."""
    documents: dict[str, dict[str, list[Page]]] = defaultdict(lambda: defaultdict(list))
    for page in pages:
        documents[page.meta["package"]][page.meta["document_id"]].append(page)
    pool, held_out = [], []
    for package in sorted(documents):
        ranked = sorted(documents[package], key=document_rank)
        n_held = max(1, round(len(ranked) * HELD_OUT_SHARE)) if len(ranked) > 1 else 0
        for index, document in enumerate(ranked):
            (held_out if index < n_held else pool).extend(documents[package][document])
    return pool, held_out


def spread(pages: list[Page], limit: int, seed: int = 0) -> list[Page]:
    """At most ``limit`` pages, drawn at random (fixed seed) so every document keeps its share."""
    if len(pages) <= limit:
        return pages
    order = np.random.default_rng(seed).permutation(len(pages))[:limit]
    return [pages[i] for i in sorted(order)]


def write_pages(target: PageDataset, pages: list[Page], source: dict[str, PageDataset]) -> None:
    """``pages`` (from the stores ``source`` names for each page id) as one store, images copied."""
    for page in pages:
        page.image = target.save_image(page.page_id, source[page.page_id].load_image(page))
    target.upsert(pages)


def prepare_pages(args) -> tuple[PageDataset, PageDataset, PageDataset]:
    """The pool, the held-out pages and the replay store (built once, then reused)."""
    pool, held_out = PageDataset(args.out / "pool"), PageDataset(args.out / "heldout")
    replay = PageDataset(args.out / "replay" / "train")
    regions = None
    if not (pool.exists() and held_out.exists()):
        regions = rapid_layout_regions()
        families = args.out / "families"
        build_corpus(list(args.families), families, cache=args.cache, pages_per_document=args.pages_per_document,
                     regions=regions)
        stores = [PageDataset(families / split) for split in ("train", "val", "test")]
        pages = [page for store in stores if store.exists() for page in store.iter_pages()]
        source = {page.page_id: store for store in stores if store.exists() for page in store.iter_pages()}
        pool_pages, held_pages = split_by_document(pages)
        write_pages(pool, spread(pool_pages, args.pool), source)
        write_pages(held_out, spread(held_pages, args.eval_pages), source)
    if not replay.exists():
        build_corpus(list(REPLAY_PACKAGES), args.out / "replay", cache=args.cache, pages_per_document=6,
                     max_pages=args.replay_pages, regions=regions or rapid_layout_regions())
    documents = {split: len({p.meta["document_id"] for p in store.iter_pages()})
                 for split, store in (("pool", pool), ("held-out", held_out))}
    print(f"[loop] pool {len(pool)} pages ({documents['pool']} documents), held out {len(held_out)} pages "
          f"({documents['held-out']} documents), replay {len(replay)} pages", flush=True)
    return pool, held_out, replay


def body_text_edit(readings: list[ElementReading]) -> float:
    """Mean over pages of the normalised edit distance between the body read and the truth."""
    pages: dict[str, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for reading in readings:
        read, truth = pages[reading.page_id]
        read.append(reading.content)
        truth.append(reading.truth)
    edits = []
    for read, truth in pages.values():
        a, b = " ".join(" ".join(read).split()), " ".join(" ".join(truth).split())
        edits.append(Levenshtein.distance(a, b) / max(len(a), len(b), 1))
    return statistics.fmean(edits) if edits else 0.0


def greedy(args) -> DecodeParams:
    return DecodeParams(decoder="sdb", max_new_tokens=args.max_new_tokens)


def body_edit_of(model_dir: Path, pages: PageDataset, args) -> float:
    return body_text_edit(read_store(DecodingEngine.from_pretrained(model_dir), pages, greedy(args))[0])


def score(engine, held_out: PageDataset, args) -> dict[str, float]:
    return scores_of(read_store(engine, held_out, greedy(args))[0])


def scores_of(readings: list[ElementReading]) -> dict[str, float]:
    summary = summarize_readings(readings)
    return {METRIC: body_text_edit(readings), "cer": summary["cer"],
            **{f"cer_{category}": entry["cer"] for category, entry in summary["by_category"].items()}}


def page_confidence(readings: list[ElementReading]) -> dict[str, float]:
    """Token-weighted mean confidence of each page's elements."""
    weighted: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for reading in readings:
        weighted[reading.page_id][0] += (reading.confidence or 0.0) * reading.tokens
        weighted[reading.page_id][1] += reading.tokens
    return {page_id: total / max(tokens, 1) for page_id, (total, tokens) in weighted.items()}


def choose(policy: str, engine, pool: PageDataset, candidates: list[str], args, rng: np.random.Generator,
           journal: str, seed: int) -> list[str]:
    """The ``budget`` pages the policy sends to annotators."""
    if policy == "random":
        return [candidates[i] for i in rng.permutation(len(candidates))[:args.budget]]
    if policy == "confidence":
        subset = write_subset(pool, pool.iter_pages(page_ids=candidates), args.out / "runs" / journal / "candidates")
        readings, _ = read_store(engine, subset, greedy(args))
        scores = page_confidence(readings)
    elif policy == "mined":
        report = mine_consistency(engine, pool, T=MINING_SAMPLES, temperature=1.0, tau_train=0.0, seed=seed,
                                  decoder=args.mining_decoder, max_new_tokens=args.max_new_tokens,
                                  page_ids=candidates, resume=False,
                                  journal_name=f"{journal}.journal.jsonl",
                                  parsing=ParseSettings(mode="elements", layout="ground-truth"))
        scores = report.scores
    else:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    ranked = sorted((pid for pid in candidates if pid in scores), key=lambda pid: (scores[pid], pid))
    return ranked[:args.budget]


def retrain(model_dir: Path, annotated: PageDataset, replay: PageDataset, new_pages: int, out: Path, seed: int,
            args) -> Path:
    """Stage 2 from the current model: the corrected pages beside the replayed corpus."""
    config = load_train_config(ROOT / "configs/train/stage2.yaml", {
        "name": out.name, "seed": seed, "output_dir": str(out), "model.init_from": str(model_dir),
        "data.dataset": str(replay.root), "data.hard_examples": str(annotated.root), "data.hard_ratio": args.hard_ratio,
        "data.consistency_beta": 0.0, "data.unit": "element", "data.max_tokens": 384,
        "objectives": {"ar": 1.0, "dar": 0.5}, "train.steps": max(1, round(args.steps_per_page * new_pages)),
        "train.micro_batch_size": args.batch, "train.save_every": None, "train.progress": False,
        "optim.lr": args.lr, "optim.warmup_steps": 2, "mlflow.enabled": False,
        "deepspeed": "configs/deepspeed/zero0.json", "train.threads": args.threads,
    })
    return run_training(config).model_dir


def run_policy(policy: str, seed: int, pool: PageDataset, held_out: PageDataset, replay: PageDataset, args,
               start: dict[str, float]) -> list[dict[str, float]]:
    """The held-out scores after each round (round 0: the start model) for one (policy, seed);
    ``check_share`` of each round's corrected pages go to the stage check instead of training."""
    rng = np.random.default_rng([seed, 7])
    model_dir, annotated_ids, check_ids, curve = args.model, [], [], [start]
    for round_index in range(1, args.rounds + 1):
        started = time.perf_counter()
        run_dir = args.out / "runs" / f"{policy}-seed{seed}" / f"round{round_index}"
        taken = set(annotated_ids) | set(check_ids)
        candidates = [pid for pid in pool.ids() if pid not in taken]
        engine = DecodingEngine.from_pretrained(model_dir)
        chosen = choose(policy, engine, pool, candidates, args, rng, f"{policy}-seed{seed}-round{round_index}",
                        seed=1000 * seed + round_index)
        to_train, to_check = set_aside(chosen, args.check_share, rng)
        annotated_ids += to_train
        check_ids += to_check
        annotated = write_subset(pool, pool.iter_pages(page_ids=annotated_ids), run_dir / "annotated")
        trained = retrain(model_dir, annotated, replay, len(to_train), run_dir / "train", seed, args)
        decision = {}
        if check_ids:
            check_pages = write_subset(pool, pool.iter_pages(page_ids=check_ids), run_dir / "check")
            trained, decision = keep_better(model_dir, trained, partial(body_edit_of, pages=check_pages, args=args),
                                            higher_is_better=False)
        model_dir = trained
        curve.append(score(DecodingEngine.from_pretrained(model_dir), held_out, args) | decision)
        kept = "" if not decision else ", kept" if decision["kept_output"] else ", below its input on the check pages: not kept"
        print(f"[loop] {policy} seed {seed} round {round_index}: {len(annotated_ids) + len(check_ids)} pages corrected"
              f"{kept}; held-out body edit {curve[-1][METRIC]:.4f} (start {start[METRIC]:.4f}), "
              f"CER {curve[-1]['cer']:.4f}, {time.perf_counter() - started:.0f} s", flush=True)
    return curve


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", action="store_true", help="(this mode)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--families", type=lambda s: tuple(s.split(",")), default=FAMILIES)
    p.add_argument("--pages-per-document", type=int, default=10)
    p.add_argument("--pool", type=int, default=64)
    p.add_argument("--eval-pages", type=int, default=32)
    p.add_argument("--replay-pages", type=int, default=160)
    p.add_argument("--steps-per-page", type=float, default=2.0, help="training steps per newly corrected page")
    p.add_argument("--batch", type=int, default=16, help="elements per training step")
    p.add_argument("--hard-ratio", type=float, default=0.5, help="share of each batch from the corrected pages")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--check-share", type=float, default=0.25,
                   help="share of each round's corrected pages kept for the stage check instead of training (0: none)")
    p.add_argument("--max-new-tokens", type=int, default=768)
    p.add_argument("--mining-decoder", default="sdb",
                   help="decoder of the T samples: sdb commits only tokens drawn from AR's own conditionals, "
                        "so its samples follow AR's distribution at ~1/8 of the forwards")
    p.add_argument("--model", type=Path, default=READER)
    p.add_argument("--cache", type=Path, default=ROOT / "var" / "debian")
    p.add_argument("--mlflow", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "annotation_loop_real")
    p.add_argument("--result", type=Path, default=RESULT, help="where the committed JSON goes")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    check_families(args.families)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    keep_frames_at_inference(True)
    try:
        return run_loop(args)
    finally:
        keep_frames_at_inference(False)


def run_loop(args) -> int:
    """The start model's scores, then every (seed, policy) in turn, then the report."""
    started = time.time()
    pool, held_out, replay = prepare_pages(args)
    if args.rounds * args.budget > len(pool):
        raise SystemExit(f"{args.rounds} rounds x {args.budget} pages need a pool of at least "
                         f"{args.rounds * args.budget} pages; it has {len(pool)}")
    engine = DecodingEngine.from_pretrained(args.model)
    sdb, _ = read_store(engine, held_out, greedy(args))
    start = scores_of(sdb)
    ar, _ = read_store(engine, held_out, DecodeParams(max_new_tokens=args.max_new_tokens))
    same = sum(a.content == b.content for a, b in zip(ar, sdb, strict=True))
    print(f"[loop] start {args.model.name}: body edit {start[METRIC]:.4f}, CER {start['cer']:.4f} on "
          f"{len(held_out)} held-out pages; SDB reads as AR on {same}/{len(ar)} elements", flush=True)
    curves: dict[str, dict[int, list[dict[str, float]]]] = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for policy in args.policies.split(","):
            curve = run_policy(policy, seed, pool, held_out, replay, args, start)
            curves.setdefault(policy, {})[seed] = curve
            if args.mlflow:
                log_curve(f"real-{policy}-seed{seed}", {"mode": "real", "policy": policy, "seed": seed,
                                                        "budget": args.budget, "steps_per_page": args.steps_per_page,
                                                        "lr": args.lr, "check_share": args.check_share,
                                                        "pool": len(pool)}, curve, args.budget)
    write_report(curves, start, same, len(ar), pool, held_out, args, time.time() - started)
    return 0


def write_report(curves, start, same: int, compared: int, pool, held_out, args, seconds: float) -> None:
    edit = {policy: {seed: [r[METRIC] for r in curve] for seed, curve in by_seed.items()}
            for policy, by_seed in curves.items()}
    rounds = args.rounds + 1
    report = {
        "metric": METRIC, "budget": args.budget,
        "policies": {policy: [[by_seed[seed][r] for seed in sorted(by_seed)] for r in range(rounds)]
                     for policy, by_seed in edit.items()},
        "seeds": sorted(next(iter(edit.values()))),
        "cer": {policy: [[curve[r]["cer"] for _, curve in sorted(by_seed.items())] for r in range(rounds)]
                for policy, by_seed in curves.items()},
        "by_round": {policy: {str(seed): curve for seed, curve in by_seed.items()} for policy, by_seed in curves.items()},
        "start": start, "sdb_equals_ar": f"{same}/{compared} held-out elements",
        "families": list(args.families), "pool_pages": len(pool), "held_out_pages": len(held_out),
        "documents": {"pool": sorted({p.meta["pdf"] for p in pool.iter_pages()}),
                      "held_out": sorted({p.meta["pdf"] for p in held_out.iter_pages()})},
        "seconds": round(seconds, 1),
        "settings": {k: str(v) for k, v in vars(args).items() if k not in ("real", "result")},
    }
    table = summary_table(edit, args.budget, digits=4)
    report["table"] = table
    for path in (args.out / "annotation_loop_real.json", args.result):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    (args.out / "annotation_loop_real.md").write_text(table + "\n")
    plot(edit, args.budget, args.result.with_suffix(".png"), "body text edit (held-out documents)")
    print(table)
    print(f"\n{seconds:.0f} s; written: {args.result}")
