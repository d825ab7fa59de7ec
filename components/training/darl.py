"""DARL's online trajectory generation (OMTG) and trajectory preference optimization (DTPO).

A window of w slots follows the committed token c. The exact AR token x_{c+1} is what the last
committed position predicts; the candidates are the l_p tokens after it, read from a forward over
``[.. c, <INIT> x w]`` (its ``<INIT>`` outputs predict x_{c+2} ..): candidate 0 greedy, the rest
sampled at a temperature, duplicates redrawn a bounded number of times. Rewards, both in [0, 1]:

- r1: longest correct prefix of the candidate against the truth, / l_p;
- r2: rerun ``[.. c, x_{c+1}, candidate, <INIT> x l_n]`` (the prefix advanced by the ground-truth AR
  token, the context SDB's next step verifies in); longest correct prefix of the argmax of all w
  window outputs, / w.

Advantages are group-normalised over the K candidates of a sample; the policy term is
``-exp(logp - logp.detach()) * A`` over the credited tokens, / l_p and / K. No clipping, no KL:
the candidates come from the current policy, so the ratio is 1 in value and only its gradient
matters.

The defaults follow the authors' code (github SCUT-DLVCLab/DARL at 82548e9,
``trajectory_generator.py``, ``reward_calculator.py``, ``dar_trainer.py``), which the paper does
not contradict. Each older choice of ours stays a switch and an ablation row
(``benchmarks.darl_ablation``); why each default is what it is:

- ``policy_context: init`` (old: ``candidate``). DTPO's log-probs come from the sampling context
  ``[.. c, <INIT> ..]``, the drafter SDB's acceptance depends on. Read from the candidate's own
  window stream instead, a credited token's context is ground truth plus correct candidate tokens,
  so its log-prob *is* the AR log-prob: DTPO then trains the verifier, never the drafter.
- ``ar_slot: skip`` (old: ``score``). The AR token is exact whatever the drafts are, so it is never
  a candidate, never scored, never credited.
- ``lookahead_slots: window`` (old: ``init``). r2 advances the prefix by the ground-truth AR token
  and scores all w outputs / w, as the authors do; ``init`` scored only the ``<INIT>`` slots of a
  rerun without the advance, / l_n.
- ``credit: pickup`` (old: ``lcp_per_candidate``). The advantage is spread over every pickup token
  with one normaliser l_p for all candidates, so a token every candidate shares gets a net weight
  sum_k A_k / l_p = 0 (advantages sum to zero in a group). ``lcp`` credits each candidate's
  correct prefix and first error, also / l_p (zero-sum too); ``lcp_per_candidate`` divides by each
  candidate's own count, which leaves shared tokens a non-zero net weight.
- ``draft_alignment: own`` (the authors': ``left``) is where we depart. Their DAR input puts the
  draft of x_{c+2+k} at position c+1+k, one slot left of its own token, while their r2 (and SDB's
  verification, ours and theirs) puts it at its own position after the AR token. Our SDB is
  lossless only with drafts at their own positions, so DAR trains in the context SDB decodes in;
  ``left`` reproduces theirs.
- ``reward: lcp`` as in their ``reward_calculator.py``; ``edit`` (1 - normalised token edit
  distance) is the paper's ablation row. ``permute_advantages`` is a control: the same advantage
  magnitudes, shuffled within each group, so no signal.
"""

from __future__ import annotations

import torch
from rapidfuzz.distance import Levenshtein

CREDITS = ("pickup", "lcp", "lcp_per_candidate")


