"""Pages -> tokenized training batches, in an order that depends only on (seed, step).

Batch composition is a pure function of the seed, the optimizer step, the micro-step and the
rank, so a run resumed from a checkpoint sees exactly the batches the uninterrupted run would
have seen, with no sampler state to save. Each source (the broad pages, and in Stage 2 the
curated hard pages) is read as an endless stream of per-epoch permutations; in Stage 2 every
global batch holds ``round(hard_ratio * G)`` hard pages and the rest broad ones.

Per-sample weights for Stage 2 come from ``page.meta["consistency"]`` (C(x) from curation):
``1 + beta * (1 - C(x))``; pages without a score weigh 1.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast

from components.data.pages import InvalidPageError, PageDataset, load_image
from components.training.objectives import consistency_weights


@dataclass(frozen=True)
class Example:
    page_id: str
    image_path: Path
    token_ids: tuple[int, ...]  # <bos> markup [<eos>]
    ends_with_eos: bool
    consistency: float | None


@dataclass
class Batch:
    """One micro-batch, already on the training device."""

    pixel_values: torch.Tensor  # (B, C, H, W)
    tokens: torch.Tensor  # (B, T) padded with <pad>
    lengths: torch.Tensor  # (B,)
    ends_with_eos: torch.Tensor  # (B,) bool
    weights: torch.Tensor  # (B,) per-sample loss weights
    page_ids: list[str]

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
        return Batch(
            pixel_values=self.pixel_values.to(device, dtype or self.pixel_values.dtype),
            tokens=self.tokens.to(device),
            lengths=self.lengths.to(device),
            ends_with_eos=self.ends_with_eos.to(device),
            weights=self.weights.to(device),
            page_ids=self.page_ids,
        )


def encode_markup(tokenizer: PreTrainedTokenizerFast, markup: str, max_tokens: int) -> tuple[list[int], bool]:
    """``<bos> markup <eos>`` cut to ``max_tokens``; the flag says whether ``<eos>`` survived."""
    body = tokenizer(markup, add_special_tokens=False)["input_ids"]
    ids = [tokenizer.bos_token_id, *body, tokenizer.eos_token_id]
    if len(ids) <= max_tokens:
        return ids, True
    return ids[:max_tokens], False


def load_examples(root: str | Path, tokenizer: PreTrainedTokenizerFast, max_tokens: int) -> list[Example]:
    """Tokenize every page of a dataset folder; bad records fail here, before training starts."""
    dataset = PageDataset(root)
    if not dataset.exists():
        raise FileNotFoundError(f"training dataset {dataset.root} has no pages.jsonl; create or pull it first")
    examples = []
    for page in dataset.pages():
        markup = page.markup
        if not markup.strip():
            raise InvalidPageError(f"page {page.page_id} in {dataset.root} has empty markup; curation should drop it")
        consistency = page.meta.get("consistency")
        if consistency is not None:
            consistency = float(consistency)
            if not 0.0 <= consistency <= 1.0:
                raise InvalidPageError(f"page {page.page_id} has consistency {consistency}; expected a value in [0, 1]")
        ids, finished = encode_markup(tokenizer, markup, max_tokens)
        examples.append(Example(page.page_id, dataset.image_path(page), tuple(ids), finished, consistency))
    if not examples:
        raise InvalidPageError(f"training dataset {dataset.root} holds no pages")
    return examples


def dataset_fingerprint(root: str | Path) -> dict[str, str | int]:
    """Which data a model was trained on: folder, sha256 of pages.jsonl, page count."""
    manifest = PageDataset(root).manifest
    content = manifest.read_bytes()
    return {
        "path": str(Path(root).resolve()),
        "pages_sha256": hashlib.sha256(content).hexdigest(),
        "n_pages": sum(1 for line in content.splitlines() if line.strip()),
    }


class _EpochStream:
    """Position p of an endless stream = permutation(seed, source, epoch = p // n)[p % n]."""

    def __init__(self, size: int, seed: int, source_id: int):
        self.size = size
        self.seed = seed
        self.source_id = source_id
        self._cache: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) > 4:
                self._cache.clear()
            self._cache[epoch] = np.random.default_rng([self.seed, self.source_id, epoch]).permutation(self.size)
        return self._cache[epoch]

    def __getitem__(self, position: int) -> int:
        return int(self._permutation(position // self.size)[position % self.size])


class BatchPlan:
    """Which examples form each micro-batch of each rank at each step."""

    def __init__(
        self, n_base: int, n_hard: int, hard_ratio: float, seed: int, micro_batch: int, grad_accum: int, world_size: int
    ):
        self.global_batch = micro_batch * grad_accum * world_size
        self.micro_batch, self.grad_accum, self.world_size = micro_batch, grad_accum, world_size
        self.seed = seed
        self.n_hard_per_batch = round(hard_ratio * self.global_batch) if n_hard else 0
        if hard_ratio > 0 and self.n_hard_per_batch == 0:
            raise ValueError(f"hard_ratio {hard_ratio} gives no hard page in a global batch of {self.global_batch}")
        self.base = _EpochStream(n_base, seed, 0)
        self.hard = _EpochStream(n_hard, seed, 1) if n_hard else None

    def global_indices(self, step: int) -> list[tuple[str, int]]:
        """(source, index) for every sample of the step's global batch, in a seeded shuffle."""
        n_hard = self.n_hard_per_batch
        n_base = self.global_batch - n_hard
        chosen = [("base", self.base[step * n_base + i]) for i in range(n_base)]
        if self.hard is not None:
            chosen += [("hard", self.hard[step * n_hard + i]) for i in range(n_hard)]
        order = np.random.default_rng([self.seed, 2, step]).permutation(len(chosen))
        return [chosen[i] for i in order]

    def micro_indices(self, step: int, micro: int, rank: int) -> list[tuple[str, int]]:
        start = (micro * self.world_size + rank) * self.micro_batch
        return self.global_indices(step)[start : start + self.micro_batch]

    def epoch_of(self, step: int) -> float:
        n_base = self.global_batch - self.n_hard_per_batch
        return step * n_base / self.base.size


class TrainingData:
    """The examples of a run plus the plan that batches them."""

    def __init__(
        self,
        base: list[Example],
        hard: list[Example] | None,
        plan: BatchPlan,
        pad_id: int,
        consistency_beta: float,
        preprocess: Callable[[list[Image.Image]], torch.Tensor],
    ):
        self.sources = {"base": base, "hard": hard or []}
        self.plan = plan
        self.pad_id = pad_id
        self.beta = consistency_beta
        self.preprocess = preprocess

    def batch(self, step: int, micro: int, rank: int) -> Batch:
        picked = [self.sources[source][index] for source, index in self.plan.micro_indices(step, micro, rank)]
        return collate(picked, self.pad_id, self.beta, self.preprocess)

    def token_statistics(self) -> dict[str, float]:
        lengths = [len(e.token_ids) for e in self.sources["base"] + self.sources["hard"]]
        return {
            "n_examples": len(lengths),
            "mean_tokens": float(np.mean(lengths)),
            "max_tokens": max(lengths),
            "truncated": sum(not e.ends_with_eos for e in self.sources["base"] + self.sources["hard"]),
        }


def collate(
    examples: list[Example], pad_id: int, consistency_beta: float, preprocess: Callable[[list[Image.Image]], torch.Tensor]
) -> Batch:
    """Pad token ids to the batch maximum, preprocess images, compute Stage-2 weights."""
    width = max(len(e.token_ids) for e in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    for row, example in enumerate(examples):
        tokens[row, : len(example.token_ids)] = torch.tensor(example.token_ids)
    consistency = torch.tensor(
        [math.nan if e.consistency is None else e.consistency for e in examples], dtype=torch.float32
    )
    return Batch(
        pixel_values=preprocess([load_image(e.image_path) for e in examples]),
        tokens=tokens,
        lengths=torch.tensor([len(e.token_ids) for e in examples]),
        ends_with_eos=torch.tensor([e.ends_with_eos for e in examples]),
        weights=consistency_weights(consistency, consistency_beta),
        page_ids=[e.page_id for e in examples],
    )
