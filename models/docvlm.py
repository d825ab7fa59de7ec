"""A small document VLM built only from ``transformers`` configs: ViT patch encoder + Qwen2 decoder.

The vision encoder's patch features, merged 2x2 and projected, become a prefix of the decoder's
input embeddings (the dots.ocr / Qwen2-VL recipe without its dynamic resolution). Every
decoding loop talks to the model through :class:`models.interface.MarkupLM`: ``prefill`` once
per page, then ``forward_tokens`` with an explicit 4-D attention mask, so one engine drives
AR, sliding-window and block-diffusion decoding alike.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from huggingface_hub.dataclasses import strict
from PIL import Image
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    DynamicCache,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    ViTConfig,
    ViTModel,
)
from transformers.configuration_utils import SubConfigSpec

from models.interface import PagePrefix
from models.qwen2_decoder import Qwen2DecoderMixin


@strict
class DocVLMConfig(PreTrainedConfig):
    """Config of :class:`DocVLMForConditionalGeneration` (saved as ``config.json``)."""

    model_type = "docvlm"
    sub_configs_defaults = {
        "vision_config": SubConfigSpec(config_class=AutoConfig, model_type="vit"),
        "text_config": SubConfigSpec(config_class=AutoConfig, model_type="qwen2"),
    }

    vision_config: dict | PreTrainedConfig | None = None
    text_config: dict | PreTrainedConfig | None = None
    spatial_merge_size: int = 2
    # "conv": stride-2 3x3 convolutions (channels per layer) before the ViT, whose patch
    # embedding then runs on the stem's feature map; "patch": the ViT sees raw pixels.
    vision_stem: Literal["patch", "conv"] = "patch"
    stem_channels: list[int] | None = None
    ink_scale: float = 4.0  # pixels enter as ink intensity (paper 0, black ink_scale); see preprocess
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    init_token_id: int | None = None
    mask_token_id: int | None = None
    attn_implementation_preference: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"
    tie_word_embeddings: bool = True

    @property
    def stem_stride(self) -> int:
        """Pixels per feature-map cell the ViT's patch embedding sees (1 without a conv stem)."""
        return 2 ** len(self.stem_channels or []) if self.vision_stem == "conv" else 1

    @property
    def pixel_patch(self) -> int:
        """Page pixels per ViT patch side."""
        return self.vision_config.patch_size * self.stem_stride

    @property
    def image_size(self) -> tuple[int, int]:
        """(height, width) every page is resized (and padded) to."""
        size = self.vision_config.image_size
        height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        return height * self.stem_stride, width * self.stem_stride

    @property
    def num_prefix_tokens(self) -> int:
        height, width = self.image_size
        patch, merge = self.pixel_patch, self.spatial_merge_size
        return (height // patch // merge) * (width // patch // merge)


def tiny_config(vocab_size: int, special_ids: dict[str, int], **overrides) -> DocVLMConfig:
    """The CPU-sized model: ~3M parameters, a 130-token image prefix for 416x320 pages."""
    vision = ViTConfig(
        image_size=[416, 320], patch_size=16, num_channels=1, hidden_size=128, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=256, qkv_bias=True,
    )
    text = Qwen2Config(
        vocab_size=vocab_size, hidden_size=192, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=512, max_position_embeddings=2048,
        tie_word_embeddings=True, rope_theta=10000.0,
    )
    values = {"vision_config": vision, "text_config": text, **special_ids, **overrides}
    return DocVLMConfig(**values)


def base_config(vocab_size: int, special_ids: dict[str, int], **overrides) -> DocVLMConfig:
    """The shipped base model's shape (``models/pretrained``).

    A convolutional stem (three stride-2 3x3 layers) feeds a 2-layer ViT whose 520 patches cover
    16x16 page pixels each (under one text line of the ``tiny`` pages); 2x2 merging hands the
    decoder 130 image tokens. Measured on 2 CPU cores against raw 16-pixel patches, the stem's
    features are learned far sooner; merging to 130 tokens halves the step time against 520,
    whose cost is mostly the decoder attending the prefix."""
    vision = ViTConfig(
        image_size=[52, 40], patch_size=2, num_channels=128, hidden_size=192, num_hidden_layers=2,
        num_attention_heads=6, intermediate_size=512, qkv_bias=True,
    )
    text = Qwen2Config(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=768, max_position_embeddings=2048,
        tie_word_embeddings=True, rope_theta=10000.0,
    )
    values = {"vision_config": vision, "text_config": text, "vision_stem": "conv", "stem_channels": [32, 64, 128],
              "spatial_merge_size": 2, **special_ids, **overrides}
    return DocVLMConfig(**values)


def page_pixels(images: list[Image.Image], image_size: tuple[int, int], ink_scale: float) -> torch.Tensor:
    """Grayscale, fit into ``image_size`` keeping aspect, pad white, feed ink intensity (CPU float32).

    Pages are mostly blank paper. Fed as brightness, every patch starts from the same large
    value and the few ink pixels are a small perturbation of it: a freshly initialised encoder
    then emits nearly identical features for every page and the decoder learns to ignore
    them (measured: loss with a page's own image equal to the loss with another page's).
    Fed as ink (paper = 0), blank patches embed to the bias alone and text dominates, and the
    tiny model starts reading within a few hundred CPU steps.

    Smaller images (element crops of a two-stage parse) are never enlarged: they sit at native
    resolution in the top-left corner, so a crop's glyphs have the size they have on its page.
    """
    height, width = image_size
    batch = np.full((len(images), 1, height, width), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        gray = image.convert("L")
        scale = min(1.0, width / gray.width, height / gray.height)
        size = (max(1, round(gray.width * scale)), max(1, round(gray.height * scale)))
        resized = gray.resize(size, Image.Resampling.BILINEAR) if size != gray.size else gray
        batch[i, 0, : size[1], : size[0]] = np.asarray(resized)
    ink = 1.0 - torch.from_numpy(batch).float().div_(255.0)
    return ink * ink_scale


def conv_stem(config: DocVLMConfig) -> nn.Sequential:
    """Stride-2 3x3 convolutions with GroupNorm and GELU, ending in the ViT's input channels."""
    layers: list[nn.Module] = []
    channels = [1, *config.stem_channels]
    for c_in, c_out in itertools.pairwise(channels):
        layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1), nn.GroupNorm(min(8, c_out), c_out), nn.GELU()]
    if channels[-1] != config.vision_config.num_channels:
        raise ValueError(f"stem ends in {channels[-1]} channels but vision_config.num_channels is "
                         f"{config.vision_config.num_channels}")
    return nn.Sequential(*layers)


