"""Train and decode Hugging Face doc-VLM checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, PaddleOCR-VL).

The engine (:mod:`components.decoding.engine`) and the objective mix
(:mod:`components.training.mix`) speak :class:`models.interface.TrainableMarkupLM`: encode pages
once, then run token streams at explicit 1-D positions under an explicit 4-D bool mask. These
checkpoints expect a chat prompt with the page image inside it and 3-D M-RoPE positions. The
adapter bridges the two without touching the checkpoint's architecture; the family's own forward
runs (``mm_encoder_outputs`` carries the vision tower's output, so Qwen3-VL's deepstack and
PaddleOCR-VL's projector work unchanged):

* **Prompt and "bos".** A page's prompt is the checkpoint's chat template around the image and
  an instruction (dots.ocr style, :data:`DEFAULT_PROMPT`; PaddleOCR-VL's ``OCR:`` where asked),
  the same in training and decoding, ending with the generation prompt
  (``<|im_start|>assistant\\n``). ``prefill`` runs every prompt token except the last; the engine
  then feeds its ``<bos>`` as the first token and the adapter swaps it for that held-back last
  prompt token. So the engine's first forward is exactly the prompt's final step and its output
  predicts the first answer token, as in ``generate``. A swap (rather than making the held-back
  token the bos) is needed because the engine never *outputs* bos, and the held-back token of a
  Qwen chat prompt is ``"\\n"``, which markup needs.
* **Special ids** (engine needs bos/eos/pad/``<INIT>``/``<MASK>``), for a Qwen chat tokenizer:
  eos = ``<|im_end|>`` (ends the assistant turn), pad = ``<|endoftext|>``, bos = the tokenizer's
  own bos if any, else the held-back token when it is a special token (a dots.ocr-like
  ``<|assistant|>``), else ``<|im_start|>`` (opens a turn, never occurs inside an answer).
  ``<INIT>``/``<MASK>`` are added as special tokens when missing; the embeddings grow only when
  the tokenizer outgrows them (Qwen checkpoints pad the vocabulary, so usually they do not).
  Before DARL / block-diffusion fine-tuning the new rows are untrained: greedy SDB stays exact
  (it verifies every guess) but accepts little. The tokenizer's other special tokens (image
  placeholders, turn markers) are never emitted by a decoder nor drawn into a corrupt draft.
* **Positions.** Text after the image uses 1-D positions shifted by a per-row offset (the
  M-RoPE ``rope_delta``: the image takes fewer positions than tokens). Engine position ``p``
  becomes ``(p + delta, p + delta, p + delta)``.
* **Batches** of pages with different image sizes have prompts of different lengths; they are
  left-padded, and the adapter hides the padded prefix slots from every later query (the
  engine's and the training streams' masks only know about holes they made themselves). In
  decoding the cache carries those per-row facts, so they follow the engine's
  ``batch_select_indices`` when rows finish; in training :class:`ChatPagePrefix` does.
* **Attention.** The language model always runs SDPA: flash-attention kernels take no arbitrary
  4-D mask, and the engine's masks are arbitrary (holes, bidirectional blocks). The vision
  tower uses flash_attention_2 where it is installed and a GPU runs.

``AutoProcessor`` for Qwen2-VL in transformers 5.x also builds the video processor, which needs
torchvision; without it (this project's CPU environment: PyPI's torchvision wheels are CUDA
builds that do not import against CPU torch) the adapter falls back to
:class:`ImagePromptProcessor`, the image half of ``Qwen2VLProcessor`` on the checkpoint's own
image processor and tokenizer.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from tokenizers import pre_tokenizers, trainers
from torch import nn
from transformers import (
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    BatchFeature,
    DynamicCache,
    PaddleOCRVLConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2VLConfig,
    Qwen3VLConfig,
)
from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import PaddleOCRVLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from models.docvlm import best_attention_implementation
from models.tokenizer import INIT, MASK, all_special_ids, build_untrained_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_PROMPT = "Convert this page to markdown."
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "paddleocr_vl")
QWEN_EOS, QWEN_PAD, QWEN_TURN_START = "<|im_end|>", "<|endoftext|>", "<|im_start|>"


class HFLoadError(RuntimeError):
    """A Qwen2-VL-family folder this adapter cannot serve (unsupported type, unusable prompt or tokenizer)."""


# ----- cache ----------------------------------------------------------------------------------
class PagePromptCache(DynamicCache):
    """KV cache that also remembers, per row, which prefilled slots are padding and its M-RoPE offset.

    Both follow :meth:`batch_select_indices` (the engine drops finished rows that way); ``crop``
    only ever removes slots after the prompt, so it needs no override.
    """

    def __init__(self, prefix_valid: torch.Tensor, rope_deltas: torch.Tensor, **kwargs):
        super().__init__(**kwargs)
        self.prefix_valid = prefix_valid  # (B, P) bool: False where the row's prompt was left-padded
        self.rope_deltas = rope_deltas  # (B,) long: M-RoPE position = engine position + delta

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        indices = indices.to(self.prefix_valid.device)
        self.prefix_valid = self.prefix_valid[indices]
        self.rope_deltas = self.rope_deltas[indices]


# ----- processor fallback ---------------------------------------------------------------------
class ImagePromptProcessor:
    """The image half of ``Qwen2VLProcessor``: expand each image token, tokenize, mark image slots.

    Used when ``AutoProcessor`` cannot be built (it insists on a video processor, which needs
    torchvision). Produces the same ``input_ids`` / ``pixel_values`` / ``image_grid_thw`` /
    ``mm_token_type_ids`` for image-only prompts.
    """

    def __init__(self, image_processor, tokenizer: PreTrainedTokenizerBase, image_token: str, chat_template: str | None):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.chat_template = chat_template

    @classmethod
    def from_pretrained(cls, path: str | Path, image_token: str) -> ImagePromptProcessor:
        path = Path(path)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(AutoImageProcessor.from_pretrained(str(path)), tokenizer, image_token, _read_chat_template(path, tokenizer))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False) -> str:
        if tokenize:
            raise ValueError("ImagePromptProcessor renders text only; call it on the rendered prompt")
        if self.chat_template is None:
            raise HFLoadError("the checkpoint has no chat template (no chat_template.jinja/json, none in the tokenizer)")
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def __call__(self, text: list[str], images: list[Image.Image], padding_side: str = "left", **_ignored) -> BatchFeature:
        if len(text) != len(images):
            raise ValueError(f"one image per prompt expected, got {len(text)} prompts and {len(images)} images")
        vision = self.image_processor(images=images, return_tensors="pt")
        merge = self.image_processor.merge_size**2
        expanded = []
        for prompt, grid in zip(text, vision["image_grid_thw"], strict=True):
            if prompt.count(self.image_token) != 1:
                raise ValueError(f"prompt must hold the image token {self.image_token!r} exactly once: {prompt!r}")
            expanded.append(prompt.replace(self.image_token, self.image_token * int(grid.prod() // merge)))
        encoded = self.tokenizer(expanded, padding=True, padding_side=padding_side, return_tensors="pt")
        mm_token_type_ids = (encoded["input_ids"] == self.image_token_id).long()
        return BatchFeature({**encoded, **vision, "mm_token_type_ids": mm_token_type_ids})


def _read_chat_template(path: Path, tokenizer: PreTrainedTokenizerBase) -> str | None:
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    if (path / "chat_template.json").exists():
        return json.loads((path / "chat_template.json").read_text(encoding="utf-8"))["chat_template"]
    return tokenizer.chat_template


def load_processor(path: str | Path, image_token: str):
    """``AutoProcessor`` when it loads; otherwise (no torchvision) :class:`ImagePromptProcessor`."""
    try:
        return AutoProcessor.from_pretrained(str(path))
    except ImportError as exc:
        logger.info("AutoProcessor unavailable (%s); using the image-only prompt processor", str(exc).strip().splitlines()[0])
        return ImagePromptProcessor.from_pretrained(path, image_token)


# ----- special tokens -------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptTokens:
    """How the engine's token stream maps onto the chat prompt (see the module docstring)."""

    bos_id: int  # what the engine feeds first
    held_back_id: int  # the prompt's last token, which the bos stands in for


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, held_back_token: str) -> tuple[int, str]:
    """Give a chat tokenizer the special tokens the engine needs. Returns (tokens added, bos token)."""
    vocab = tokenizer.get_vocab()
    specials: dict = {}
    if tokenizer.eos_token is None:
        if QWEN_EOS not in vocab:
            raise HFLoadError(f"tokenizer has no eos token and no {QWEN_EOS}; cannot tell where an answer ends")
        specials["eos_token"] = QWEN_EOS
    eos = specials.get("eos_token", tokenizer.eos_token)
    if tokenizer.pad_token is None or tokenizer.pad_token == eos:
        # pad is never an output; sharing it with eos would forbid ever stopping.
        specials["pad_token"] = QWEN_PAD if QWEN_PAD in vocab and eos != QWEN_PAD else "<pad>"
    if tokenizer.bos_token is not None and tokenizer.bos_token != eos:
        bos = tokenizer.bos_token
    elif held_back_token in tokenizer.all_special_tokens:
        bos = held_back_token
    elif QWEN_TURN_START in vocab:
        bos = QWEN_TURN_START
    else:
        bos = "<bos>"
    specials["bos_token"] = bos
    missing = [t for t in (INIT, MASK) if t not in vocab]
    if missing:
        specials["extra_special_tokens"] = missing
    added = tokenizer.add_special_tokens(specials, replace_extra_special_tokens=False)
    return added, bos


