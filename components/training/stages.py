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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.pipeline import PipelineConfig, _resolve
from components.services.process import PROJECT_ROOT


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
    if init_from is not None:
        overrides["model.init_from"] = str(init_from)
    if hard_dir is not None:
        overrides["data.hard_examples"] = str(hard_dir)
    if data_version:
        overrides["data.version"] = data_version
    overrides.update(cfg.training.stages[stage].overrides)
    return overrides


def launch_command(cfg: PipelineConfig, config_path: Path, overrides: dict[str, Any]) -> list[str]:
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={_yaml_value(value)}")]
    module = ["-m", "components.training.launch", "--config", str(config_path), *sets]
    n = cfg.training.num_processes
    python = sys.executable
    if cfg.training.launcher == "torchrun":
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *module]
    if cfg.training.launcher == "deepspeed":
        return [str(Path(python).parent / "deepspeed"), f"--num_gpus={n}", "--module", *module[1:]]
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
    with log_file.open("w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        completed = subprocess.run(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        log.write(completed.stdout)
    if completed.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-25:])
        raise StageFailed(f"training stage {stage} exited with {completed.returncode}; log {log_file}:\n{tail}")
    summary = _last_json_line(completed.stdout)
    if not summary.get("model_dir"):
        raise StageFailed(f"training stage {stage} finished without a model folder; log {log_file}")
    return StageResult(stage=stage, model_dir=Path(summary["model_dir"]), summary=summary, log_file=log_file)


def _last_json_line(text: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return {}
