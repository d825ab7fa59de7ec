"""What DTPO does to a model, measured on one fixed batch: gradient sizes and direction, accepted length.

The DARL loss is DAR + c * DTPO; whether DTPO can matter depends on how large and how aligned its
gradient is with DAR's. ``dtpo_gradient_probe`` runs the objective mix twice on the same batch
with the same random draws (eval mode: no dropout), once with the DTPO weight at 0 and once at 1,
so the difference of the two gradients is exactly DTPO's. No optimizer, no DeepSpeed: a probe of a
saved model, run after training (``benchmarks.darl_ablation``) or on any checkpoint.
"""

from __future__ import annotations

import torch

from components.training.config import TrainConfig
from components.training.data import Batch
from components.training.mix import ObjectiveMix


def _gradient(model: torch.nn.Module, config: TrainConfig, batch: Batch, seed: int) -> tuple[torch.Tensor, dict]:
    mix = ObjectiveMix(model, config)
    model.zero_grad(set_to_none=True)
    loss, metrics = mix(batch, torch.Generator().manual_seed(seed))
    loss.backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return torch.cat(grads) if grads else torch.zeros(1), metrics


def dtpo_gradient_probe(model: torch.nn.Module, config: TrainConfig, batch: Batch, seed: int = 0) -> dict[str, float]:
    """|grad DTPO| / |grad DAR| (DTPO unweighted), their cosine, and the batch's DARL signals.

    ``config`` must train ``darl``; the AR term and other objectives are dropped so that the
    gradient at DTPO weight 0 is DAR's alone.
    """
    if "darl" not in config.active_objectives:
        raise ValueError("the DTPO probe needs a config whose objectives include darl")
    was_training = model.training
    model.eval()
    try:
        only_darl = {"objectives": {"darl": 1.0}}
        dar_config = config.model_copy(update={**only_darl, "darl": config.darl.model_copy(update={"dtpo_coef": 0.0})})
        full_config = config.model_copy(update={**only_darl, "darl": config.darl.model_copy(update={"dtpo_coef": 1.0})})
        dar_grad, metrics = _gradient(model, dar_config, batch, seed)
        full_grad, _ = _gradient(model, full_config, batch, seed)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    dtpo_grad = full_grad - dar_grad
    dar_norm, dtpo_norm = dar_grad.norm().item(), dtpo_grad.norm().item()
    cosine = torch.nn.functional.cosine_similarity(dar_grad, dtpo_grad, dim=0).item() if dtpo_norm > 0 else 0.0
    return {
        "grad_ratio": dtpo_norm / max(dar_norm, 1e-12),  # times darl.dtpo_coef for the trained mix
        "grad_cosine": cosine,
        "zero_advantage": float(metrics["dtpo_zero_advantage"]),
        "reward_mean": float(metrics["reward_mean"]),
        "reward_std": float(metrics["reward_std"]),
        "greedy_accepted": float(metrics["greedy_accepted"]),
    }
