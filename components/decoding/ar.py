"""Plain autoregressive decoding: one token per forward, KV cache reused."""

from __future__ import annotations

import torch

from components.decoding.sampling import choose_tokens
from components.decoding.strategy import Acceptance, StepPlan, Strategy
from components.decoding.types import RowState


class AutoregressiveStrategy(Strategy):
    name = "ar"

    @property
    def spec_length(self) -> int:
        return 1

    def plan(self, row: RowState) -> StepPlan:
        return self.pending_committed(row)

    def accept(self, row: RowState, logits: torch.Tensor) -> Acceptance:
        tokens, confidences = choose_tokens(logits, self.params, row.generator, self.banned)
        return Acceptance(commit=tokens, confidences=confidences, keep_spec=1, decided=1)
