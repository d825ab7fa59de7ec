"""Parameters, per-row state and results of the decoding engine."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

DecoderName = Literal["ar", "sdb", "block", "ppc"]
DECODERS: tuple[str, ...] = ("ar", "sdb", "block", "ppc")


@dataclass(frozen=True)
class DecodeParams:
    """How to decode. Defaults follow the papers: w=16 (DARL), block 32 and τ=0.95 (MinerU)."""

    decoder: DecoderName = "ar"
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter when sampling
    seed: int | None = None
    window: int = 16  # DARL sliding diffusion block width w
    block_length: int = 32  # MinerU-Diffusion block length
    threshold: float = 0.95  # confidence τ for block decoding and PPC
    span: int = 16  # PA-BDM candidate span D

    def __post_init__(self) -> None:
        problems = []
        if self.decoder not in DECODERS:
            problems.append(f"decoder must be one of {DECODERS}, got {self.decoder!r}")
        if self.max_new_tokens < 1:
            problems.append("max_new_tokens must be >= 1")
        if self.temperature < 0:
            problems.append("temperature must be >= 0")
        if self.top_k < 0:
            problems.append("top_k must be >= 0")
        for name in ("window", "block_length", "span"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if not 0.0 < self.threshold <= 1.0:
            problems.append("threshold must be in (0, 1]")
        if problems:
            raise ValueError("invalid DecodeParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class DecodeStats:
    """Speed accounting for one page. Prefill (image prefix) is not a decoding forward."""

    forward_passes: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    accepted_lengths: list[int] = field(default_factory=list)
    confidence_sum: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_confidence(self) -> float:
        return self.confidence_sum / self.new_tokens if self.new_tokens else 0.0

    @classmethod
    def merge(cls, parts: Iterable[DecodeStats], *, concurrent: bool) -> DecodeStats:
        """Pool the accounting of several decodes: forwards, tokens, acceptances and confidence add
        up; the seconds add up for decodes that ran one after another, and are the longest one's
        for decodes that ran together in one batch (``concurrent``: a page's elements or pieces)."""
        total = cls()
        for part in parts:
            total.forward_passes += part.forward_passes
            total.new_tokens += part.new_tokens
            total.accepted_lengths.extend(part.accepted_lengths)
            total.confidence_sum += part.confidence_sum
            total.seconds = max(total.seconds, part.seconds) if concurrent else total.seconds + part.seconds
        return total

    def acceptance_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accepted_lengths).items()))

    def as_dict(self) -> dict:
        return {
            "forward_passes": self.forward_passes,
            "new_tokens": self.new_tokens,
            "tokens_per_forward": self.tokens_per_forward,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "mean_confidence": self.mean_confidence,
            "acceptance_histogram": self.acceptance_histogram(),
        }


@dataclass
class CommitEvent:
    """What one forward did for one row: the tokens it committed (maybe none) and how many it decided.

    Every forward of every row yields one event, so a consumer of the stream can rebuild the exact
    speed accounting; block decoding may decide tokens a few forwards before it can commit them.
    """

    row: int
    token_ids: list[int]
    text: str
    confidences: list[float]
    forward_pass: int
    decided: int = 0
    finished: bool = False
    truncated: bool = False


@dataclass
class DecodeResult:
    token_ids: list[int]
    text: str
    stats: DecodeStats
    confidences: list[float]
    finished: bool  # ended with <eos>
    truncated: bool  # stopped by max_new_tokens / max positions before <eos>
    parse: Any = None  # a two-stage parse's components.parsing.PageParse (elements, boxes, skips)


@dataclass
class RowState:
    """One page being decoded. ``tokens`` starts with <bos>; ``cached`` of them have KV in the cache."""

    row: int
    tokens: list[int]
    budget: int
    generator: torch.Generator | None
    cached: int = 0
    prefix_length: int = 0  # the position of the first generated token: its prefill's prefix length
    prefill: Any = None  # the cache its prefill returned (a model's per-row prefix state, e.g. the copy prior's)
    prefill_row: int = 0  # its row in that prefill
    started: float = 0.0  # perf_counter when its decoding began (prefill included): stats.seconds counts from it
    confidences: list[float] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)  # SDB: previous trajectory beyond the last token
    block_start: int = 0  # block decoding: token index of the current block's first input
    block_targets: list[int] = field(default_factory=list)  # block decoding: -1 = still masked
    block_confidences: list[float] = field(default_factory=list)
    finished: bool = False
    truncated: bool = False
    cancelled: bool = False  # the consumer of a stream dropped this page
    stats: DecodeStats = field(default_factory=DecodeStats)
    emitted_text: str = ""
    detokenizer: Any = None  # incremental detokenizer (tokenizers.decoders.DecodeStream) of this row

    @property
    def generated(self) -> list[int]:
        return self.tokens[1:]

    @property
    def remaining(self) -> int:
        return self.budget - len(self.generated)

    @property
    def done(self) -> bool:
        return self.finished or self.truncated or self.cancelled
