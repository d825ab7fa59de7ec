"""DeepSpeed plumbing shared by the trainer, the launcher and ``train_quick_model``.

The same code runs under plain ``python`` (one process: the process-group variables are set
here), ``torchrun`` and the ``deepspeed`` launcher (they set them). Without a GPU, DeepSpeed's
CPU accelerator is selected and the process group uses gloo. What the CPU path needs, found on
DeepSpeed 0.19.8 + torch 2.13 CPU:

- ``DS_ACCELERATOR=cpu`` before ``import deepspeed`` (auto-detection lands there too, this
  makes it explicit); no oneCCL or IPEX.
- RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment, else
  ``init_distributed`` goes looking for mpi4py.
- ``init_distributed`` JIT-compiles the ``deepspeed_shm_comm`` op (g++ + ninja, 40-65 s on 2
  cores, cached under ~/.cache/torch_extensions). That op only serves DeepSpeed-inference's
  shared-memory all-reduce, never training, so :func:`skip_shm_comm_build` marks it
  unavailable and start-up takes well under a second instead.
- ``"torch_adam": true`` keeps the optimizer torch's AdamW, so no fused/cpu_adam op is built.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from components.training.config import TrainConfig, TrainConfigError

YAML_OWNED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
OPTIMIZER_OWNED = ("lr", "betas", "eps", "weight_decay")


def on_gpu() -> bool:
    return torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_process_env() -> bool:
    """Fill the process-group variables for a single local process; True when we set them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        return False
    os.environ.update(
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    )
    return True


def select_accelerator() -> str:
    """``cpu`` without CUDA (set before deepspeed is imported), else DeepSpeed's own choice."""
    if not on_gpu():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return os.environ.get("DS_ACCELERATOR", "cuda")


def skip_shm_comm_build() -> None:
    """Mark the CPU shared-memory all-reduce op unavailable so init does not JIT-compile it."""
    import deepspeed.ops  # deferred: DeepSpeed takes seconds to import; only this path needs it

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed() -> tuple[int, int, int]:
    """Start (once) the process group; returns (rank, world_size, local_rank)."""
    ensure_process_env()
    accelerator = select_accelerator()
    import deepspeed  # deferred: DeepSpeed takes seconds to import; only this path needs it

    if not dist.is_initialized():
        if accelerator == "cpu":
            skip_shm_comm_build()
        deepspeed.init_distributed(dist_backend="gloo" if accelerator == "cpu" else "nccl")
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))


def default_threads(local_world_size: int) -> int:
    """Cores per local process, leaving none idle and oversubscribing none."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based): linear warmup from
    lr/warmup (the first step already moves), then constant, linear or cosine decay to
    ``min_ratio`` at the last step."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_scheduler_factory(config: TrainConfig):
    """A callable DeepSpeed turns into the run's scheduler (saved in its checkpoints)."""
    optim, steps = config.optim, config.train.steps

    def build(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, optim.warmup_steps, steps, optim.schedule, optim.min_lr_ratio)
        )

    return build


def resolve_deepspeed_config(config: TrainConfig) -> dict[str, Any]:
    """Read the DeepSpeed JSON and fill every ``"auto"`` from the training config.

    Batch sizes, clipping and optimizer hyper-parameters live in the YAML only: the JSON may
    leave them out or say ``"auto"``; an explicit value there is rejected rather than silently
    disagreeing with the YAML. The JSON owns the rest (ZeRO stage, bf16, communication).
    """
    path = config.path(config.deepspeed)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TrainConfigError(f"DeepSpeed config {path} is not valid JSON: {exc}") from exc
    problems = []
    if "train_batch_size" in raw and raw["train_batch_size"] != "auto":
        problems.append("train_batch_size (derived from train.micro_batch_size x grad_accum x processes)")
    problems += [key for key in YAML_OWNED if key in raw and raw[key] != "auto"]
    optimizer = raw.get("optimizer", {"type": "AdamW", "params": {}})
    if optimizer.get("type", "AdamW").lower() not in ("adamw", "adam"):
        problems.append(f"optimizer.type {optimizer.get('type')!r} (the recipe is AdamW)")
    params = dict(optimizer.get("params", {}))
    problems += [f"optimizer.params.{key}" for key in OPTIMIZER_OWNED if key in params and params[key] != "auto"]
    if "scheduler" in raw:
        problems.append("scheduler (warmup and decay come from the optim section of the training YAML)")
    if problems:
        raise TrainConfigError(
            f"DeepSpeed config {path} sets values the training YAML owns; use \"auto\" or drop them: " + "; ".join(problems)
        )
    if not on_gpu() and raw.get("fp16", {}).get("enabled") in (True, "auto"):
        raise TrainConfigError(f"DeepSpeed config {path} enables fp16, which needs a GPU; use an fp32 config on CPU")
    resolved = {key: value for key, value in raw.items() if key != "train_batch_size"}
    resolved.update(
        train_micro_batch_size_per_gpu=config.train.micro_batch_size,
        gradient_accumulation_steps=config.train.grad_accum,
        gradient_clipping=config.optim.grad_clip,
    )
    params.update(
        lr=config.optim.lr, betas=list(config.optim.betas), eps=config.optim.eps, weight_decay=config.optim.weight_decay
    )
    params.setdefault("torch_adam", True)
    params.setdefault("adam_w_mode", True)
    resolved["optimizer"] = {"type": "AdamW", "params": params}
    resolved.setdefault("steps_per_print", 10**9)
    resolved.setdefault("wall_clock_breakdown", False)
    return resolved


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only; biases, norms and embeddings-tied vectors are not decayed."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.dim() < 2 or "norm" in name.lower() else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