# ----- the model ------------------------------------------------------------------------------
@dataclass
class ChatPagePrefix:
    """A batch of encoded pages for a chat VLM: the prompt up to (not including) its last token.

    ``prompt_ids`` (B, P) left-padded (``valid`` False on padding), ``positions`` (3, B, P) the
    prompt's M-RoPE positions, ``rope_deltas`` (B,) the offset of the row's text positions
    (engine position p -> p + delta), ``vision`` the vision tower's outputs (with gradient when
    training), handed to the family's forward as ``mm_encoder_outputs`` so it scatters them
    into the image placeholders (and, for Qwen3-VL, into its deepstack layers).
    """

    prompt_ids: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    rope_deltas: torch.Tensor
    vision: dict

    @property
    def length(self) -> int:
        return self.prompt_ids.shape[1]


def render_page_inputs(processor, default_prompt: str, images: list[Image.Image],
                       prompts: list[str | None] | None = None) -> BatchFeature:
    """Processor outputs for a batch of pages, left-padded (picklable: DataLoader workers call it).

    Each image gets the chat prompt around ``default_prompt``, or around its own task prompt
    (an element crop of a two-stage parse) where ``prompts`` names one."""
    rgb = [image.convert("RGB") for image in images]
    rendered = {default_prompt: _render_prompt(processor, default_prompt)}
    texts = []
    for prompt in prompts or [None] * len(images):
        prompt = prompt or default_prompt
        if prompt not in rendered:
            rendered[prompt] = _render_prompt(processor, prompt)
        texts.append(rendered[prompt])
    return processor(text=texts, images=rgb, padding=True, padding_side="left", return_tensors="pt")


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")


