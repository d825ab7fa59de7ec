"""The decode step with fixed shapes: what CUDA graphs and ``torch.compile`` need.

On a GPU a small model's decode step is bound by kernel launches, not arithmetic; a CUDA graph
replays the whole step as one launch, and ``torch.compile`` fuses its elementwise work. Both need
a step whose tensors keep their shapes and addresses from one step to the next. The lean
decoder's :meth:`~models.static_decoder.StaticQwen2Decoder.forward_fixed` is that step: K/V are
written at a device index into preallocated buffers and every query attends over the whole
capacity under a mask. This module runs it three ways, each a switch of the engine:

- ``fixed_shapes`` alone: the fixed-shape step run eagerly (anywhere; the CPU exactness tests);
- ``compile_step``: the step compiled once per shape with ``torch.compile(fullgraph=True)``;
- ``cuda_graphs``: the step captured in a CUDA graph per (batch, Q, logits) shape on first use
  and replayed afterwards; inputs are copied into the graph's static buffers. Captures are
  dropped when the KV buffers are replaced (rows leaving the batch, a rare capacity growth).
"""

from __future__ import annotations

import torch

from models.static_decoder import StaticKV, StaticQwen2Decoder

WARMUP_RUNS = 2  # eager runs on a side stream before capture (allocator and cuBLAS warm-up)
# How a deployment names the engine's step (deploy config ``engine_step``) and the engine switches it sets.
STEP_SWITCHES: dict[str, dict[str, bool]] = {
    "default": {}, "fixed_shapes": {"fixed_shapes": True}, "compile": {"compile_step": True},
    "cuda_graphs": {"cuda_graphs": True}, "cuda_graphs_compiled": {"cuda_graphs": True, "compile_step": True},
}


class FixedShapeStep:
    """Run the lean decoder's fixed-shape step, compiled and/or CUDA-graph-captured when asked."""

    def __init__(self, lean: StaticQwen2Decoder, cuda_graphs: bool = False, compile_step: bool = False):
        self.lean = lean
        self.cuda_graphs = cuda_graphs
        self.function = lean.forward_fixed
        if compile_step:
            self.function = torch.compile(lean.forward_fixed, fullgraph=True, dynamic=False)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}
        self._buffers: tuple[int, ...] | None = None  # data pointers of the KV buffers the captures use
        self.captures = 0

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: torch.Tensor,
                 kv: StaticKV, logits_from: int) -> torch.Tensor:
        """Logits of the Q new tokens; their K/V land at ``kv.length ..`` and ``kv.length`` advances.
        ``attention``: (B, 1, Q, kv.length + Q), the engine's mask, widened here to the capacity."""
        batch, q_len = input_ids.shape
        kv.reserve(q_len)
        device = input_ids.device
        mask = torch.zeros(batch, 1, q_len, kv.capacity, dtype=torch.bool, device=device)
        mask[..., : kv.length + q_len] = attention
        write_index = torch.arange(kv.length, kv.length + q_len, device=device)
        with torch.inference_mode():
            if self.cuda_graphs:
                logits = self._replay(kv, logits_from, input_ids, position_ids, mask, write_index)
            else:
                logits = self.function(input_ids, position_ids, mask, kv, write_index, logits_from)
        kv.length += q_len
        return logits

    def _replay(self, kv: StaticKV, logits_from: int, *inputs: torch.Tensor) -> torch.Tensor:
        buffers = tuple(t.data_ptr() for t in (*kv.keys, *kv.values))
        if buffers != self._buffers:  # new KV tensors: every capture points at the old ones
            self._graphs.clear()
            self._buffers = buffers
        key = (*inputs[0].shape, logits_from)
        if key not in self._graphs:
            self._graphs[key] = self._capture(kv, logits_from, inputs)
        graph, static_inputs, output = self._graphs[key]
        for static, value in zip(static_inputs, inputs, strict=True):
            static.copy_(value)
        graph.replay()
        return output.clone()

    def _capture(self, kv: StaticKV, logits_from: int, inputs: tuple[torch.Tensor, ...]):
        static_inputs = [t.clone() for t in inputs]
        input_ids, position_ids, mask, write_index = static_inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up writes the same K/V the step itself writes: harmless
            for _ in range(WARMUP_RUNS):
                self.function(input_ids, position_ids, mask, kv, write_index, logits_from)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = self.function(input_ids, position_ids, mask, kv, write_index, logits_from)
        self.captures += 1
        return graph, static_inputs, output
