"""Command-line entry of a training stage, the same under every launcher::

    python -m recipes.launch --config configs/train/stage1.yaml           # 1 process
    torchrun --nproc_per_node 2 -m recipes.launch --config ...           # N local
    deepspeed --num_accelerators 2 --module recipes.launch --config ...  # DeepSpeed

``--set key.sub=value`` overrides config entries (YAML values). The config is validated before
DeepSpeed is imported. Exit status: 0 finished, 3 interrupted after saving a checkpoint (run the
same command again to resume), 2 invalid config.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

from components.data.page_store import PageDataset
from components.training.config import TrainConfigError, load_train_config
from components.training.memory import estimate
from components.training.runtime import ensure_process_env
from components.training.trainer import run_training

EXIT_INTERRUPTED = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipes.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="training YAML, e.g. configs/train/stage1.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config entry (repeatable), e.g. --set train.steps=100")
    parser.add_argument("--stop-at-step", type=int, default=None,
                        help="stop (with a checkpoint) after this step, as if interrupted")
    parser.add_argument("--rank-report", default=None, metavar="DIR",
                        help="every rank writes DIR/rank<N>.json (its losses and weight checksum)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the model's parameter count and DeepSpeed's per-GPU memory estimate; train nothing")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node for --dry-run (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes for --dry-run (default 1)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_train_config(args.config, args.overrides)
    except TrainConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(config, args.gpus_per_node, args.nodes)
    missing = [path for path in (config.data.dataset, config.data.hard_examples)
               if path is not None and not PageDataset(config.path(path)).exists()]
    if missing:
        print(f"training data not found: {', '.join(str(config.path(p)) for p in missing)} (no page store); "
              "create or pull the dataset first, or point data.dataset elsewhere with --set", file=sys.stderr)
        return 2

    ensure_process_env()

    result = run_training(config, stop_at_step=args.stop_at_step)

    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.rank_report:
        report_dir = Path(args.rank_report)
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / f"rank{rank}.json").write_text(json.dumps({
            "rank": rank, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "losses": result.losses, "local_losses": result.local_losses, "param_checksum": result.param_checksum,
            "final_step": result.final_step, "interrupted": result.interrupted,
        }))
    if rank == 0:
        summary = {
            "output_dir": str(result.output_dir), "model_dir": str(result.model_dir) if result.model_dir else None,
            "start_step": result.start_step, "final_step": result.final_step, "interrupted": result.interrupted,
            "first_loss": result.losses[0] if result.losses else None,
            "last_loss": result.losses[-1] if result.losses else None,
            "init_seconds": round(result.init_seconds, 2), "train_seconds": round(result.train_seconds, 2),
            "mlflow_run_id": result.mlflow_run_id,
        }
        print(json.dumps(summary))
    if dist.is_initialized():
        dist.destroy_process_group()
    return EXIT_INTERRUPTED if result.interrupted else 0


def dry_run(config, gpus_per_node: int, nodes: int) -> int:
    """Parameter count and memory estimate of the configured model and ZeRO stage (config only)."""

    if config.model.init_from is None:
        print("--dry-run needs model.init_from (a model folder with config.json)", file=sys.stderr)
        return 2
    ds_config = json.loads(config.path(config.deepspeed).read_text())
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    try:
        result = estimate(config.path(config.model.init_from), stage, gpus_per_node, nodes)
    except (FileNotFoundError, ValueError) as exc:
        print(f"dry run: {exc}", file=sys.stderr)
        return 2
    print("\n".join([f"[dry run] {config.name}: {config.deepspeed}", *(f"[dry run] {line}" for line in result.lines())]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
