"""Optional LoRA fine-tuning through ``peft``, merged on save.

Adapters are injected in place (``peft.inject_adapter_in_model``), so the model keeps its class
and every method the objectives and the engine call; only the adapter weights train. The saved
folder holds the merged weights W + (alpha / r) B A under the plain architecture's names, so the
engine, Triton and ``from_pretrained`` load it like any other checkpoint: no peft at serving time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# The attention and MLP projections of the text decoder only (``language_model`` in DocVLM and in
# every Hugging Face family we load); the vision tower, whose ViT layers reuse names like ``q_proj``, stays frozen,
# as in the usual Qwen2.5-VL LoRA recipes.
DECODER_PROJECTIONS = r".*language_model\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
DEFAULT_TARGETS = {family: DECODER_PROJECTIONS for family in ("docvlm", "docmarkup_reader", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "paddleocr_vl")}


def apply_lora(model: nn.Module, r: int, alpha: float, dropout: float = 0.0, target_modules: list[str] | str | None = None,
               trainable: list[str] | None = None) -> dict[str, int]:
    """Inject LoRA adapters and freeze everything else (except parameters whose name contains one of
    ``trainable``, e.g. ``embed_tokens`` when new special tokens must learn). Returns the counts."""
    from peft import LoraConfig, inject_adapter_in_model  # deferred: only a LoRA run needs peft

    model_type = getattr(model.config, "model_type", "")
    targets = target_modules or DEFAULT_TARGETS.get(model_type)
    if not targets:
        raise ValueError(f"no default LoRA target modules for {model_type!r}; set model.lora.target_modules")
    # peft injects into a transformers model: DocVLM is one, an adapter wraps one as ``.hf``.
    pretrained = getattr(model, "hf", model)
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets), pretrained)
    keep = tuple(trainable or ())
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name or any(k in name for k in keep)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return {"parameters": total, "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def has_lora(model: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer  # deferred: only a LoRA run needs peft

    return any(isinstance(module, LoraLayer) for module in model.modules())


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's weights with every adapter folded into its base layer, under the names of the
    model without adapters (``...q_proj.weight``, no ``base_layer`` / ``lora_`` entries)."""
    from peft.tuners.lora import LoraLayer  # deferred: only a LoRA run needs peft

    state = {name: tensor for name, tensor in model.state_dict().items() if "lora_" not in name}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        weight = base.weight.detach().clone()
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                weight += module.get_delta_weight(adapter).to(weight.dtype)
        state.pop(f"{name}.base_layer.weight")
        state[f"{name}.weight"] = weight
        if base.bias is not None:
            state[f"{name}.bias"] = state.pop(f"{name}.base_layer.bias")
    return state
