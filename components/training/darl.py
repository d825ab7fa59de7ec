"""DARL's online trajectory generation (OMTG) and trajectory preference optimization (DTPO).

For each sample the window after the committed token c is split into l_p pickup slots and
l_n >= 1 ``<INIT>`` slots. OMTG takes the logits that predict the pickup slots from a forward
over ``[.. c, <INIT> x w]`` and draws K candidates: candidate 0 greedy, the rest sampled at a
temperature, duplicates redrawn a bounded number of times. Rewards, both fractions in [0, 1]:

- r1: longest correct prefix of the candidate against the truth, / l_p;
- r2: rerun ``[.. c, candidate, <INIT> x l_n]``; longest correct prefix of its argmax
  predictions for the l_n ``<INIT>`` slots (what SDB would accept next), / l_n.

Advantages are group-normalised over the K candidates of a sample; the policy term is
``-exp(logp - logp.detach()) * A`` averaged over the credited tokens and divided by K. No
clipping, no KL: the candidates come from the current policy, so the ratio is 1 in value and
only its gradient matters.

Where our defaults depart from the authors' code (github SCUT-DLVCLab/DARL, ``dar_trainer.py``),
and why (both are config switches, ``darl.policy_context`` and ``darl.credit``, so the ablation
can compare them):

- **Policy context.** Their DTPO log-probs come from a forward over ``[.. c, <INIT> x l_p]``, the
  context the candidates were sampled from. SDB at inference never decodes from that context
  after its first step: each forward refines the previous step's drafts, i.e. it reads
  ``[.. c, d_1 .. d_w]`` and its slot j predicts from the drafts before it. We take candidate
  k's log-probs from its own window stream (``[.. c, candidate k]``, already in the main forward
  for the look-ahead reward), the distribution SDB's verification actually consumes
  (``policy_context: candidate``; ``init`` is the authors' choice).
- **Credit.** Their advantage is spread over every pickup token. SDB accepts a window up to its
  first wrong token, so tokens after it change nothing that is rewarded; ``credit: lcp`` gives the
  advantage to the accepted prefix and the first error only (``pickup`` is the authors' choice).
- **Reward.** r1/r2 are LCP fractions as in their ``reward_calculator.py``; ``reward: edit``
  (1 - normalised token edit distance) is the paper's ablation row.
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


def edit_similarity(predicted: torch.Tensor, truth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """1 - normalised Levenshtein distance between the valid prefixes (0 where there are none)."""
    from rapidfuzz.distance import Levenshtein

    flat_p, flat_t = predicted.reshape(-1, predicted.shape[-1]).tolist(), truth.reshape(-1, truth.shape[-1]).tolist()
    counts = valid.reshape(-1, valid.shape[-1]).sum(dim=-1).tolist()
    scores = [Levenshtein.normalized_similarity(p[:n], t[:n]) if n else 0.0
              for p, t, n in zip(flat_p, flat_t, counts, strict=True)]
    return torch.tensor(scores, device=predicted.device).reshape(predicted.shape[:-1])


def darl_rewards(
    candidates: torch.Tensor, rerun_predictions: torch.Tensor, slot_truth: torch.Tensor, n_pickup: torch.Tensor,
    reward: str = "lcp",
) -> tuple[torch.Tensor, torch.Tensor]:
    """r1, r2 (B, K).

    ``candidates`` (B, K, w): pickup tokens in the first l_p slots. ``rerun_predictions`` (B, K, w):
    argmax predictions of every slot's token from the rerun with candidate k in place.
    ``slot_truth`` (B, w): the true token of each slot. ``reward``: ``lcp`` (the paper's) or ``edit``.
    """
    score = {"lcp": lcp_fraction, "edit": edit_similarity}[reward]
    width = candidates.shape[-1]
    slots = torch.arange(width, device=candidates.device)
    truth = slot_truth[:, None, :].expand_as(candidates)
    pickup = pickup_slots(n_pickup, width)[:, None, :].expand_as(candidates)
    r1 = score(candidates, truth, pickup)
    # r2 looks at the l_n <INIT> slots only: shift them to the front so the LCP starts there.
    order = (slots[None, :] + n_pickup[:, None]).clamp_max(width - 1)  # (B, w)
    take = order[:, None, :].expand_as(candidates)
    new_slots = (slots[None, :] < (width - n_pickup)[:, None])[:, None, :].expand_as(candidates)
    r2 = score(rerun_predictions.gather(-1, take), truth.gather(-1, take), new_slots)
    return r1, r2


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(R - mean) / (std + eps) within each sample's group of K candidates (unbiased std)."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True)
    return (rewards - mean) / (std + eps)


def pickup_slots(n_pickup: torch.Tensor, width: int) -> torch.Tensor:
    """(B, w) bool: the first l_p slots of each sample's window."""
    return torch.arange(width, device=n_pickup.device)[None, :] < n_pickup[:, None]


def credited_tokens(candidates: torch.Tensor, slot_truth: torch.Tensor, n_pickup: torch.Tensor, credit: str) -> torch.Tensor:
    """(B, K, w) float: which candidate tokens DTPO's advantage applies to.

    ``pickup``: every pickup token. ``lcp``: the candidate's correct prefix and its first wrong
    token (what SDB's acceptance depends on); nothing after it.
    """
    pickup = pickup_slots(n_pickup, candidates.shape[-1])[:, None, :].expand_as(candidates)
    if credit == "pickup":
        return pickup.float()
    if credit != "lcp":
        raise ValueError(f"unknown DTPO credit {credit!r}; choose pickup or lcp")
    correct = lcp_length(candidates, slot_truth[:, None, :].expand_as(candidates), pickup)  # (B, K)
    slots = torch.arange(candidates.shape[-1], device=candidates.device)
    return (pickup & (slots[None, None, :] <= correct[..., None])).float()


def dtpo_loss(token_logp: torch.Tensor, advantages: torch.Tensor, credited: torch.Tensor) -> torch.Tensor:
    """Per-sample DTPO term from (B, K, w) candidate-token log-probs, averaged over each
    candidate's ``credited`` tokens (:func:`credited_tokens`); 0 for samples without any.

    Samples without credited tokens still flow through the graph (times 0), so every rank runs the
    same backward and data-parallel gradients stay in sync.
    """
    ratio = torch.exp(token_logp - token_logp.detach())
    per_token = -ratio * advantages[..., None]
    per_candidate = (per_token * credited).sum(dim=-1) / credited.sum(dim=-1).clamp_min(1)
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
