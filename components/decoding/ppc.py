"""PA-BDM's Progressive Prefix Commitment (PPC).

Each forward feeds ``[last token, <MASK> x (D-1)]`` with causal attention inside the span (the
way PA-BDM trains its noisy blocks). Output 1 is the exact AR token; outputs 2..D are guesses
made through masks. The longest left prefix whose every token has confidence >= τ is committed
(at least one token), the rest is discarded, and the next forward starts a full fresh span
right after the committed prefix. Only the last token's KV is kept: mask inputs are not tokens.
"""

from __future__ import annotations

from components.decoding.strategy import Acceptance, StepPlan, Strategy
from components.decoding.types import RowState


def confident_prefix_length(confidences: list[float], threshold: float) -> int:
    """Length of the longest left prefix with every confidence >= threshold, but at least 1."""
    length = 0
    while length < len(confidences) and confidences[length] >= threshold:
        length += 1
    return max(1, length)


class PrefixCommitmentStrategy(Strategy):
    name = "ppc"

    @property
    def spec_length(self) -> int:
        return self.params.span

    def plan(self, row: RowState) -> StepPlan:
        plan = self.pending_committed(row)
        plan.spec.extend([self.ids.mask] * (self.params.span - 1))
        return plan

    def accept(self, row: RowState, predicted: list[int], confidences: list[float]) -> Acceptance:
        length = confident_prefix_length(confidences, self.params.threshold)
        if self.ids.eos in predicted[:length]:
            length = predicted.index(self.ids.eos) + 1
        return Acceptance(commit=predicted[:length], confidences=confidences[:length], keep_spec=1, decided=length)
