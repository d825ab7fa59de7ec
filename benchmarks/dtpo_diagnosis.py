"""What DTPO's log-probs and credit are on a real batch, under the older defaults and the current ones.

    python -m benchmarks.dtpo_diagnosis [--model models/pretrained/docmarkup-base] [--pages 16] [--draws 8]

Two questions, answered on the shipped base and a batch of synthetic training pages (seed 40,000,000,
the DARL ablation's), each over several window/candidate draws:

1. **Whose distribution does DTPO move?** For every credited candidate token whose earlier candidate
   tokens are all correct (its context is ground truth), the gap between DTPO's log-prob and the
   clean pass's (teacher-forced AR) log-prob of the same token. A gap of 0 means DTPO's gradient
   acts on the AR distribution, i.e. the verifier; the drafter SDB's acceptance depends on is the
   distribution of the ``<INIT>`` context.
2. **What does the credit do to tokens no candidate is preferred for?** The net advantage weight
   per slot, sum_k A_k w_k,j / K, at slots where every candidate holds the same token (mean and
   range over samples): zero when the credit is fair, otherwise DTPO pushes a shared token up or
   down regardless of the rewards.

Writes ``benchmarks/results/dtpo_diagnosis.json`` (or ``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.darl_ablation import TRAIN_SEED
from components.data.page_store import PageDataset
from components.data.synthetic import SyntheticConfig, generate_dataset
from components.training.config import load_train_config
from components.training.darl import net_slot_weight
from components.training.data import collate, load_examples
from components.training.mix import ObjectiveMix
from models.loading import load_markup_model

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "older defaults": {"darl.policy_context": "candidate", "darl.ar_slot": "score", "darl.lookahead_slots": "init",
                       "darl.credit": "lcp_per_candidate"},
    "current defaults": {},
}


def _shared_slots(record: dict) -> torch.Tensor:
    """(B, w) pickup slots where every candidate holds the same token."""
    candidates = record["candidates"]
    same = (candidates == candidates[:, :1]).all(dim=1)
    pickup = torch.arange(candidates.shape[-1])[None, :] < record["n_pickup"][:, None]
    return same & pickup


def diagnose(model, config, batch, draws: int) -> dict:
    mix = ObjectiveMix(model, config)
    gaps, per_slot = [], {}
    shared_weights = []
    for draw in range(draws):
        mix.record = {}
        with torch.no_grad():
            mix(batch, torch.Generator().manual_seed(draw))
        record = mix.record
        gaps.extend((record["policy_logp"] - record["clean_logp"])[record["ground_truth_context"]].abs().tolist())
        net = net_slot_weight(record["advantages"], record["credit"])
        shared = _shared_slots(record)
        shared_weights.extend(net[shared].tolist())
        for slot in range(min(4, net.shape[1])):
            keep = shared[:, slot]
            per_slot.setdefault(slot, []).extend(net[keep, slot].tolist())
    return {
        "ground_truth_context_tokens": len(gaps),
        "logp_gap_max": max(gaps, default=float("nan")),
        "logp_gap_median": statistics.median(gaps) if gaps else float("nan"),
        "shared_tokens": len(shared_weights),
        "shared_net_weight_mean": statistics.fmean(shared_weights) if shared_weights else float("nan"),
        "shared_net_weight_min": min(shared_weights, default=float("nan")),
        "shared_net_weight_max": max(shared_weights, default=float("nan")),
        "net_weight_by_slot": {str(s): statistics.fmean(v) if v else float("nan") for s, v in per_slot.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "pretrained" / "docmarkup-base")
    parser.add_argument("--pages", type=int, default=16)
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--work", type=Path, default=ROOT / "var" / "bench" / "dtpo_diagnosis")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dtpo_diagnosis.json")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    store = PageDataset(args.work / f"pages-{args.pages}")
    if not store.exists() or len(store) != args.pages:
        generate_dataset(store.root, args.pages, seed=TRAIN_SEED, cfg=SyntheticConfig.preset("tiny"))
    model, tokenizer = load_markup_model(args.model)
    model.eval()
    results = {}
    for name, overrides in SETTINGS.items():
        config = load_train_config(ROOT / "configs/train/darl.yaml", {
            "model.init_from": str(args.model), "data.dataset": str(store.root), "deepspeed": "configs/deepspeed/zero0.json",
            **overrides})
        examples = load_examples(store.root, tokenizer, config.data.max_tokens)
        batch = collate([examples[i] for i in range(len(examples))], tokenizer.pad_token_id, 0.0, model.cpu_preprocessor())
        results[name] = {"switches": overrides or "configs/train/darl.yaml", **diagnose(model, config, batch, args.draws)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
                                    "pages": args.pages, "draws": args.draws, "results": results}, indent=2))
    print("| setting | tokens with ground-truth context | max |logp − AR logp| | median | shared tokens | "
          "net weight on shared tokens: mean (min–max) | net weight at slot 0 / 1 / 2 / 3 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        slots = " / ".join(f"{v:+.3f}" for v in r["net_weight_by_slot"].values())
        print(f"| {name} | {r['ground_truth_context_tokens']} | {r['logp_gap_max']:.2e} | {r['logp_gap_median']:.2e} | "
              f"{r['shared_tokens']} | {r['shared_net_weight_mean']:+.4f} ({r['shared_net_weight_min']:+.3f}–"
              f"{r['shared_net_weight_max']:+.3f}) | {slots} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
