"""Choosing tokens from logits, with the confidence every decoder and monitor reports."""

from __future__ import annotations

import torch

from components.decoding.types import DecodeParams


def choose_tokens(
    logits: torch.Tensor, params: DecodeParams, generator: torch.Generator | None, banned: torch.Tensor | None = None
) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` (S, V); confidence = its probability.

    Greedy takes the argmax of the raw logits (so ties break exactly as AR does); sampling
    uses temperature and optional top-k. ``banned`` ids (<pad>, <bos>, <INIT>, <MASK>) are never
    produced: they are inputs, not outputs.
    """
    scores = logits.float()
    if banned is not None and banned.numel():
        scores = scores.index_fill(-1, banned.to(scores.device), float("-inf"))
    if params.greedy:
        tokens = scores.argmax(dim=-1)
        probs = torch.softmax(scores, dim=-1)
    else:
        scaled = scores / params.temperature
        if params.top_k:
            kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    confidences = probs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), confidences.tolist()


def choose_rows(
    logits: torch.Tensor, params: DecodeParams, generators: list[torch.Generator | None], banned: torch.Tensor | None = None
) -> list[tuple[list[int], list[float]]]:
    """:func:`choose_tokens` for every row of a forward's logits (B, Q, V), where they are.

    Greedy decoding picks and scores on the logits' device and moves only (B, Q) tokens and
    confidences to the host: one transfer per step, the accept decision's, instead of the whole
    (B, Q, V) logits (155 MB a step for a batch of 8 x 32 slots of a 151k vocabulary). Sampling
    draws with each row's own CPU generator, row by row, exactly as before.
    """
    if not params.greedy:
        return [choose_tokens(logits[i].float().cpu(), params, generators[i], banned) for i in range(logits.shape[0])]
    scores = logits.float()
    if banned is not None and banned.numel():
        scores = scores.index_fill(-1, banned.to(scores.device), float("-inf"))
    tokens = scores.argmax(dim=-1)
    confidences = torch.softmax(scores, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    # token ids are exact in float32 (< 2**24): one transfer carries both
    both = torch.stack([tokens.to(torch.float32), confidences]).cpu()
    return [(both[0, i].long().tolist(), both[1, i].tolist()) for i in range(logits.shape[0])]