class HFMarkupModel(nn.Module):
    """A Hugging Face doc-VLM checkpoint (:data:`SUPPORTED_MODEL_TYPES`) behind
    :class:`models.interface.TrainableMarkupLM`: the engine decodes it and the objective mix trains it."""

    takes_task_prompts = True  # element crops are decoded with their category's task prompt

    def __init__(self, hf_model: nn.Module, processor, prompt: str = DEFAULT_PROMPT, source: Path | None = None):
        """Wrap a loaded checkpoint; adds missing special tokens to ``processor.tokenizer`` (in place)."""
        super().__init__()
        self.hf = hf_model.eval()
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.prompt = prompt
        self.source = source
        held_back_id = _render_ids(processor, prompt)[-1]
        held_back = self.tokenizer.convert_ids_to_tokens(held_back_id)
        added, bos = prepare_tokenizer(self.tokenizer, held_back)
        if len(self.tokenizer) > hf_model.get_input_embeddings().weight.shape[0]:
            hf_model.resize_token_embeddings(len(self.tokenizer))
        self.prompt_tokens = PromptTokens(bos_id=self.tokenizer.bos_token_id, held_back_id=held_back_id)
        self._draft_ids: torch.Tensor | None = None
        logger.info("%d special tokens added; engine bos %r stands for the prompt's last token %r", added, bos, held_back)

    @classmethod
    def load(
        cls, path: str | Path, dtype: torch.dtype | None = None, prompt: str = DEFAULT_PROMPT
    ) -> tuple[HFMarkupModel, PreTrainedTokenizerBase]:
        """Load weights, processor and tokenizer from a local folder; returns (model, tokenizer)."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise HFLoadError(
                f"{path}: model_type {config.get('model_type')!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}. dots.ocr checkpoints ship their own remote code "
                "(a 1-D RoPE Qwen2 decoder) written for transformers 4.x and are not supported yet."
            )
        vision_attention = best_attention_implementation("flash_attention_2")
        hf_model = AutoModelForImageTextToText.from_pretrained(
            str(path), dtype=dtype or torch.float32,
            attn_implementation={"": "sdpa", "text_config": "sdpa", "vision_config": vision_attention},
        )
        model = cls(hf_model, load_processor(path, _image_token(path, config)), prompt, source=path)
        return model, model.tokenizer

    # ----- facts the engine and the trainer read ----------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def config(self):
        """The checkpoint's config (``model_type`` picks LoRA targets, DeepSpeed reads hidden sizes)."""
        return self.hf.config

    @property
    def max_positions(self) -> int:
        return int(self.hf.config.get_text_config().max_position_embeddings)

    @property
    def special_ids(self) -> dict[str, int]:
        tokenizer = self.tokenizer
        return {"bos": self.prompt_tokens.bos_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
                "init": tokenizer.convert_tokens_to_ids(INIT), "mask": tokenizer.convert_tokens_to_ids(MASK)}

    @property
    def vocab_size(self) -> int:
        return self.hf.get_output_embeddings().weight.shape[0]

    def draft_token_ids(self) -> torch.Tensor:
        """Every tokenizer id that is not a special token. Chat tokenizers append their specials
        (and ours, ``<INIT>``/``<MASK>``) after the content ids, and the embedding matrix is
        padded past the tokenizer, so no id range works; the rows past ``len(tokenizer)`` never
        train and are left out too."""
        if self._draft_ids is None:
            special = all_special_ids(self.tokenizer)
            keep = torch.ones(len(self.tokenizer), dtype=torch.bool)
            keep[sorted(i for i in special if i < len(self.tokenizer))] = False
            self._draft_ids = keep.nonzero().squeeze(1)
        return self._draft_ids

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    # ----- prompts ----------------------------------------------------------------------------
    def chat_prompt(self) -> str:
        """The page prompt text with one (unexpanded) image placeholder."""
        return _render_prompt(self.processor, self.prompt)

    def cpu_preprocessor(self):
        """``(images, prompts=None) -> BatchFeature`` on CPU: the prompts decoding renders (:meth:`page_inputs`)."""
        return functools.partial(render_page_inputs, self.processor, self.prompt)

    def page_inputs(self, images: list[Image.Image], prompts: list[str | None] | None = None) -> BatchFeature:
        """Processor outputs for a batch of pages (left-padded): what ``generate`` would be given."""
        return render_page_inputs(self.processor, self.prompt, images, prompts)

    def _prompt_part(self, inputs: BatchFeature) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt ids but the last, their validity, their M-RoPE positions, the row's text offset)."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"].bool()
        if not torch.all(input_ids[:, -1] == self.prompt_tokens.held_back_id):
            raise ValueError("page prompts must all end with the chat template's last token (left padding expected)")
        positions, _ = self.hf.model.get_rope_index(
            input_ids, mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
            attention_mask=attention_mask,
        )
        n_prefix = input_ids.shape[1] - 1
        # The held-back token is text: all three M-RoPE components equal its position.
        rope_deltas = positions[0, :, -1] - n_prefix
        return input_ids[:, :n_prefix], attention_mask[:, :n_prefix], positions[:, :, :n_prefix], rope_deltas

    def _engine_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The engine's bos becomes the held-back last prompt token (see the module docstring)."""
        ids = self.prompt_tokens
        if ids.bos_id != ids.held_back_id:
            input_ids = input_ids.masked_fill(input_ids == ids.bos_id, ids.held_back_id)
        return input_ids

    # ----- training half ------------------------------------------------------------------------
    def encode_pages(self, inputs: BatchFeature) -> ChatPagePrefix:
        """Run the vision tower (with gradient) and lay out the prompt; the decoder runs in :meth:`forward`."""
        inputs = inputs.to(self.device)
        prompt_ids, valid, positions, rope_deltas = self._prompt_part(inputs)
        vision = self.hf.model.get_image_features(
            inputs["pixel_values"].to(self.dtype), inputs["image_grid_thw"], return_dict=True
        )
        return ChatPagePrefix(prompt_ids, valid, positions, rope_deltas, {"image": vision})

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, prefix: ChatPagePrefix
    ) -> dict[str, torch.Tensor]:
        """Token streams after the page prompt under a (B, 1, P+T, P+T) bool mask; engine positions
        (B, P+T) of the token part become the row's M-RoPE text positions."""
        n_prefix = prefix.length
        ids = torch.cat([prefix.prompt_ids, self._engine_ids(input_ids)], dim=1)
        text = position_ids[:, n_prefix:] + prefix.rope_deltas[:, None]
        positions = torch.cat([prefix.positions, text[None].expand(prefix.positions.shape[0], -1, -1)], dim=2)
        out = self.hf.model(
            input_ids=ids, attention_mask=_hide_prompt_padding(attention_mask, prefix.valid), position_ids=positions,
            mm_encoder_outputs=dict(prefix.vision), use_cache=False,
        )
        return {"logits": self.hf.lm_head(out.last_hidden_state[:, n_prefix:])}

    def save_folder(
        self, path: Path, tokenizer: PreTrainedTokenizerBase, state_dict: dict[str, torch.Tensor] | None = None
    ) -> Path:
        """A plain checkpoint folder (weights under the family's names, tokenizer with the engine's
        special tokens, the source folder's processor files): ``AutoModelForImageTextToText`` and
        :func:`models.loading.load_markup_model` both load it."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = None if state_dict is None else {name.removeprefix("hf."): value for name, value in state_dict.items()}
        self.hf.save_pretrained(str(path), state_dict=state)
        tokenizer.save_pretrained(str(path))
        copied = [name for name in PROCESSOR_FILES if self.source is not None and (self.source / name).is_file()]
        for name in copied:
            shutil.copyfile(self.source / name, path / name)
        if not copied:  # wrapped in memory: write what the processor holds
            self.processor.image_processor.save_pretrained(str(path))
            if self.processor.chat_template:
                (path / "chat_template.jinja").write_text(self.processor.chat_template, encoding="utf-8")
        return path

    # ----- decoding half (MarkupLM) -------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, images: list[Image.Image], prompt_ids: torch.Tensor,
                prompts: list[str | None] | None = None) -> tuple[torch.Tensor, PagePromptCache]:
        """Run each page's chat prompt but its last token; then ``prompt_ids`` (engine ids), if any.

        The cache length after the chat part is the engine's ``n_prefix``; the engine's first
        input (its bos) stands for the held-back prompt token. ``prompts``: a task prompt per
        image in place of the page instruction (left padding evens out their lengths).
        """
        inputs = self.page_inputs(images, prompts).to(self.device)
        prompt, valid, positions, rope_deltas = self._prompt_part(inputs)
        n_prefix = prompt.shape[1]
        causal = torch.ones(n_prefix, n_prefix, dtype=torch.bool, device=self.device).tril()
        cache = PagePromptCache(valid, rope_deltas, config=self.hf.config)
        self.hf(
            input_ids=prompt, pixel_values=inputs["pixel_values"].to(self.dtype), image_grid_thw=inputs["image_grid_thw"],
            position_ids=positions, attention_mask=_hide_prompt_padding(causal.expand(len(images), 1, -1, -1), valid),
            cache=cache, use_cache=True, logits_to_keep=1,
        )
        batch = prompt.shape[0]
        n_prompt = prompt_ids.shape[1]
        if n_prompt == 0:
            return torch.zeros(batch, 0, self.hf.config.get_text_config().vocab_size, device=self.device), cache
        position_ids = torch.arange(n_prefix, n_prefix + n_prompt, device=self.device).expand(batch, -1)
        prompt_mask = torch.ones(batch, 1, n_prompt, n_prefix + n_prompt, dtype=torch.bool, device=self.device)
        prompt_mask[..., n_prefix:] = torch.ones(n_prompt, n_prompt, dtype=torch.bool, device=self.device).tril()
        return self.forward_tokens(prompt_ids.to(self.device), position_ids, prompt_mask, cache), cache

    @torch.inference_mode()
    def forward_tokens(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache: PagePromptCache
    ) -> torch.Tensor:
        """Append tokens at engine positions under a (B, 1, Q, K) bool mask; returns (B, Q, V) logits."""
        text_positions = position_ids + cache.rope_deltas[:, None]
        mask = attention_mask.clone()
        n_prefix = cache.prefix_valid.shape[1]
        mask[..., :n_prefix] &= cache.prefix_valid[:, None, None, :]
        out = self.hf(
            input_ids=self._engine_ids(input_ids), position_ids=text_positions[None].expand(3, -1, -1),
            attention_mask=mask, cache=cache, use_cache=True,
        )
        return out.logits


def _hide_prompt_padding(mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Nothing attends a left-padded prompt slot; a padded slot's own row sees itself (no empty softmax)."""
    n_prefix = valid.shape[1]
    mask = mask.clone()
    mask[..., :n_prefix] &= valid[:, None, None, :]
    slots = torch.arange(n_prefix, device=mask.device)
    mask[:, :, slots, slots] = True
    return mask


