"""A small trained model in a few CPU minutes, for tests and the demo.

Same path as production: ``configs/train/quick.yaml`` through the DeepSpeed engine in one
process, with the dataset, output folder, steps and seed filled in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from components.training.config import load_train_config
from components.training.trainer import run_training

QUICK_CONFIG = "configs/train/quick.yaml"


def train_quick_model(
    out_dir: str | Path, dataset_dir: str | Path, steps: int = 120, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Bootstrap and train the tiny model on ``dataset_dir``; returns the model folder.

    ``out_dir`` receives the run's files; the loadable model is ``out_dir/model`` (with
    ``training_meta.json``). ``overrides`` take dotted keys, e.g. ``{"train.micro_batch_size": 4}``.
    """

    config = load_train_config(QUICK_CONFIG, {
        "output_dir": str(Path(out_dir).resolve()),
        "data.dataset": str(Path(dataset_dir).resolve()),
        "train.steps": steps,
        "optim.warmup_steps": min(10, steps // 5),
        "seed": seed,
        **(overrides or {}),
    })
    result = run_training(config)
    if result.model_dir is None:
        raise RuntimeError(f"quick training stopped at step {result.final_step} of {steps} without a model")
    return result.model_dir
