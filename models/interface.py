"""What the decoding engine needs from a model, so one engine serves every checkpoint family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from PIL import Image
from transformers import DynamicCache


@dataclass
class PagePrefix:
    """Image features already in the decoder's embedding space, shape (B, P, H)."""

    embeds: torch.Tensor


@runtime_checkable
class MarkupLM(Protocol):
    """A page-to-markup model as the decoding loops see it.

    ``prefill`` runs the image prefix and the prompt once and returns the prompt's logits
    (B, T, V) plus a KV cache whose length is prefix + prompt. ``forward_tokens`` appends Q
    tokens at explicit positions under an explicit (B, 1, Q, K) bool mask (True = attend),
    where K is the cache length after appending; the caller crops rejected entries.

    Optionally ``static_decoder()`` returns a lean forward over a preallocated KV cache
    (``models.static_decoder``); the engine then uses it instead of ``forward_tokens`` and a
    ``DynamicCache``. Models without it (the Hugging Face family adapters) keep the dynamic path.
    """

    device: torch.device

    def prefill(self, images: list[Image.Image], prompt_ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]: ...

    def forward_tokens(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor: ...
