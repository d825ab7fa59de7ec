"""The KV cache of a decoding batch and which of its slots each row may attend.

Positions are explicit (every forward passes each row's own position ids) and so is attention
(a validity map per row), so a slot's column in the cache means nothing by itself: rows that
accepted fewer speculative tokens than others leave masked holes, and a row that joins a running
batch (continuous batching) gets its image prefix in its own row's first columns and its tokens
at the shared write pointer, the columns in between masked. Two implementations give the same tokens:

- :class:`StaticSlots`: the model's lean decoder over preallocated ``StaticKV`` buffers; dropping
  rejected speculation moves an integer back, and rows can join (:meth:`StaticSlots.admit`);
- :class:`DynamicSlots`: a Hugging Face ``DynamicCache`` grown and cropped, for models without a
  lean decoder (the family adapters, whose caches carry per-row state such as RoPE deltas); rows
  join only an empty batch.
"""

from __future__ import annotations

import torch

from components.decoding.fixed_step import FixedShapeStep
from models.interface import MarkupLM
from models.static_decoder import StaticKV

# Columns nobody attends any more (rows that left, rejected speculation) are squeezed out when a row
# joins and they are more than this share of the used slots (positions are explicit: moving K/V is exact).
COMPACT_DEAD_SHARE = 0.5


def prefix_validity(cache, batch: int, n_prefix: int, device: torch.device) -> torch.Tensor:
    """Which prefix slots each row may attend: all, unless the prefill padded prefixes of different
    lengths and said so in ``cache.prefix_valid`` (the reader's elements, a chat model's prompts)."""
    valid = getattr(cache, "prefix_valid", None)
    if valid is None:
        return torch.ones(batch, n_prefix, dtype=torch.bool, device=device)
    return valid.to(device=device, dtype=torch.bool)


class DynamicSlots:
    """A growing ``DynamicCache`` plus which slots each row may attend (models without a lean decoder)."""

    joins_mid_batch = False

    def __init__(self, model: MarkupLM, cache, batch: int, n_prefix: int):
        self.model, self.cache = model, cache
        self.valid = prefix_validity(cache, batch, n_prefix, model.device)

    def past_valid(self) -> torch.Tensor:
        return self.valid

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: torch.Tensor,
                logits_from: int) -> torch.Tensor:
        return self.model.forward_tokens(input_ids, position_ids, attention, self.cache)[:, logits_from:]

    def keep(self, new_valid: torch.Tensor, extent: int) -> None:
        """Record which new slots rows kept and crop the trailing ones nobody kept."""
        self.valid = torch.cat([self.valid, new_valid[:, :extent]], dim=1)
        surplus = new_valid.shape[1] - extent
        if surplus > 0:
            self.cache.crop(-surplus)

    def select_rows(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)
        self.valid = self.valid[index]


class StaticSlots:
    """A ``StaticKV`` and a preallocated validity map: dropping slots moves ``length`` back, nothing else."""

    joins_mid_batch = True

    def __init__(self, lean, kv: StaticKV, n_prefix: int, prefix_valid: torch.Tensor,
                 fixed_step: FixedShapeStep | None = None):
        self.lean, self.kv, self.fixed_step = lean, kv, fixed_step
        self.start = kv.length  # first slot of the latest forward
        self.valid = torch.zeros(kv.keys[0].shape[0], kv.capacity, dtype=torch.bool, device=kv.keys[0].device)
        self.valid[:, :n_prefix] = prefix_valid

    def past_valid(self) -> torch.Tensor:
        return self.valid[:, : self.kv.length]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: torch.Tensor,
                logits_from: int) -> torch.Tensor:
        self.start = self.kv.length
        if self.fixed_step is not None:
            logits = self.fixed_step(input_ids, position_ids, attention, self.kv, logits_from)
        else:
            logits = self.lean.forward(input_ids, position_ids, attention, self.kv, logits_from=logits_from)
        self._fit_validity()
        return logits

    def _fit_validity(self) -> None:
        if self.kv.capacity > self.valid.shape[1]:  # the KV buffers grew
            grown = self.valid.new_zeros(self.valid.shape[0], self.kv.capacity)
            grown[:, : self.valid.shape[1]] = self.valid
            self.valid = grown

    def keep(self, new_valid: torch.Tensor, extent: int) -> None:
        self.valid[:, self.start : self.start + extent] = new_valid[:, :extent]
        self.kv.length = self.start + extent

    def select_rows(self, index: torch.Tensor) -> None:
        self.kv.select_rows(index)
        self.valid = self.valid.index_select(0, index)

    def admit(self, cache, n_prefix: int, prefix_valid: torch.Tensor) -> None:
        """Append the rows of a freshly prefilled ``cache`` to the batch. Each row has K/V of its own,
        so their prefixes go to their own rows' first columns (the columns' other rows hold other
        content there, never seen by them); their tokens then follow at the shared write pointer,
        the columns in between masked. The cache grows by tokens, not by prefixes."""
        self._compact()
        kv, old_rows = self.kv, self.valid.shape[0]
        start = max(kv.length, n_prefix)
        kv.reserve(start - kv.length)
        self._fit_validity()
        for buffers, new in ((kv.keys, [layer.keys for layer in cache.layers]),
                             (kv.values, [layer.values for layer in cache.layers])):
            for i, (old, fresh) in enumerate(zip(buffers, new, strict=True)):
                joined = old.new_zeros(old_rows + fresh.shape[0], *old.shape[1:])
                joined[:old_rows, :, : kv.length] = old[:, :, : kv.length]
                joined[old_rows:, :, :n_prefix] = fresh[:, :, :n_prefix].to(old.dtype)
                buffers[i] = joined
        valid = self.valid.new_zeros(old_rows + prefix_valid.shape[0], kv.capacity)
        valid[:old_rows] = self.valid
        valid[old_rows:, :n_prefix] = prefix_valid.to(valid.device)
        self.valid = valid
        kv.length = self.start = start

    def _compact(self) -> None:
        """Squeeze out the columns no row attends once they are most of the used ones (rows that
        left the batch, their prefixes and speculation); the kept K/V keep their order."""
        used = self.kv.length
        alive = self.valid[:, :used].any(dim=0)
        dead = used - int(alive.sum())
        if dead <= COMPACT_DEAD_SHARE * used:
            return
        index = alive.nonzero().squeeze(1)
        kept = len(index)
        for buffers in (self.kv.keys, self.kv.values):
            for i, old in enumerate(buffers):
                squeezed = torch.zeros_like(old)
                squeezed[:, :, :kept] = old.index_select(2, index)
                buffers[i] = squeezed
        valid = torch.zeros_like(self.valid)
        valid[:, :kept] = self.valid.index_select(1, index)
        self.valid = valid
        self.kv.length = self.start = kept
