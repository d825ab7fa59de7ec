"""Plain autoregressive decoding: one token per forward, KV cache reused."""

from __future__ import annotations

from components.decoding.strategy import Acceptance, StepPlan, Strategy
from components.decoding.types import RowState


class AutoregressiveStrategy(Strategy):
    name = "ar"

    @property
    def spec_length(self) -> int:
        return 1

    def plan(self, row: RowState) -> StepPlan:
        return self.pending_committed(row)

    def accept(self, row: RowState, predicted: list[int], confidences: list[float]) -> Acceptance:
        return Acceptance(commit=predicted, confidences=confidences, keep_spec=1, decided=1)
