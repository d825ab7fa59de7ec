"""A lean forward of a Qwen2 text decoder over a preallocated (static) KV cache.

Decoding a small model is bound by per-forward framework overhead, not arithmetic: the
``transformers`` forward of a 4-layer model runs ~1,000 aten ops and dozens of module calls, and a
``DynamicCache`` grows (``torch.cat``) and is cropped every step. This forward reads the same
weights (no copy) and computes the same function with plain ``torch.nn.functional`` calls:
RMSNorm in float32, rotary embeddings, grouped-query SDPA under the engine's explicit boolean
mask (keys/values repeated, or the query packed for Q = 1, as ``transformers`` does), SwiGLU MLP,
final norm and the LM head only for the positions the caller asks for.

``StaticKV`` holds each layer's keys and values in buffers of fixed capacity. A forward writes its
Q new entries at slots ``length .. length+Q`` and advances ``length``; the engine moves
``length`` back to drop rejected speculation (the slots are simply overwritten next time), so no
tensor changes shape from one step to the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache


class StaticKV:
    """Per-layer K/V buffers (B, H_kv, capacity, D) and the number of slots in use (shared by rows)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int):
        self.keys, self.values, self.length = keys, values, length

    @classmethod
    def from_cache(cls, cache: DynamicCache, capacity: int) -> StaticKV:
        """Copy a prefilled ``DynamicCache`` into buffers with room for ``capacity`` slots."""
        keys, values = [], []
        length = cache.get_seq_length()
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            batch, heads, _, dim = k.shape
            key_buffer = k.new_zeros(batch, heads, max(capacity, length), dim)
            value_buffer = v.new_zeros(batch, heads, max(capacity, length), dim)
            key_buffer[:, :, :length] = k
            value_buffer[:, :, :length] = v
            keys.append(key_buffer)
            values.append(value_buffer)
        return cls(keys, values, length)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` more entries (doubling; rare, so steps keep fixed shapes)."""
        needed = self.length + slots
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                grown = old.new_zeros(*old.shape[:2], new_capacity, old.shape[3])
                grown[:, :, : self.length] = old[:, :, : self.length]
                buffers[i] = grown

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (rows that finished leave the batch)."""
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]


@dataclass
class _Layer:
    input_norm: torch.Tensor
    q_weight: torch.Tensor
    q_bias: torch.Tensor | None
    k_weight: torch.Tensor
    k_bias: torch.Tensor | None
    v_weight: torch.Tensor
    v_bias: torch.Tensor | None
    o_weight: torch.Tensor
    post_norm: torch.Tensor
    gate_weight: torch.Tensor
    up_weight: torch.Tensor
    down_weight: torch.Tensor


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticQwen2Decoder:
    """The text decoder of a ``Qwen2ForCausalLM`` as one lean function over a ``StaticKV``."""

    SUPPORTED_ACTIVATIONS = ("silu",)

    def __init__(self, language_model: torch.nn.Module):
        config = language_model.config
        if getattr(config, "hidden_act", "silu") not in self.SUPPORTED_ACTIVATIONS:
            raise ValueError(f"static decoder supports {self.SUPPORTED_ACTIVATIONS}, got {config.hidden_act}")
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"static decoder supports default RoPE only, got {rope.get('rope_type')}")
        core = language_model.model
        self.embed = core.embed_tokens.weight
        self.final_norm = core.norm.weight
        self.lm_head = language_model.lm_head.weight
        self.eps = float(config.rms_norm_eps)
        self.n_heads = int(config.num_attention_heads)
        self.n_kv_heads = int(config.num_key_value_heads or self.n_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.n_heads)
        self.groups = self.n_heads // self.n_kv_heads
        self.scaling = self.head_dim**-0.5
        rotary = core.rotary_emb
        self.inv_freq = rotary.inv_freq
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.layers = [
            _Layer(
                layer.input_layernorm.weight,
                layer.self_attn.q_proj.weight, layer.self_attn.q_proj.bias,
                layer.self_attn.k_proj.weight, layer.self_attn.k_proj.bias,
                layer.self_attn.v_proj.weight, layer.self_attn.v_proj.bias,
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight,
            )
            for layer in core.layers
        ]

    def _rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None]
        return cos, sin

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, _, q_len, dim = q.shape
        if self.groups == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        if q_len == 1:  # pack the query heads of a KV group into the query axis
            packed = q.reshape(batch, self.n_kv_heads, self.groups, dim)
            out = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask.expand(-1, -1, self.groups, -1),
                                                 scale=self.scaling)
            return out.reshape(batch, self.n_heads, 1, dim)
        k = k[:, :, None].expand(-1, -1, self.groups, -1, -1).reshape(batch, self.n_heads, -1, dim)
        v = v[:, :, None].expand(-1, -1, self.groups, -1, -1).reshape(batch, self.n_heads, -1, dim)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                kv: StaticKV, logits_from: int = 0) -> torch.Tensor:
        """Logits (B, Q − logits_from, V) of Q new tokens; their K/V go to slots ``kv.length ..`` (advanced).

        ``attention_mask`` is (B, 1, Q, kv.length + Q) bool, True = attend.
        """
        q_len = input_ids.shape[1]
        kv.reserve(q_len)
        start, end = kv.length, kv.length + q_len

        def store(buffer: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            buffer[:, :, start:end] = new
            return buffer[:, :, :end]

        logits = self._decode(input_ids, position_ids, attention_mask, kv, store, logits_from)
        kv.length = end
        return logits

    def forward_fixed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                      kv: StaticKV, write_index: torch.Tensor, logits_from: int = 0) -> torch.Tensor:
        """The same step with shapes and addresses that do not change from step to step, so it can be
        captured in a CUDA graph or compiled once: K/V are written at ``write_index`` (a (Q,) device
        tensor, not a Python slice) and every query attends over the whole capacity under
        ``attention_mask`` (B, 1, Q, capacity). ``kv.length`` is the caller's to advance."""

        def store(buffer: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return buffer.index_copy_(2, write_index, new)

        return self._decode(input_ids, position_ids, attention_mask, kv, store, logits_from)

    def _decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                kv: StaticKV, store, logits_from: int) -> torch.Tensor:
        """The layers: ``store(buffer, new)`` writes a layer's new K or V and returns the keys to attend."""
        batch, q_len = input_ids.shape
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self._rotary(position_ids, hidden.dtype)
        for index, layer in enumerate(self.layers):
            residual = hidden
            x = _rms_norm(hidden, layer.input_norm, self.eps)
            q = F.linear(x, layer.q_weight, layer.q_bias).view(batch, q_len, self.n_heads, self.head_dim).transpose(1, 2)
            k = F.linear(x, layer.k_weight, layer.k_bias).view(batch, q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
            v = F.linear(x, layer.v_weight, layer.v_bias).view(batch, q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys = store(kv.keys[index], k)
            values = store(kv.values[index], v)
            attended = self._attend(q, keys, values, attention_mask)
            hidden = residual + F.linear(attended.transpose(1, 2).reshape(batch, q_len, -1), layer.o_weight)
            residual = hidden
            x = _rms_norm(hidden, layer.post_norm, self.eps)
            hidden = residual + F.linear(F.silu(F.linear(x, layer.gate_weight)) * F.linear(x, layer.up_weight),
                                         layer.down_weight)
        hidden = _rms_norm(hidden[:, logits_from:], self.final_norm, self.eps)
        return F.linear(hidden, self.lm_head)