def _render_prompt(processor, prompt: str) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _render_ids(processor, prompt: str) -> list[int]:
    ids = processor.tokenizer(_render_prompt(processor, prompt), add_special_tokens=False)["input_ids"]
    if not ids:
        raise HFLoadError("the chat template rendered an empty prompt")
    return ids


def _image_token(path: Path, config: dict) -> str:
    """The image placeholder token, from the id in the model config."""
    tokenizer_config = path / "tokenizer_config.json"
    token_id = config.get("image_token_id")
    if token_id is None:
        raise HFLoadError(f"{path}/config.json has no image_token_id")
    # Cheap lookup without a second tokenizer load: added tokens are listed in tokenizer_config.json.
    if tokenizer_config.exists():
        added = json.loads(tokenizer_config.read_text()).get("added_tokens_decoder", {})
        if str(token_id) in added:
            return added[str(token_id)]["content"]
    return AutoTokenizer.from_pretrained(str(path)).convert_ids_to_tokens(token_id)


# ----- a tiny checkpoint shaped like a real one (tests, CI smoke runs) ----------------------------
QWEN_SPECIAL_TOKENS = [
    QWEN_PAD, QWEN_TURN_START, QWEN_EOS, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
]
# Qwen2-VL's chat template, image and text parts only.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_hf_vlm(
    path: str | Path, texts: list[str], model_type: str = "qwen2_vl", seed: int = 0, vocab_size: int = 384,
    max_pixels: int = 28 * 28 * 24, text_overrides: dict | None = None, vision_overrides: dict | None = None,
) -> Path:
    """Write a randomly initialised CPU-sized checkpoint folder of a supported family.

    The architecture is the family's own (``AutoModelForImageTextToText.from_config``: M-RoPE,
    window attention for Qwen2.5-VL, deepstack for Qwen3-VL, the SigLIP tower and projector of
    PaddleOCR-VL), a few layers wide. Its tokenizer is Qwen-like (eos ``<|im_end|>``, pad
    ``<|endoftext|>``, no bos, no ``<INIT>``/``<MASK>``) for every family, so loading it goes
    through the same token mapping as a real checkpoint. ``text_overrides`` / ``vision_overrides``
    change the sub-configs (a larger random model for GPU measurements; ``vocab_size`` there pads the
    embedding past the tokenizer, as real Qwen checkpoints do).
    """

    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}")
    path = Path(path)
    backend = build_untrained_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=QWEN_SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([*texts, "user assistant " + DEFAULT_PROMPT], trainer=trainer)
    # PaddleOCR-VL's processor reads the image placeholder off the tokenizer (``tokenizer.image_token``).
    named = {"extra_special_tokens": {"image_token": "<|image_pad|>"}} if model_type == "paddleocr_vl" else {}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=QWEN_EOS, pad_token=QWEN_PAD, additional_special_tokens=QWEN_SPECIAL_TOKENS[1:],
        **named,
    )
    token_id = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
    )
    vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    special = dict(
        image_token_id=token_id("<|image_pad|>"), video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"), vision_end_token_id=token_id("<|vision_end|>"),
    )
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=max_pixels)
    if model_type == "qwen2_vl":
        config = Qwen2VLConfig(text_config=text, vision_config={**vision, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}, **special)
        processor_class = "Qwen2VLProcessor"
    elif model_type == "qwen2_5_vl":
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
        processor_class = "Qwen2_5_VLProcessor"
    elif model_type == "qwen3_vl":
        # 16-pixel patches merged 2x2; interleaved M-RoPE; one deepstack layer.
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                  "mrope_interleaved": True, "rope_theta": 1e4})
        vision.update(patch_size=16, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
        config = Qwen3VLConfig(text_config=text, vision_config=vision, **special)
        image_processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32 * 4, max_pixels=max_pixels, patch_size=16)
        processor_class = "Qwen3VLProcessor"
    else:  # paddleocr_vl: a SigLIP-style tower with learned 2-D positions, ERNIE-4.5-style decoder
        text.update(head_dim=16)
        config = PaddleOCRVLConfig(
            text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=2, image_size=112, patch_size=14, spatial_merge_size=2),
            **special,
        )
        image_processor = PaddleOCRVLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=max_pixels)
        processor_class = "PaddleOCRVLProcessor"
    for sub, overrides in ((config.text_config, text_overrides), (config.vision_config, vision_overrides)):
        for key, value in (overrides or {}).items():
            setattr(sub, key, value)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    image_processor.save_pretrained(str(path))
    (path / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE, encoding="utf-8")
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}), encoding="utf-8")
    return path
