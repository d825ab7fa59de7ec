"""MinerU-Diffusion block decoding: causal across blocks, bidirectional inside a block.

A block is L consecutive input positions ``[c, x_{s+1} .. x_{s+L-1}]`` whose L outputs predict
tokens s+1 .. s+L; unknown inputs are ``<MASK>``. Each denoising step runs the block against
the cached prefix without storing its KV, and commits every still-masked target whose
confidence is >= τ, at least the single most confident one. Tokens are emitted as soon as they
are contiguous with the committed text. When every target of the block is known, its inputs
are stored (causally, exactly as the training's clean stream computes them) in the same
forward that runs the next block's first denoising step, so finishing a block costs no extra
forward. A committed ``<eos>`` makes later targets of the block unnecessary.
"""

from __future__ import annotations

from components.decoding.strategy import Acceptance, StepPlan, Strategy
from components.decoding.types import RowState

UNKNOWN = -1


class BlockDiffusionStrategy(Strategy):
    name = "block"
    pattern = "bidirectional"

    @property
    def spec_length(self) -> int:
        return self.params.block_length

    def start(self, row: RowState) -> None:
        self._open_block(row, start=0)

    def _open_block(self, row: RowState, start: int) -> None:
        row.block_start = start
        row.block_targets = [UNKNOWN] * self.params.block_length
        row.block_confidences = [0.0] * self.params.block_length

    def _needed(self, row: RowState) -> int:
        """How many targets of this block must be known before the block is complete."""
        needed = min(self.params.block_length, row.budget - row.block_start)
        if self.ids.eos in row.block_targets[:needed]:
            needed = row.block_targets.index(self.ids.eos) + 1
        return needed

    def plan(self, row: RowState) -> StepPlan:
        start = row.block_start
        inputs = [t if t != UNKNOWN else self.ids.mask for t in row.block_targets[:-1]]
        return StepPlan(stored=row.tokens[row.cached : start], spec=[row.tokens[start], *inputs])

    def accept(self, row: RowState, predicted: list[int], confidences: list[float]) -> Acceptance:
        needed = self._needed(row)
        masked = [j for j in range(needed) if row.block_targets[j] == UNKNOWN]
        chosen = [j for j in masked if confidences[j] >= self.params.threshold]
        if not chosen and masked:
            chosen = [max(masked, key=lambda j: confidences[j])]
        for j in chosen:
            row.block_targets[j] = predicted[j]
            row.block_confidences[j] = confidences[j]
        needed = self._needed(row)  # a newly committed <eos> shortens the block
        emitted_before = len(row.tokens) - 1 - row.block_start
        contiguous = emitted_before
        while contiguous < needed and row.block_targets[contiguous] != UNKNOWN:
            contiguous += 1
        commit = row.block_targets[emitted_before:contiguous]
        commit_conf = row.block_confidences[emitted_before:contiguous]
        if contiguous == self.params.block_length:
            self._open_block(row, start=row.block_start + self.params.block_length)
        return Acceptance(commit=commit, confidences=commit_conf, keep_spec=0, decided=len(chosen))
