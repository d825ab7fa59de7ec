"""DARL's Sliding Diffusion Block (SDB) decoding.

The row keeps a stable prefix plus a speculative window of w positions: the previous forward's
guesses for the next tokens, ``<INIT>`` where it had none. One causal forward over
``[last token, d_1 .. d_w]`` yields the exact next AR token p_1 and, at every window position,
a refined guess p_{k+1}. Verification is left to right: d_k is accepted while it equals p_k,
because then p_{k+1} was computed from a context made only of committed tokens, i.e. it is what
AR would have produced (greedy: the same argmax; sampling: a draw from the same conditional).
The first disagreement stops acceptance; at least p_1 is always committed. The window then
slides: the unverified refinements become the new draft and ``<INIT>`` refills it to w. KV of
the accepted prefix stays, the rest is cropped by the engine.
"""

from __future__ import annotations

from components.decoding.strategy import Acceptance, StepPlan, Strategy
from components.decoding.types import RowState


class SlidingDiffusionBlockStrategy(Strategy):
    name = "sdb"

    @property
    def spec_length(self) -> int:
        return 1 + self.params.window

    def start(self, row: RowState) -> None:
        row.draft = [self.ids.init] * self.params.window

    def plan(self, row: RowState) -> StepPlan:
        plan = self.pending_committed(row)
        plan.spec.extend(row.draft)
        return plan

    def accept(self, row: RowState, predicted: list[int], confidences: list[float]) -> Acceptance:
        window = self.params.window
        matched = 0
        while matched < window and row.draft[matched] == predicted[matched] and predicted[matched] != self.ids.eos:
            matched += 1
        committed = predicted[: matched + 1]
        row.draft = predicted[matched + 1 :] + [self.ids.init] * matched
        return Acceptance(
            commit=committed, confidences=confidences[: matched + 1], keep_spec=matched + 1, decided=len(committed)
        )