def best_attention_implementation(preferred: str = "sdpa") -> str:
    """flash_attention_2 only where it is installed and a GPU runs; SDPA everywhere else."""
    if preferred == "flash_attention_2":
        try:
            # deferred: optional GPU extra, probed only when asked for
            import flash_attn  # noqa: F401
        except ImportError:
            return "sdpa"
        return "flash_attention_2" if torch.cuda.is_available() else "sdpa"
    return preferred


def attention_implementations(preferred: str = "sdpa") -> tuple[str, str]:
    """(vision tower, text model) attention kernels.

    The decoders pass arbitrary 4-D masks (cache holes, bidirectional blocks, causal spans) that
    flash-attention kernels cannot take, so the text model stays on SDPA; the vision tower has
    no mask and may use flash_attention_2.
    """
    attn = best_attention_implementation(preferred)
    return attn, ("sdpa" if attn == "flash_attention_2" else attn)


class DocVLMForConditionalGeneration(Qwen2DecoderMixin, PreTrainedModel):
    """Vision prefix + causal decoder. Implements :class:`models.interface.TrainableMarkupLM`."""

    takes_task_prompts = False  # an element crop alone says what it is (see components.parsing.prompts)

    config_class = DocVLMConfig
    base_model_prefix = "docvlm"
    main_input_name = "pixel_values"
    _supports_sdpa = True
    _supports_flash_attn = True
    supports_gradient_checkpointing = True
    _tied_weights_keys = {"language_model.lm_head.weight": "language_model.model.embed_tokens.weight"}

    def __init__(self, config: DocVLMConfig):
        super().__init__(config)
        vision_attn, text_attn = attention_implementations(config.attn_implementation_preference)
        config.vision_config._attn_implementation = vision_attn
        config.text_config._attn_implementation = text_attn
        self.stem = conv_stem(config) if config.vision_stem == "conv" else None
        self.vision = ViTModel(config.vision_config, add_pooling_layer=False)
        merged = config.vision_config.hidden_size * config.spatial_merge_size**2
        self.projector = nn.Sequential(
            nn.LayerNorm(merged), nn.Linear(merged, config.text_config.hidden_size), nn.GELU(),
            nn.Linear(config.text_config.hidden_size, config.text_config.hidden_size),
        )
        self.language_model = Qwen2ForCausalLM(config.text_config)
        self.post_init()

    # ----- image side -------------------------------------------------------------------
    def preprocess(self, images: list[Image.Image]) -> torch.Tensor:
        """:func:`page_pixels` at the configured size, on the model's device and dtype."""
        return self.cpu_preprocessor()(images).to(self.device, self.dtype)

    def cpu_preprocessor(self) -> Callable[[list[Image.Image]], torch.Tensor]:
        """A picklable CPU preprocessor (for DataLoader worker processes)."""
        return functools.partial(page_pixels, image_size=tuple(self.config.image_size), ink_scale=self.config.ink_scale)

    def encode_pages(self, pixel_values: torch.Tensor) -> PagePrefix:
        """The training interface's name for :meth:`encode_images` (page inputs are pixels here)."""
        return self.encode_images(pixel_values.to(self.device))

    def encode_images(self, pixel_values: torch.Tensor) -> PagePrefix:
        """Patch features, merged spatially and projected to the decoder's width."""
        return self.prefix_from_patches(self.patch_features(pixel_values))

    def patch_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The vision tower's output per patch, (B, rows, cols, D) in page order (one patch covers
        ``config.pixel_patch`` page pixels a side); what reading probes supervise directly."""
        features = pixel_values.to(self.dtype)
        if self.stem is not None:
            features = self.stem(features)
        hidden = self.vision(pixel_values=features).last_hidden_state[:, 1:]  # drop CLS
        patch = self.config.pixel_patch
        return hidden.reshape(hidden.shape[0], pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch, -1)

    def prefix_from_patches(self, patches: torch.Tensor) -> PagePrefix:
        batch, rows, cols, dim = patches.shape
        merge = self.config.spatial_merge_size
        grid = patches.reshape(batch, rows // merge, merge, cols // merge, merge, dim)
        merged = grid.permute(0, 1, 3, 2, 4, 5).reshape(batch, (rows // merge) * (cols // merge), merge * merge * dim)
        return PagePrefix(embeds=self.projector(merged))

    # ----- special ids and vocabulary (training interface) ----------------------------------
    # ----- text side --------------------------------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.get_input_embeddings()(input_ids)

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        prefix: PagePrefix | None = None,
        **kwargs,
    ):
        """Training forward over ``[image prefix, tokens]``; logits cover the token part only.

        ``attention_mask`` may be a 4-D bool mask over the full (prefix + tokens) sequence, which
        is how block-diffusion objectives ask for bidirectional attention inside blocks.
        """
        if prefix is None:
            if pixel_values is None:
                raise ValueError("forward needs pixel_values or an encoded prefix")
            prefix = self.encode_images(pixel_values)
        token_embeds = self.embed_tokens(input_ids)
        inputs_embeds = torch.cat([prefix.embeds, token_embeds], dim=1)
        n_prefix = prefix.embeds.shape[1]
        out = self.language_model.model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state[:, n_prefix:]
        logits = self.language_model.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return {"loss": loss, "logits": logits}

    # ----- MarkupLM interface used by the decoding engine -----------------------------------
    @property
    def num_prefix_tokens(self) -> int:
        return self.config.num_prefix_tokens

    @torch.inference_mode()
    def prefill(self, images: list[Image.Image], prompt_ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
        """Encode pages and run ``[prefix, prompt]`` once; returns prompt logits and the KV cache."""
        prefix = self.encode_images(self.preprocess(images))
        inputs_embeds = torch.cat([prefix.embeds, self.embed_tokens(prompt_ids.to(self.device))], dim=1)
        cache = DynamicCache(config=self.config.text_config)
        out = self.language_model(inputs_embeds=inputs_embeds, cache=cache, use_cache=True)
        return out.logits[:, prefix.embeds.shape[1] :], cache


AutoConfig.register("docvlm", DocVLMConfig)
AutoModel.register(DocVLMConfig, DocVLMForConditionalGeneration)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
