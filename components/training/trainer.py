"""The training loop: a DeepSpeed engine around :class:`ObjectiveMix`, checkpoints, MLflow.

``run_training(config)`` works in whatever process group it finds (plain python, torchrun, the
deepspeed launcher; see :mod:`components.training.runtime`). Resume is exact: batches and every
random draw of a step are functions of (seed, step, micro-step, rank), and the DeepSpeed
checkpoint holds weights, optimizer and scheduler, so an interrupted run resumed from step k
repeats the uninterrupted run's losses from step k+1 on (same world size and thread count).

Interrupting: SIGTERM or SIGINT makes every rank finish the current step, save a checkpoint
and return ``interrupted=True``; ``stop_at_step`` does the same at a chosen step.

Output folder::

    checkpoints/step_0000100/...   DeepSpeed checkpoints (+ ``latest``)
    metrics.jsonl                  one line per optimizer step (rank-averaged)
    deepspeed_resolved.json        the DeepSpeed config actually used
    bootstrap_model/               the fresh model when the config bootstraps one
    model/                         final model folder (load_markup_model) + training_meta.json
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from components.data.pages import atomic_write_text
from components.data.provenance import LINEAGE_KEY, model_lineage
from components.data.seeds import seed_ranges, seen_seeds, synthetic_seeds
from components.parsing.prompts import style_for_model
from components.training import runtime
from components.training.bootstrap import bootstrap_model
from components.training.config import TrainConfig
from components.training.data import BatchPlan, TrainingData, dataset_fingerprint, load_examples
from components.training.lora import apply_lora, has_lora, merged_state_dict
from components.training.mix import ObjectiveMix
from components.training.tracking import RunLogger
from models.interface import capabilities_of
from models.loading import load_markup_model, save_markup_model

CHECKPOINTS = "checkpoints"
METRICS_FILE = "metrics.jsonl"
MODEL_DIR = "model"
TRAINING_META = "training_meta.json"


@dataclass
class TrainResult:
    output_dir: Path
    model_dir: Path | None  # None when the run stopped before its last step
    start_step: int
    final_step: int
    interrupted: bool
    history: list[dict[str, float]] = field(default_factory=list)  # this process's view of each step
    mlflow_run_id: str | None = None
    init_seconds: float = 0.0
    train_seconds: float = 0.0
    param_checksum: float = 0.0  # sum of this rank's weights: equal on every rank when replicas agree
    local_losses: list[float] = field(default_factory=list)  # this rank's own (not averaged) losses

    @property
    def losses(self) -> list[float]:
        return [record["loss"] for record in self.history]


class _StopRequest:
    """SIGTERM/SIGINT ask for a clean stop after the current step (a second SIGINT aborts)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def step_seed(seed: int, step: int, micro: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, micro, rank]).generate_state(1)[0])


