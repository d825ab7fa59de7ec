"""The contract between the one decoding loop (:mod:`engine`) and each decoding algorithm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.decoding.types import DecodeParams, RowState


@dataclass(frozen=True)
class SpecialIds:
    bos: int
    eos: int
    pad: int
    init: int
    mask: int
    other_specials: tuple[int, ...] = ()  # the tokenizer's other special tokens (image placeholders, <unk>, ...)

    @property
    def banned_outputs(self) -> torch.Tensor:
        """Every special id but eos: none is markup, and a chat model's image placeholder fed back
        as a token would even ask its forward for image features."""
        return torch.tensor(sorted({self.bos, self.pad, self.init, self.mask, *self.other_specials} - {self.eos}))


@dataclass
class StepPlan:
    """What one row feeds a forward: committed tokens to store, then the speculative segment."""

    stored: list[int]
    spec: list[int]


@dataclass
class Acceptance:
    """What one row takes from a forward.

    ``commit``: tokens appended to the output now (left to right). ``keep_spec``: how many leading
    speculative slots hold real committed tokens, so their KV stays in the cache. ``decided``:
    tokens fixed in this forward (block decoding may fix tokens it cannot emit yet).
    """

    commit: list[int]
    confidences: list[float]
    keep_spec: int
    decided: int


class Strategy:
    """One decoding algorithm: plans each row's next forward and accepts from its logits."""

    name = "base"
    pattern = "causal"  # attention inside the speculative segment

    def __init__(self, params: DecodeParams, ids: SpecialIds):
        self.params = params
        self.ids = ids
        self.banned = ids.banned_outputs

    @property
    def spec_length(self) -> int:
        raise NotImplementedError

    def start(self, row: RowState) -> None:
        """Initialise per-row state once, after prefill."""

    def plan(self, row: RowState) -> StepPlan:
        raise NotImplementedError

    def accept(self, row: RowState, predicted: list[int], confidences: list[float]) -> Acceptance:
        """The token chosen at each speculative output (spec_length of them: output i predicts the
        token after spec input i; :func:`components.decoding.sampling.choose_rows`) and its probability."""
        raise NotImplementedError

    def pending_committed(self, row: RowState) -> StepPlan:
        """Left-to-right decoders: store what is committed but uncached, then end on the last token."""
        return StepPlan(stored=row.tokens[row.cached : -1], spec=[row.tokens[-1]])
