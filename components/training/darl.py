"""DARL's online trajectory generation (OMTG) and trajectory preference optimization (DTPO).

For each sample the window after the committed token c is split into l_p pickup slots and
l_n >= 1 ``<INIT>`` slots. OMTG takes the logits that predict the pickup slots from a forward
over ``[.. c, <INIT> x w]`` and draws K candidates: candidate 0 greedy, the rest sampled at a
temperature, duplicates redrawn a bounded number of times. Rewards, both fractions in [0, 1]:

- r1: longest correct prefix of the candidate against the truth, / l_p;
- r2: rerun ``[.. c, candidate, <INIT> x l_n]``; longest correct prefix of its argmax
  predictions for the l_n ``<INIT>`` slots (what SDB would accept next), / l_n.

Advantages are group-normalised over the K candidates of a sample; the policy term is
``-exp(logp - logp.detach()) * A`` averaged over the pickup tokens and divided by K. No
clipping, no KL: the candidates come from the current policy, so the ratio is 1 in value and
only its gradient matters.
"""

from __future__ import annotations

import torch


def lcp_length(predicted: torch.Tensor, truth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Length of the longest common prefix over the last dim (cumulative product of equality)."""
    equal = (predicted == truth) & valid
    return equal.long().cumprod(dim=-1).sum(dim=-1)


def lcp_fraction(predicted: torch.Tensor, truth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """LCP / number of valid positions (0 where there are none). ``valid`` must be a left prefix."""
    count = valid.sum(dim=-1)
    fraction = lcp_length(predicted, truth, valid).float() / count.clamp_min(1).float()
    return torch.where(count > 0, fraction, torch.zeros_like(fraction))


def darl_rewards(
    candidates: torch.Tensor, rerun_predictions: torch.Tensor, slot_truth: torch.Tensor, n_pickup: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """r1, r2 (B, K).

    ``candidates`` (B, K, w): pickup tokens in the first l_p slots. ``rerun_predictions`` (B, K, w):
    argmax predictions of every slot's token from the rerun with candidate k in place.
    ``slot_truth`` (B, w): the true token of each slot.
    """
    width = candidates.shape[-1]
    slots = torch.arange(width, device=candidates.device)
    truth = slot_truth[:, None, :].expand_as(candidates)
    pickup = (slots[None, :] < n_pickup[:, None])[:, None, :].expand_as(candidates)
    r1 = lcp_fraction(candidates, truth, pickup)
    # r2 looks at the l_n <INIT> slots only: shift them to the front so the LCP starts there.
    order = (slots[None, :] + n_pickup[:, None]).clamp_max(width - 1)  # (B, w)
    take = order[:, None, :].expand_as(candidates)
    new_slots = (slots[None, :] < (width - n_pickup)[:, None])[:, None, :].expand_as(candidates)
    r2 = lcp_fraction(rerun_predictions.gather(-1, take), truth.gather(-1, take), new_slots)
    return r1, r2


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(R - mean) / (std + eps) within each sample's group of K candidates (unbiased std)."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True)
    return (rewards - mean) / (std + eps)


def dtpo_loss(token_logp: torch.Tensor, advantages: torch.Tensor, n_pickup: torch.Tensor) -> torch.Tensor:
    """Per-sample DTPO term from (B, K, w) candidate-token log-probs; 0 for samples without pickup.

    Samples without pickup slots still flow through the graph (times 0), so every rank runs the
    same backward and data-parallel gradients stay in sync.
    """
    width = token_logp.shape[-1]
    pickup = (torch.arange(width, device=token_logp.device)[None, :] < n_pickup[:, None]).float()  # (B, w)
    ratio = torch.exp(token_logp - token_logp.detach())
    per_token = -ratio * advantages[..., None]
    per_candidate = (per_token * pickup[:, None, :]).sum(dim=-1) / pickup.sum(dim=-1).clamp_min(1)[:, None]
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