def _reduce_mean(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average a fixed set of scalars over ranks (every rank holds the same keys)."""

    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
    return dict(zip(keys, tensor.tolist(), strict=True))


def _any_rank(flag: bool, device: torch.device) -> bool:
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item() > 0)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _checkpoint_step(tag: str) -> int:
    return int(tag.removeprefix("step_"))


def latest_checkpoint(output_dir: Path) -> tuple[str, int] | None:
    """(tag, step) of the newest complete checkpoint, from DeepSpeed's ``latest`` file."""
    latest = output_dir / CHECKPOINTS / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    if not (output_dir / CHECKPOINTS / tag).is_dir():
        return None
    return tag, _checkpoint_step(tag)


def _prune_checkpoints(checkpoint_dir: Path, keep: int) -> None:
    tags = sorted((p for p in checkpoint_dir.glob("step_*") if p.is_dir()), key=lambda p: _checkpoint_step(p.name))
    for old in tags[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _truncate_metrics(path: Path, last_step: int) -> None:
    """After a resume from ``last_step``, forget steps the interrupted run logged past it."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def _load_model(config: TrainConfig, output_dir: Path, rank: int):
    """The starting model: ``init_from`` or a bootstrap made once by rank 0."""

    if config.model.init_from is not None:
        source = config.path(config.model.init_from)
    else:
        source = output_dir / "bootstrap_model"
        if rank == 0 and not (source / "config.json").is_file():
            datasets = [config.path(config.data.dataset)]
            bootstrap_model(datasets, source, config.model.bootstrap.vocab_size, config.model.bootstrap.min_frequency,
                            seed=config.seed, architecture=config.model.bootstrap.architecture)
        _barrier()
    model, tokenizer = load_markup_model(source)
    if config.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.model.lora is not None:
        lora = config.model.lora
        counts = apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules, lora.trainable)
        if rank == 0:
            print(f"[train] LoRA r={lora.r}: {counts['trainable']:,} of {counts['parameters']:,} parameters train")
    return model.train(), tokenizer, source


def save_model_folder(engine, tokenizer, target: Path, meta: dict[str, Any], rank: int, zero_stage: int) -> Path:
    """Write the model folder next to ``target`` and swap it in, so no half-written folder is
    ever visible; with ZeRO-3 the partitioned weights are gathered first (all ranks)."""

    model = engine.module.model
    gather = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None) if zero_stage == 3 else None
    if gather is not None:
        gather.__enter__()
    try:
        if rank == 0:
            staging = target.with_name(target.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            save_markup_model(model, tokenizer, staging, state_dict=merged_state_dict(model) if has_lora(model) else None)
            (staging / TRAINING_META).write_text(json.dumps(meta, indent=2, default=str))
            old = target.with_name(target.name + ".old")
            if target.exists():
                shutil.rmtree(old, ignore_errors=True)
                target.rename(old)
            staging.rename(target)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if gather is not None:
            gather.__exit__(None, None, None)
    _barrier()
    return target


@dataclass
class _Run:
    """One training run once set up: what the steps and the save need."""

    config: TrainConfig  # with the steps the data plan gives
    rank: int
    world_size: int
    output_dir: Path
    engine: Any  # the DeepSpeed engine around the ObjectiveMix
    tokenizer: Any
    source: Path | str  # the model it started from
    plan: BatchPlan
    data: TrainingData
    zero_stage: int
    start_step: int
    resumed: bool
    fingerprints: dict[str, Any]
    logger: RunLogger
    run_id: str | None


@dataclass
class _Steps:
    history: list[dict[str, float]]
    local_losses: list[float]
    finished: int
    interrupted: bool
    saved_at: int  # the step of the last checkpoint (-1: none)
    seconds: float


def run_training(config: TrainConfig, *, stop_at_step: int | None = None) -> TrainResult:
    """Train ``config`` to ``train.steps`` (or ``stop_at_step``), resuming if a checkpoint exists:
    set up (model, data, DeepSpeed, resume, tracking), the steps, then the model folder."""
    started = time.time()
    run = _set_up(config)
    init_seconds = time.time() - started
    total = run.config.train.steps
    steps = _train_steps(run, min(total, stop_at_step) if stop_at_step is not None else total)
    model_dir = None
    if steps.finished >= total and not steps.interrupted:
        model_dir = _save(run, steps)
    run.logger.finish("KILLED" if steps.interrupted else "FINISHED")
    checksum = 0.0
    if run.zero_stage < 3:
        checksum = float(sum(p.detach().double().sum() for p in run.engine.module.parameters()))
    _barrier()
    return TrainResult(
        output_dir=run.output_dir, model_dir=model_dir, start_step=run.start_step, final_step=steps.finished,
        interrupted=steps.interrupted, history=steps.history, mlflow_run_id=run.run_id, init_seconds=init_seconds,
        train_seconds=steps.seconds, param_checksum=checksum, local_losses=steps.local_losses,
    )


def _set_up(config: TrainConfig) -> _Run:
    """The model, its data and batch plan, the DeepSpeed engine, a resumed checkpoint, the tracking run."""
    rank, world_size, _ = runtime.init_distributed()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world_size)))
    torch.set_num_threads(config.train.threads or runtime.default_threads(local_world))
    torch.manual_seed(config.seed)
    output_dir = config.path(config.output_dir)
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
    _barrier()

    model, tokenizer, source = _load_model(config, output_dir, rank)
    unit = config.data.unit
    markup = capabilities_of(model).writes_markup  # the reader writes an element's text, not its form
    base = load_examples(config.path(config.data.dataset), tokenizer, config.data.max_tokens, unit, markup)
    hard = (load_examples(config.path(config.data.hard_examples), tokenizer, config.data.max_tokens, unit, markup)
            if config.data.hard_examples else None)
    plan = BatchPlan(base.shard_sizes, hard.shard_sizes if hard else 0, config.data.hard_ratio, config.seed,
                     config.train.micro_batch_size, config.train.grad_accum, world_size)
    config = config.with_steps_for(len(base), plan.global_batch - plan.n_hard_per_batch)

    ds_config = runtime.resolve_deepspeed_config(config)
    mix = ObjectiveMix(model, config)
    engine, _, _, _ = deepspeed.initialize(
        model=mix, model_parameters=runtime.parameter_groups(mix, config.optim.weight_decay), config=ds_config,
        lr_scheduler=runtime.lr_scheduler_factory(config),
    )
    zero_stage = engine.zero_optimization_stage()
    # Pages are preprocessed on CPU (in DataLoader workers when data.workers > 0) and moved here.
    preprocess = engine.module.model.cpu_preprocessor()
    data = TrainingData(base, hard, plan, tokenizer.pad_token_id, config.data.consistency_beta, preprocess,
                        style_for_model(engine.module.model, config.data.prompt_style))

    start_step = 0
    found = latest_checkpoint(output_dir) if config.train.resume else None
    if found is not None:
        _, client_state = engine.load_checkpoint(str(output_dir / CHECKPOINTS), tag=found[0])
        start_step = int(client_state["step"])
        if client_state.get("world_size") != world_size and rank == 0:
            print(f"[train] resuming a checkpoint written by {client_state.get('world_size')} processes with "
                  f"{world_size}: data order after step {start_step} differs from the original run")
    if rank == 0:
        _truncate_metrics(output_dir / METRICS_FILE, start_step)
        atomic_write_text(output_dir / "deepspeed_resolved.json", json.dumps(ds_config, indent=2))

    fingerprints: dict[str, Any] = {"dataset": dataset_fingerprint(config.path(config.data.dataset)),
                                    "version": config.data.version}
    if config.data.hard_examples:
        fingerprints["hard_examples"] = dataset_fingerprint(config.path(config.data.hard_examples))
    logger = RunLogger(config.mlflow, output_dir, active=rank == 0)
    run_id = logger.start(config.name, {"stage": config.name, "data_version": config.data.version or "unversioned",
                                        "data.pages_sha256": fingerprints["dataset"]["pages_sha256"]},
                          resume=found is not None)
    statistics = data.token_statistics()
    logger.log_params({**config.flat(), "world_size": world_size, "zero_stage": zero_stage, "init_model": str(source),
                       **{f"data_stats.{k}": v for k, v in statistics.items()}})
    if rank == 0 and statistics["truncated"]:
        print(f"[train {config.name}] {statistics['truncated']} of {statistics['n_examples']} targets are longer than "
              f"data.max_tokens={config.data.max_tokens} and are cut (their ends are never learned); real pages need "
              "~2,000 tokens: raise data.max_tokens within the model's positions, or read pages as elements", flush=True)
    if rank == 0:
        logger.log_file(output_dir / "deepspeed_resolved.json")
    return _Run(config, rank, world_size, output_dir, engine, tokenizer, source, plan, data, zero_stage, start_step,
                found is not None, fingerprints, logger, run_id)


def _train_steps(run: _Run, last_step: int) -> _Steps:
    """Steps from where the run starts to ``last_step``, with metrics, checkpoints and Ctrl-C."""
    config, engine, rank = run.config, run.engine, run.rank
    device, checkpoint_dir, total = engine.device, run.output_dir / CHECKPOINTS, config.train.steps
    history: list[dict[str, float]] = []
    local_losses: list[float] = []
    finished = run.start_step
    interrupted = False
    saved_at = run.start_step if run.resumed else -1
    progress = None
    if rank == 0 and config.train.progress:
        progress = tqdm(total=total, initial=run.start_step, desc=config.name, unit="step", dynamic_ncols=True)
    started = time.time()
    batches = run.data.batches(run.start_step, last_step, rank, workers=config.data.workers)
    with _StopRequest() as stop_request:
        for step in range(run.start_step, last_step):
            step_started = time.time()
            lr = float(engine.get_lr()[0])
            sums: dict[str, float] = {}
            for micro in range(config.train.grad_accum):
                batch = next(batches).to(device, engine.module.model.dtype)
                generator = torch.Generator().manual_seed(step_seed(config.seed, step, micro, rank))
                loss, metrics = engine(batch, generator)
                engine.backward(loss)
                engine.step()
                for key, value in {"loss": loss.detach(), **metrics}.items():
                    sums[key] = sums.get(key, 0.0) + float(value) / config.train.grad_accum
            local_losses.append(sums["loss"])
            record = _reduce_mean(sums, device)
            grad_norm = engine.get_global_grad_norm()
            seconds = time.time() - step_started
            finished = step + 1
            record.update(step=finished, total_steps=total, lr=lr, step_seconds=seconds,
                          epoch=run.plan.epoch_of(finished), samples_per_second=run.plan.global_batch / max(seconds, 1e-9))
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            history.append(record)
            if rank == 0:
                with open(run.output_dir / METRICS_FILE, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record) + "\n")
                run.logger.log_metrics({k: v for k, v in record.items() if k != "step"}, step=finished)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}")

            stopping = _any_rank(stop_request.requested, device) or (finished >= last_step and last_step < total)
            periodic = config.train.save_every is not None and (finished % config.train.save_every == 0 or finished == total)
            if periodic or stopping:
                engine.save_checkpoint(str(checkpoint_dir), tag=f"step_{finished:07d}", client_state={
                    "step": finished, "world_size": run.world_size, "seed": config.seed,
                    "micro_batch_size": config.train.micro_batch_size, "grad_accum": config.train.grad_accum})
                saved_at = finished
                _barrier()
                if rank == 0:
                    _prune_checkpoints(checkpoint_dir, config.train.keep_checkpoints)
            if stopping:
                interrupted = True
                break
    if progress is not None:
        progress.close()
    return _Steps(history, local_losses, finished, interrupted, saved_at, time.time() - started)


def _save(run: _Run, steps: _Steps) -> Path:
    """The trained model folder with its training record (data, seeds, lineage, objectives, metrics)."""
    config = run.config
    meta = {
        "name": config.name,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "steps": steps.finished,
        "data": run.fingerprints,
        # every synthetic seed this model (and the models it started from) trained on, so an
        # evaluation can refuse pages it has seen (components.evaluation.evaluate.assert_held_out)
        "seen_seeds": seed_ranges(
            synthetic_seeds(config.path(config.data.dataset))
            + (synthetic_seeds(config.path(config.data.hard_examples)) if config.data.hard_examples else []),
            also=seen_seeds(run.source)),
        "init_model": str(run.source),
        # fingerprints of the weights it started from and their ancestors: evaluation refuses
        # pages whose truth one of them wrote (components.data.provenance)
        LINEAGE_KEY: sorted(model_lineage(run.source)),
        "objectives": config.active_objectives,
        "unit": config.data.unit,  # what the model reads: whole pages, or element crops (two-stage parsing)
        "final_metrics": steps.history[-1] if steps.history else None,
        "deepspeed": {"version": deepspeed.__version__, "zero_stage": run.zero_stage, "world_size": run.world_size,
                      "accelerator": runtime.select_accelerator()},
        "checkpoint": None if steps.saved_at < 0 else f"step_{steps.saved_at:07d}",
        "mlflow_run_id": run.run_id,
        "config": config.model_dump(mode="json"),
    }
    model_dir = save_model_folder(run.engine, run.tokenizer, run.output_dir / MODEL_DIR, meta, run.rank, run.zero_stage)
    if run.rank == 0:
        run.logger.log_model_folder(model_dir)
        run.logger.set_tags({"model_dir": str(model_dir)})
    return model_dir
