"""The DARL paper's ablation (Tables 3/4) on our scale: what each reward adds to SDB's accepted length.

    python -m benchmarks.darl_ablation                                 # every row; seeds 0-3 for dar, lookahead, control
    python -m benchmarks.darl_ablation --rows ar,dar,immediate,lookahead --seeds 0,1 --steps 150

Every row starts from the same model (the shipped base, ``models/pretrained/docmarkup-base``),
trains the same number of steps on the same synthetic pages with the same seed, then decodes the
same held-out pages greedily with AR and with SDB (the row's window):

| row | objective |
| --- | --- |
| ``ar`` | AR fine-tune |
| ``dar`` | SDB training without rewards: DAR on the greedy OMTG window (DTPO weight 0) |
| ``immediate`` | + DTPO with the immediate (LCP) reward only |
| ``lookahead`` | + the look-ahead reward (the full method, ``configs/train/darl.yaml``) |
| ``edit`` | the full method with an edit-distance reward instead of LCP |
| ``control`` | the full method with each group's advantages permuted (same magnitudes, no signal) |
| ``w8``, ``w24``, ``w32`` | the full method with windows 8 / 24 / 32 (the others use 16) |
| ``candidate_context``, ``ar_scored``, ``r2_init``, ``lcp_per_candidate``, ``left_alignment`` | the full method with one of our older DTPO choices (or the authors' DAR alignment) switched back |
| ``old_defaults`` | all four older DTPO choices together (the previous defaults) |

Every row uses ``configs/train/darl.yaml``'s optimiser (the authors', scaled to the step count). Columns: SDB
forwards/page, tokens per forward, SDB's forward reduction against AR, whether SDB's output equals
AR's, Overall / text edit / TEDS of the greedy output, and from the last quarter of training the
fraction of candidate groups with no preference (all rewards equal) and the greedy candidate's
accepted length; and on a fixed probe batch of 8 training pages after training
(:mod:`components.training.probe`), |grad DTPO| / |grad DAR| (DTPO unweighted), their cosine and
the greedy accepted length. Each (row, seed) is one MLflow run (experiment ``darl-ablation``) holding its
training curve and these columns; the table (medians over seeds, min-max) goes to
``<out>/darl_ablation.json`` and ``.md``. Finished rows (training and their measurements) are reused
when the script is run again, so a long ablation can be run in parts and summarised at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlflow

from components.data.page_store import PageDataset
from components.data.synthetic import SyntheticConfig, generate_dataset
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.evaluate import evaluate_decoders
from components.registry.mlflow_registry import default_tracking_uri
from components.training.config import load_train_config
from components.training.data import collate, load_examples
from components.training.probe import dtpo_gradient_probe
from components.training.trainer import MODEL_DIR, TRAINING_META, run_training

ROOT = Path(__file__).resolve().parents[1]
BASE_MODEL = ROOT / "models" / "pretrained" / "docmarkup-base"
TRAIN_SEED = 40_000_000  # synthetic pages outside the base model's recorded seeds
EVAL_SEED = 41_000_000
DARL = {"objectives": {"darl": 1.0}}
OLD_CHOICES = {"darl.policy_context": "candidate", "darl.ar_slot": "score", "darl.lookahead_slots": "init",
               "darl.credit": "lcp_per_candidate"}
ROWS: dict[str, dict] = {
    "ar": {"objectives": {"ar": 1.0}},
    "dar": {**DARL, "darl.dtpo_coef": 0.0},
    "immediate": {**DARL, "darl.lookahead": False},
    "lookahead": DARL,
    "edit": {**DARL, "darl.reward": "edit"},
    "control": {**DARL, "darl.permute_advantages": True},
    "w8": {**DARL, "dar.window": 8},
    "w24": {**DARL, "dar.window": 24},
    "w32": {**DARL, "dar.window": 32},
    "candidate_context": {**DARL, "darl.policy_context": "candidate"},
    "ar_scored": {**DARL, "darl.ar_slot": "score"},
    "r2_init": {**DARL, "darl.lookahead_slots": "init"},
    "lcp_per_candidate": {**DARL, "darl.credit": "lcp_per_candidate"},
    "left_alignment": {**DARL, "darl.draft_alignment": "left"},
    "old_defaults": {**DARL, **OLD_CHOICES},
}
SEEDED_ROWS = ("dar", "lookahead", "control")  # every --seeds; the other rows run the first seed only
COLUMNS = ("sdb_forwards_per_page", "tpf", "forward_reduction", "same_as_ar", "overall", "text_edit", "teds",
           "zero_advantage", "greedy_accepted", "probe_grad_ratio", "probe_grad_cosine", "probe_accepted")


def make_pages(out: Path, n_train: int, n_eval: int):
    stores = []
    for name, n, seed in (("train", n_train, TRAIN_SEED), ("eval", n_eval, EVAL_SEED)):
        store = PageDataset(out / f"pages-{name}-{n}")
        if not store.exists() or len(store) != n:
            generate_dataset(store.root, n, seed=seed, cfg=SyntheticConfig.preset("tiny"))
        stores.append(store)
    return stores


def row_config(row: str, seed: int, args, train_pages: Path):
    return load_train_config(ROOT / "configs/train/darl.yaml", {
        "name": f"darl-ablation-{row}-seed{seed}", "seed": seed, "output_dir": str(args.out / "runs" / f"{row}-seed{seed}"),
        "model.init_from": str(args.base), "data.dataset": str(train_pages), "data.max_tokens": args.max_tokens,
        "train.steps": args.steps, "optim.warmup_steps": max(1, args.steps // 10), "train.micro_batch_size": args.micro_batch, "train.save_every": None,
        "train.progress": False, "mlflow.enabled": args.mlflow, "mlflow.experiment": "darl-ablation",
        "deepspeed": "configs/deepspeed/zero0.json", **ROWS[row],
    })


def train_row(config) -> tuple[Path, list[dict], str | None]:
    """Train one (row, seed), or reuse it when an earlier invocation finished it with this config."""

    output = config.path(config.output_dir)
    meta_file = output / MODEL_DIR / TRAINING_META
    if meta_file.is_file() and json.loads(meta_file.read_text())["config"] == config.model_dump(mode="json"):
        history = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return output / MODEL_DIR, history, json.loads(meta_file.read_text())["mlflow_run_id"]
    result = run_training(config)
    return result.model_dir, result.history, result.mlflow_run_id


def probe_row(engine, config, train_pages: Path, n_pages: int = 8) -> dict[str, float]:
    """DTPO's gradient against DAR's and the DARL signals on a fixed batch of training pages."""

    if "darl" not in config.active_objectives:
        return {}
    model, tokenizer = engine.model, engine.tokenizer
    examples = load_examples(train_pages, tokenizer, config.data.max_tokens)
    batch = collate([examples[i] for i in range(n_pages)], tokenizer.pad_token_id, 0.0, model.cpu_preprocessor())
    probe = dtpo_gradient_probe(model, config, batch)
    return {"probe_grad_ratio": probe["grad_ratio"], "probe_grad_cosine": probe["grad_cosine"],
            "probe_accepted": probe["greedy_accepted"]}


def evaluate_row(engine, window: int, eval_store, max_new_tokens: int) -> dict[str, float]:
    report = evaluate_decoders(engine, eval_store, [DecodeParams(decoder="ar", max_new_tokens=max_new_tokens),
                                                    DecodeParams(decoder="sdb", window=window, max_new_tokens=max_new_tokens)])
    ar, sdb = report.decoders["ar"], report.decoders["sdb"]
    ratios = report.ratios()["sdb"]
    return {
        "sdb_forwards_per_page": sdb.speed["forward_passes"] / report.n_pages, "tpf": sdb.speed["tokens_per_forward"],
        "forward_reduction": ratios["forward_reduction"], "same_as_ar": ratios["same_output_as_ar"],
        "overall": ar.overall, "text_edit": ar.scores.get("text_edit", float("nan")),
        "teds": ar.scores.get("table_teds", float("nan")),
    }


def training_signals(history: list[dict]) -> dict[str, float]:
    """DTPO's signals over the last quarter of training (NaN for rows without DARL)."""
    tail = history[-max(1, len(history) // 4):]
    out = {}
    for column, key in (("zero_advantage", "dtpo_zero_advantage"), ("greedy_accepted", "greedy_accepted")):
        values = [record[key] for record in tail if key in record]
        out[column] = statistics.fmean(values) if values else float("nan")
    return out


def log_to_mlflow(run_id: str | None, values: dict[str, float]) -> None:
    if run_id is None:
        return

    client = mlflow.MlflowClient(tracking_uri=default_tracking_uri())
    for key, value in values.items():
        if value == value:  # not NaN
            client.log_metric(run_id, f"ablation.{key}", float(value))


def summarise(results: dict[str, list[dict]]) -> tuple[dict, str]:
    """Median over seeds with (min-max) per row and column, as JSON and as a Markdown table."""
    summary = {}
    lines = ["| row | seeds | " + " | ".join(COLUMNS) + " |", "| --- " * (len(COLUMNS) + 2) + "|"]
    for row, runs in results.items():
        cells, stats = [], {}
        for column in COLUMNS:
            values = [run[column] for run in runs if column in run and run[column] == run[column]]
            if not values:
                cells.append("–")
                continue
            median = statistics.median(values)
            stats[column] = {"median": median, "min": min(values), "max": max(values), "values": values}
            cells.append(f"{median:.3f}" + (f" ({min(values):.3f}–{max(values):.3f})" if len(values) > 1 else ""))
        summary[row] = stats
        lines.append(f"| {row} | {len(runs)} | " + " | ".join(cells) + " |")
    return summary, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {', '.join(ROWS)}")
    parser.add_argument("--seeds", default="0,1,2,3", help=f"for {', '.join(SEEDED_ROWS)}; other rows run the first")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--train-pages", type=int, default=512)
    parser.add_argument("--eval-pages", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--base", type=Path, default=BASE_MODEL)
    parser.add_argument("--no-mlflow", dest="mlflow", action="store_false")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "darl_ablation")
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)

    train_store, eval_store = make_pages(args.out, args.train_pages, args.eval_pages)
    results: dict[str, list[dict]] = {}
    for row in rows:
        window = int(ROWS[row].get("dar.window", 16))
        for seed in seeds if row in SEEDED_ROWS else seeds[:1]:
            config = row_config(row, seed, args, train_store.root)
            model_dir, history, run_id = train_row(config)
            measured = model_dir.parent / f"ablation-eval-{args.eval_pages}x{args.max_new_tokens}.json"
            if measured.is_file() and measured.stat().st_mtime >= (model_dir / "training_meta.json").stat().st_mtime:
                values = json.loads(measured.read_text())  # measured by an earlier invocation on this model
            else:
                engine = DecodingEngine.from_pretrained(model_dir)  # one load serves decoding and the probe
                values = {**evaluate_row(engine, window, eval_store, args.max_new_tokens), **training_signals(history),
                          **probe_row(engine, config, train_store.root)}
                measured.write_text(json.dumps(values))
                log_to_mlflow(run_id, values)
            results.setdefault(row, []).append(values)
            print(f"[darl_ablation] {row} seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in values.items()), flush=True)
    summary, table = summarise(results)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "darl_ablation.json").write_text(json.dumps({"settings": settings, "rows": summary}, indent=2))
    (args.out / "darl_ablation.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
