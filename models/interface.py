"""The one model interface: what the decoding engine and the training objectives need from a model.

Every checkpoint family (our DocVLM, the Hugging Face doc VLMs behind
:mod:`models.hf_adapter`) implements both halves, so one engine decodes and one objective mix
trains them all. The engine's token stream starts at a ``<bos>`` (position 0 after the page
prefix); a chat model maps it onto its chat prompt (see the adapter), so the prompt a page is
trained with is the prompt it is decoded with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image
from transformers import DynamicCache, PreTrainedTokenizerBase

SPECIAL_ID_NAMES = ("bos", "eos", "pad", "init", "mask")
# ``image.info[TEXT_LINE_INFO] = True``: the crop is one text line a detector found (the page front
# end's line crops), so a model that finds lines in a crop takes it whole instead of looking for more.
TEXT_LINE_INFO = "docmarkup_text_line"


@dataclass
class PagePrefix:
    """Encoded pages: whatever a model's forward needs before the markup tokens.

    ``embeds`` (B, P, H): image features already in the decoder's embedding space (DocVLM). Chat
    models subclass it with their prompt, validity mask and M-RoPE positions.
    """

    embeds: torch.Tensor

    @property
    def length(self) -> int:
        """P: the number of positions the prefix takes before the engine's position 0 (``<bos>``)."""
        return self.embeds.shape[1]


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model declares about how it reads, read once by the decoding engine: parsing,
    evaluation and serving ask the engine (``engine.capabilities``), never the model itself.

    A model states them as attributes (the defaults here are a whole-page markup model's):
    ``takes_task_prompts``, ``writes_markup``, ``reads_text_lines``, ``reading_pieces(crop)``,
    ``max_positions``, ``num_prefix_tokens`` and ``config.model_type`` (its family)."""

    family: str = ""  # config.model_type: picks the task-prompt style of a two-stage parse
    takes_task_prompts: bool = False  # an element crop is decoded after its category's task prompt
    writes_markup: bool = True  # False: it writes an element's bare text; the layout's category gives its form
    reads_text_lines: bool = False  # it reads single detected text lines (the page front end's line crops)
    reads_in_pieces: bool = False  # it splits a long crop into pieces its trained prefix holds (reading_pieces)
    max_positions: int = 1 << 30
    prefix_length: int = 0  # a fixed image-prefix length (0: it depends on the image, as in HF VLMs)


def capabilities_of(model: object | None) -> ModelCapabilities:
    """The capabilities a model declares (the defaults for one that declares none, or no model)."""
    if model is None:
        return ModelCapabilities()
    return ModelCapabilities(
        family=str(getattr(getattr(model, "config", None), "model_type", "") or ""),
        takes_task_prompts=bool(getattr(model, "takes_task_prompts", False)),
        writes_markup=bool(getattr(model, "writes_markup", True)),
        reads_text_lines=bool(getattr(model, "reads_text_lines", False)),
        reads_in_pieces=callable(getattr(model, "reading_pieces", None)),
        max_positions=int(getattr(model, "max_positions", 1 << 30)),
        prefix_length=int(getattr(model, "num_prefix_tokens", 0) or 0),
    )


# The CPU-side page inputs a preprocessor makes (a tensor, or a processor's BatchFeature): both
# move with ``.to(device)``; built in DataLoader workers, consumed by ``encode_pages``.
PageInputs = Any


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


@runtime_checkable
class TrainableMarkupLM(MarkupLM, Protocol):
    """The training half, what :class:`components.training.mix.ObjectiveMix`, the streams, the
    collation and the trainer use.

    * ``cpu_preprocessor()``: a picklable ``images -> PageInputs`` run in DataLoader workers
      (pages of any size; a chat model renders its prompt and left-pads here).
    * ``encode_pages(inputs)``: the pages' :class:`PagePrefix`, with gradient.
    * ``forward(input_ids, attention_mask, position_ids, prefix)``: token streams after the
      prefix. ``attention_mask`` (B, 1, P+T, P+T) bool over prefix + tokens; ``position_ids``
      (B, P+T) engine positions (prefix slot i at i, token k at P + k), which the model maps to
      its own (1-D, or M-RoPE with the row's offset). Returns ``{"logits": (B, T, V)}``.
    * ``special_ids``: bos (or its stand-in), eos, pad, ``<INIT>``, ``<MASK>``;
      ``vocab_size``: rows of the output layer; ``draft_token_ids()``: the ids a corrupt draft
      may use (real content tokens, never a special or a padded vocabulary row).
    * ``save_folder(path, tokenizer, state_dict)``: a folder :func:`models.loading.load_markup_model`
      loads (``state_dict``: other weights under the model's own names, e.g. LoRA-merged ones).
    """

    special_ids: dict[str, int]
    vocab_size: int
    dtype: torch.dtype

    def cpu_preprocessor(self) -> Callable[[list[Image.Image]], PageInputs]: ...

    def encode_pages(self, inputs: PageInputs) -> PagePrefix: ...

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, prefix: PagePrefix
    ) -> dict[str, torch.Tensor]: ...

    def draft_token_ids(self) -> torch.Tensor: ...

    def save_folder(
        self, path: Path, tokenizer: PreTrainedTokenizerBase, state_dict: dict[str, torch.Tensor] | None = None
    ) -> Path: ...
