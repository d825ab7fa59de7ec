"""Run one training stage of the pipeline as its own process (plain python, torchrun or deepspeed).

Each stage runs in a fresh process so DeepSpeed's and torch.distributed's global state never
leaks from one stage into the next, and so the same call scales from one CPU process here to
``deepspeed`` on GPU nodes by changing the launcher in the pipeline config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.pipeline import PipelineConfig, _resolve
from components.services.process import PROJECT_ROOT
from components.training.config import load_train_config

PROGRESS_EVERY_S = 20.0


class StageFailed(RuntimeError):
    """A training stage exited non-zero; the message carries the end of its log."""


@dataclass
class StageResult:
    stage: str
    model_dir: Path
    summary: dict
    log_file: Path


def stage_overrides(cfg: PipelineConfig, stage: str, dataset_dir: Path, init_from: Path | None,
                    hard_dir: Path | None, data_version: str | None) -> dict[str, Any]:
    """Where this pipeline's data and previous stage are, on top of the stage's own YAML."""
    overrides: dict[str, Any] = {
        "output_dir": str(cfg.run_dir / "train" / stage),
        "data.dataset": str(dataset_dir),
    }
    starts_from_base = stage == next(iter(cfg.training.stages)) or cfg.training.stages[stage].beside_chain
    if init_from is None and starts_from_base and cfg.training.base_model:
        init_from = _resolve(cfg.training.base_model)
        overrides["model.bootstrap"] = None
    if init_from is not None:
        overrides["model.init_from"] = str(init_from)
    if hard_dir is not None:
        overrides["data.hard_examples"] = str(hard_dir)
    else:  # mining found no hard page (or did not run): the stage trains on its dataset alone
        overrides |= {"data.hard_examples": None, "data.hard_ratio": 0.0}
    if data_version:
        overrides["data.version"] = data_version
    overrides.update(cfg.training.stages[stage].overrides)
    return overrides


def validate_stages(cfg: PipelineConfig) -> None:
    """Load every stage's YAML with the pipeline's overrides now, before any work starts, so a
    typo in the DARL overrides fails in a second instead of after Stage 1 has trained."""

    for stage in cfg.training.stages:
        overrides = stage_overrides(cfg, stage, cfg.split_dir("train"), None, None, None)
        load_train_config(_resolve(cfg.training.stages[stage].config), overrides, check_paths=False)


def starting_checkpoint(cfg: PipelineConfig) -> Path | None:
    """The model folder Stage 1 continues (``training.base_model`` or the stage's ``model.init_from``),
    or None when it trains from scratch: what a first challenger is compared with."""

    first = next(iter(cfg.training.stages))
    overrides = stage_overrides(cfg, first, cfg.split_dir("train"), None, None, None)
    config = load_train_config(_resolve(cfg.training.stages[first].config), overrides, check_paths=False)
    return config.path(config.model.init_from) if config.model.init_from else None


def launch_command(cfg: PipelineConfig, config_path: Path, overrides: dict[str, Any]) -> list[str]:
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={_yaml_value(value)}")]
    module = ["-m", "recipes.launch", "--config", str(config_path), *sets]
    section = cfg.training
    n = section.num_processes
    python = sys.executable
    if section.launcher == "torchrun":
        if section.nodes > 1:  # run the same command on every node; the rendezvous assigns ranks
            meeting = [f"--nnodes={section.nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={section.rdzv_endpoint}",
                       f"--rdzv-id={cfg.name}-{config_path.stem}"]
        else:
            meeting = ["--standalone"]
        return [python, "-m", "torch.distributed.run", *meeting, f"--nproc-per-node={n}", *module]
    if section.launcher == "deepspeed":
        nodes = [f"--hostfile={_resolve(section.hostfile)}", f"--num_nodes={section.nodes}"] if section.nodes > 1 else []
        return [str(Path(python).parent / "deepspeed"), *nodes, f"--num_gpus={n}", "--module", *module[1:]]
    if n != 1:
        raise ValueError("training.launcher 'inprocess' runs one process; use torchrun or deepspeed for num_processes > 1")
    return [python, *module]


def _yaml_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)


def run_stage(cfg: PipelineConfig, stage: str, *, dataset_dir: Path, init_from: Path | None = None,
              hard_dir: Path | None = None, data_version: str | None = None) -> StageResult:
    """Train ``stage`` to completion (resuming from its last checkpoint if one exists)."""
    section = cfg.training.stages[stage]
    config_path = _resolve(section.config)
    overrides = stage_overrides(cfg, stage, dataset_dir, init_from, hard_dir, data_version)
    command = launch_command(cfg, config_path, overrides)
    log_file = cfg.run_dir / "train" / f"{stage}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    metrics_file = cfg.run_dir / "train" / stage / "metrics.jsonl"
    print(f"[train {stage}] started; full log: {log_file}", flush=True)
    with log_file.open("w") as log, tempfile.TemporaryFile("w+") as stdout:
        log.write(" ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=stdout, stderr=log, text=True, env=env)
        started = time.monotonic()
        while True:
            try:
                returncode = process.wait(timeout=PROGRESS_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                print(progress_line(stage, metrics_file, time.monotonic() - started), flush=True)
        stdout.seek(0)
        output = stdout.read()
        log.write(output)
    if returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-25:])
        raise StageFailed(f"training stage {stage} exited with {returncode}; log {log_file}:\n{tail}")
    summary = _last_json_line(output)
    if not summary.get("model_dir"):
        raise StageFailed(f"training stage {stage} finished without a model folder; log {log_file}")
    return StageResult(stage=stage, model_dir=Path(summary["model_dir"]), summary=summary, log_file=log_file)


def progress_line(stage: str, metrics_file: Path, elapsed_s: float) -> str:
    """``[train stage1] step 120/240 loss 3.210 ETA 1m40s`` from the stage's metrics log."""
    try:
        last = json.loads(metrics_file.read_text().splitlines()[-1])
    except (FileNotFoundError, IndexError, json.JSONDecodeError):
        return f"[train {stage}] starting ({elapsed_s:.0f}s)"
    step, total = int(last.get("step", 0)), int(last.get("total_steps", 0) or 0)
    eta = ""
    if total and step:
        remaining = elapsed_s / step * (total - step)
        eta = f" ETA {int(remaining // 60)}m{int(remaining % 60):02d}s"
    return f"[train {stage}] step {step}/{total or '?'} loss {last.get('loss', float('nan')):.3f}{eta}"


def _last_json_line(text: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return {}