def lcp_length(predicted: torch.Tensor, truth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Length of the longest common prefix over the last dim (cumulative product of equality)."""
    equal = (predicted == truth) & valid
    return equal.long().cumprod(dim=-1).sum(dim=-1)


def lcp_fraction(predicted: torch.Tensor, truth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """LCP / number of valid positions (0 where there are none). ``valid`` must be a left prefix."""
    count = valid.sum(dim=-1)
    fraction = lcp_length(predicted, truth, valid).float() / count.clamp_min(1).float()
    return torch.where(count > 0, fraction, torch.zeros_like(fraction))


def edit_similarity(predicted: torch.Tensor, truth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """1 - normalised Levenshtein distance between the valid prefixes (0 where there are none)."""

    flat_p, flat_t = predicted.reshape(-1, predicted.shape[-1]).tolist(), truth.reshape(-1, truth.shape[-1]).tolist()
    counts = valid.reshape(-1, valid.shape[-1]).sum(dim=-1).tolist()
    scores = [Levenshtein.normalized_similarity(p[:n], t[:n]) if n else 0.0
              for p, t, n in zip(flat_p, flat_t, counts, strict=True)]
    return torch.tensor(scores, device=predicted.device).reshape(predicted.shape[:-1])


def immediate_reward(
    candidates: torch.Tensor, slot_truth: torch.Tensor, n_pickup: torch.Tensor, reward: str = "lcp"
) -> torch.Tensor:
    """r1 (B, K): each candidate's pickup tokens (B, K, w) against the truth of their slots (B, w)."""
    score = _score(reward)
    pickup = pickup_slots(n_pickup, candidates.shape[-1])[:, None, :].expand_as(candidates)
    return score(candidates, slot_truth[:, None, :].expand_as(candidates), pickup)


def lookahead_reward(
    predictions: torch.Tensor, truth: torch.Tensor, n_pickup: torch.Tensor, reward: str = "lcp", slots: str = "window"
) -> torch.Tensor:
    """r2 (B, K) from the rerun with each candidate in place.

    ``slots="window"`` (the authors'): ``predictions`` (B, K, w) are the argmax of the w window
    outputs, ``truth`` (B, w) the tokens they predict; LCP over all w, / w. ``slots="init"`` (our
    older choice): ``predictions`` are the slot predictions, ``truth`` the slot truth, and only the
    l_n ``<INIT>`` slots after the pickup part count, / l_n.
    """
    score = _score(reward)
    width = predictions.shape[-1]
    truth = truth[:, None, :].expand_as(predictions)
    if slots == "window":
        return score(predictions, truth, torch.ones_like(predictions, dtype=torch.bool))
    if slots != "init":
        raise ValueError(f"unknown look-ahead slots {slots!r}; choose window or init")
    positions = torch.arange(width, device=predictions.device)
    order = (positions[None, :] + n_pickup[:, None]).clamp_max(width - 1)[:, None, :].expand_as(predictions)
    new_slots = (positions[None, :] < (width - n_pickup)[:, None])[:, None, :].expand_as(predictions)
    return score(predictions.gather(-1, order), truth.gather(-1, order), new_slots)


def _score(reward: str):
    if reward not in ("lcp", "edit"):
        raise ValueError(f"unknown DARL reward {reward!r}; choose lcp or edit")
    return lcp_fraction if reward == "lcp" else edit_similarity


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(R - mean) / (std + eps) within each sample's group of K candidates (unbiased std)."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True)
    return (rewards - mean) / (std + eps)


def permuted_advantages(advantages: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The control row: each group's advantages shuffled among its candidates (no signal left)."""
    order = torch.rand(advantages.shape, generator=generator).argsort(dim=-1).to(advantages.device)
    return advantages.gather(-1, order)


def pickup_slots(n_pickup: torch.Tensor, width: int) -> torch.Tensor:
    """(B, w) bool: the first l_p slots of each sample's window."""
    return torch.arange(width, device=n_pickup.device)[None, :] < n_pickup[:, None]


def credit_weights(candidates: torch.Tensor, slot_truth: torch.Tensor, n_pickup: torch.Tensor, credit: str) -> torch.Tensor:
    """(B, K, w) the weight of each candidate token in DTPO's per-candidate average.

    ``pickup`` (the authors'): 1 / l_p on every pickup token. ``lcp``: 1 / l_p on the candidate's
    correct prefix and its first wrong token (what SDB's acceptance depends on), nothing after it.
    ``lcp_per_candidate``: the same tokens / their own count, so a token all candidates share gets
    a net weight sum_k A_k / n_k that is not zero.
    """
    if credit not in CREDITS:
        raise ValueError(f"unknown DTPO credit {credit!r}; choose one of {', '.join(CREDITS)}")
    pickup = pickup_slots(n_pickup, candidates.shape[-1])[:, None, :].expand_as(candidates)
    if credit == "pickup":
        tokens = pickup
    else:
        correct = lcp_length(candidates, slot_truth[:, None, :].expand_as(candidates), pickup)  # (B, K)
        slots = torch.arange(candidates.shape[-1], device=candidates.device)
        tokens = pickup & (slots[None, None, :] <= correct[..., None])
    tokens = tokens.float()
    if credit == "lcp_per_candidate":
        return tokens / tokens.sum(dim=-1, keepdim=True).clamp_min(1)
    return tokens / n_pickup.clamp_min(1).float()[:, None, None]


def net_slot_weight(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B, w) the advantage a slot receives summed over candidates, / K: what DTPO pushes a token
    up (> 0) or down (< 0) by when every candidate holds the same token there."""
    return (advantages[..., None] * weights).sum(dim=1) / weights.shape[1]


def dtpo_loss(token_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-sample DTPO term from (B, K, w) candidate-token log-probs and :func:`credit_weights`
    (0 for samples without pickup tokens).

    Samples without credited tokens still flow through the graph (times 0), so every rank runs the
    same backward and data-parallel gradients stay in sync.
    """
    ratio = torch.exp(token_logp - token_logp.detach())
    per_candidate = (-ratio * advantages[..., None] * weights).sum(dim=-1)
    return per_candidate.sum(dim=-1) / token_logp.shape[1]


def sample_candidates(
    logits: torch.Tensor,
    n_pickup: torch.Tensor,
    n_candidates: int,
    temperature: float,
    fill_id: int,
    max_retries: int = 20,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, K, w) candidates from slot logits (B, w, V): candidate 0 greedy, others sampled at
    ``temperature`` and redrawn while they duplicate an earlier one (at most ``max_retries``
    redraws per sample, then duplicates are kept). Slots past l_p hold ``fill_id``."""
    logits = logits.detach().float()
    batch, width, _ = logits.shape
    greedy = logits.argmax(dim=-1)
    probs = (logits / temperature).softmax(dim=-1).cpu()
    out = torch.full((batch, n_candidates, width), fill_id, dtype=torch.long)
    pickups = n_pickup.tolist()
    for b in range(batch):
        n = pickups[b]
        if n == 0:
            continue
        chosen = [greedy[b, :n].cpu()]
        retries = 0
        while len(chosen) < n_candidates:
            draw = torch.multinomial(probs[b, :n], 1, generator=generator).squeeze(-1)
            duplicate = any(torch.equal(draw, c) for c in chosen)
            if not duplicate or retries >= max_retries:
                chosen.append(draw)
            else:
                retries += 1
        out[b, :, :n] = torch.stack(chosen)
    return out.to(logits.device)
