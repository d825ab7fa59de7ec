"""Training on DeepSpeed: one model for every decoder, trained by a configurable objective mix.

- :mod:`.config`: stage YAML schema and validation (``load_train_config``).
- :mod:`.objectives`, :mod:`.darl`: the losses (AR, DAR, OMTG/DTPO, MinerU, PA-BDM CSL, Stage 2).
- :mod:`.streams`, :mod:`.mix`: all objectives in one multi-stream forward (``ObjectiveMix``).
- :mod:`.data`: pages -> batches in an order fixed by (seed, step); Stage-2 mixing and weights.
- :mod:`.trainer`: the DeepSpeed loop, checkpoints, resume, MLflow (``run_training``).
- :mod:`.launch`: the CLI for python / torchrun / deepspeed; :mod:`.quick`: ``train_quick_model``.

Importing this package is cheap: DeepSpeed is only imported when training starts.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrainConfig": "components.training.config",
    "TrainConfigError": "components.training.config",
    "load_train_config": "components.training.config",
    "run_training": "components.training.trainer",
    "TrainResult": "components.training.trainer",
    "train_quick_model": "components.training.quick",
    "bootstrap_model": "components.training.bootstrap",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    return getattr(importlib.import_module(_EXPORTS[name]), name)
