"""Choosing tokens from logits, with the confidence every decoder and monitor reports."""

from __future__ import annotations

import torch

from components.decoding.types import DecodeParams


def _scores(logits: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    scores = logits.float()
    if banned is not None and banned.numel():
        scores = scores.index_fill(-1, banned.to(scores.device), float("-inf"))
    return scores


def _pick(scores: torch.Tensor, params: DecodeParams, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their probabilities for scores of any leading shape (..., V), where they are."""
    if params.greedy:
        tokens = scores.argmax(dim=-1)
        probs = torch.softmax(scores, dim=-1)
    else:
        scaled = scores / params.temperature
        if params.top_k:
            kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        flat = probs.reshape(-1, probs.shape[-1])
        tokens = torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
    return tokens, probs.gather(-1, tokens[..., None]).squeeze(-1)


def choose_tokens(
    logits: torch.Tensor, params: DecodeParams, generator: torch.Generator | None, banned: torch.Tensor | None = None
) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` (S, V); confidence = its probability.

    Greedy takes the argmax of the raw logits (so ties break exactly as AR does); sampling
    uses temperature and optional top-k. ``banned`` ids (<pad>, <bos>, <INIT>, <MASK>) are never
    produced: they are inputs, not outputs.
    """
    tokens, confidences = _pick(_scores(logits, banned), params, generator)
    return tokens.tolist(), confidences.tolist()


def choose_rows(
    logits: torch.Tensor, params: DecodeParams, generators: list[torch.Generator | None], banned: torch.Tensor | None = None
) -> list[tuple[list[int], list[float]]]:
    """:func:`choose_tokens` for every row of a forward's logits (B, Q, V), where they are.

    Greedy decoding, and sampling without a seed, pick and score on the logits' device and move
    only (B, Q) tokens and confidences to the host: one transfer per step, the accept decision's,
    instead of the whole (B, Q, V) logits (155 MB a step for a batch of 8 x 32 slots of a 151k
    vocabulary). Seeded sampling draws with each row's own CPU generator, row by row, so a row's
    draws do not depend on the batch it is in.
    """
    if not params.greedy and any(generator is not None for generator in generators):
        return [choose_tokens(logits[i].float().cpu(), params, generators[i], banned) for i in range(logits.shape[0])]
    tokens, confidences = _pick(_scores(logits, banned), params, None)
    # token ids are exact in float32 (< 2**24): one transfer carries both
    both = torch.stack([tokens.to(torch.float32), confidences]).cpu()
    return [(both[0, i].long().tolist(), both[1, i].tolist()) for i in range(logits.shape[0])]
