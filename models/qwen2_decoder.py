"""The interface pieces every model of ours with a Qwen2 text decoder shares.

DocVLM (page model) and the reader (element model) differ in what comes before the tokens (an
image prefix, a line recogniser's slots) and agree on everything after: special ids in the
config, content ids above the specials, the decoder's embeddings, a folder with the tokenizer,
the lean static-cache decoder and one decoder forward over new tokens. A class that mixes this in
(before ``PreTrainedModel``) holds ``self.language_model`` (a ``Qwen2ForCausalLM``) and a config
with ``text_config`` and ``<name>_token_id`` fields.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from models.interface import SPECIAL_ID_NAMES
from models.static_decoder import StaticQwen2Decoder


class Qwen2DecoderMixin:
    """:class:`models.interface.TrainableMarkupLM` methods that depend only on the text decoder."""

    language_model: nn.Module

    @property
    def special_ids(self) -> dict[str, int]:
        ids = {name: getattr(self.config, f"{name}_token_id") for name in SPECIAL_ID_NAMES}
        if any(v is None for v in ids.values()):
            raise ValueError(f"model config lacks special token ids: {ids}")
        return ids

    @property
    def vocab_size(self) -> int:
        return self.language_model.get_output_embeddings().weight.shape[0]

    @vocab_size.setter
    def vocab_size(self, _value: int) -> None:
        """``resize_token_embeddings`` assigns it; the size is read off the output layer."""

    def draft_token_ids(self) -> torch.Tensor:
        """Our tokenizers put their special tokens first, so content is every id above them."""
        return torch.arange(max(self.special_ids.values()) + 1, self.vocab_size)

    def get_input_embeddings(self) -> nn.Module:
        """The decoder's token embeddings (``transformers`` and ``peft`` look them up here)."""
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def save_folder(self, path: Path, tokenizer, state_dict: dict | None = None) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.save_pretrained(str(path), state_dict=state_dict)
        tokenizer.save_pretrained(str(path))
        return path

    @property
    def max_positions(self) -> int:
        return int(self.config.text_config.max_position_embeddings)

    def static_decoder(self) -> StaticQwen2Decoder | None:
        """The text decoder as a lean forward over a static KV cache (None if its config is unsupported).

        Built per call: it holds references to the current weights, so it must not outlive a ``.to()``.
        """
        try:
            return StaticQwen2Decoder(self.language_model)
        except ValueError:
            return None

    @torch.inference_mode()
    def forward_tokens(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                       cache: DynamicCache) -> torch.Tensor:
        """One decoder forward over new tokens; appends their KV to ``cache``. Mask is (B,1,Q,K) bool."""
        out = self.language_model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                  cache=cache, use_cache=True)
        return out.logits
