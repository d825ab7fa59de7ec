"""How much GPU memory a training run will need, from the model's config alone (no weights loaded).

The model is built on PyTorch's ``meta`` device, so a 3B checkpoint's parameter count is known in
a second on a laptop. The per-GPU figures are DeepSpeed's own model-state estimators (fp16/bf16
parameters and gradients, fp32 master weights and Adam moments, split the way the ZeRO stage
splits them); activations come on top and depend on sequence length, micro-batch size and
activation checkpointing, so they are stated as not included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.docvlm import DocVLMConfig, DocVLMForConditionalGeneration

GIB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    model_type: str
    parameters: int
    largest_layer_parameters: int
    zero_stage: int
    gpus_per_node: int
    nodes: int
    gpu_bytes: int  # model states per GPU, no offload
    cpu_bytes: int

    def lines(self) -> list[str]:
        gpus = self.gpus_per_node * self.nodes
        return [
            f"model: {self.model_type}, {self.parameters / 1e9:.3f}B parameters "
            f"(largest layer {self.largest_layer_parameters / 1e6:.1f}M)",
            f"ZeRO-{self.zero_stage} on {gpus} GPU(s) ({self.nodes} node(s) x {self.gpus_per_node}): "
            f"{self.gpu_bytes / GIB:.2f} GiB of model states per GPU, {self.cpu_bytes / GIB:.2f} GiB host memory per node "
            "(DeepSpeed's estimate, no offload; activations not included)",
        ]


def meta_model(model_dir: str | Path) -> tuple[str, nn.Module]:
    """The folder's model built from its ``config.json`` on the meta device (no weights, no memory)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    model_type = json.loads(config_file.read_text())["model_type"]
    with torch.device("meta"):
        if model_type == "docvlm":
            model = DocVLMForConditionalGeneration(DocVLMConfig.from_pretrained(str(model_dir)))
        else:
            # deferred: only the size estimate of a Hugging Face family needs it
            from transformers import AutoConfig, AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(model_dir)))
    return model_type, model


def estimate(model_dir: str | Path, zero_stage: int, gpus_per_node: int, nodes: int = 1) -> MemoryEstimate:
    """Parameter count and DeepSpeed's per-GPU model-state memory for one ZeRO stage."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero_stage}")
    if gpus_per_node < 1 or nodes < 1:
        raise ValueError("gpus_per_node and nodes must be >= 1")
    model_type, model = meta_model(model_dir)
    unique = {id(p): p for p in model.parameters()}  # tied embeddings count once
    total = sum(p.numel() for p in unique.values())
    largest = max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())
    if zero_stage == 3:
        # deferred: DeepSpeed takes seconds to import; only this path needs it
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, gpus_per_node, nodes, cpu_offload=False,
                                                            cpu_offload_params=False)
    else:
        # deferred: DeepSpeed takes seconds to import; only this path needs it
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        # ZeRO-0/1 keep every gradient on every GPU: the stage-2 formula with one GPU is their upper bound.
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, gpus_per_node if zero_stage == 2 else 1,
                                                          nodes if zero_stage == 2 else 1, cpu_offload=False)
    return MemoryEstimate(model_type, total, largest, zero_stage, gpus_per_node, nodes, int(gpu), int(cpu))
