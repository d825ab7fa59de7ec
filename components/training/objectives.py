"""The training objectives as plain tensor functions (per-sample losses), each unit-tested.

All of them share one output convention: the output at input position i predicts token i+1.
A batch is ``tokens`` (B, T) = ``<bos> markup <eos>`` padded, with ``lengths`` (B,) real tokens
and ``ends_with_eos`` (B,) (False when the page was truncated). Beyond the end of a finished
sequence the truth is ``<eos>`` (DARL pads its windows that way); beyond a truncated one it is
unknown and ignored.

- :func:`ar_loss`: next-token CE on the clean sequence.
- DAR (:func:`dar_loss`): gt prefix up to the committed token c, then a window of w slots whose
  first l_p hold drafts and the rest ``<INIT>``; CE from the sequence start through the window.
- MinerU-Diffusion (:func:`mineru_noisy_block`, :func:`masked_diffusion_loss`): random masks
  inside blocks of L (never the block's first input), bidirectional; loss where the target is
  masked or lies past the block.
- PA-BDM (:func:`pabdm_noisy_block`, :func:`csl_gate`): a right-side masked suffix per block,
  causal; the Confidence-gated Structural Loss supervises each block's targets left to right up
  to (and including) the first one whose gold probability falls below tau.
- Stage 2 (:func:`consistency_weights`): loss x (1 + beta (1 - C(x))).

DARL's OMTG sampling, rewards and DTPO live in :mod:`components.training.darl`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100


# ----- shared helpers ----------------------------------------------------------------------
CE_CHUNK_POSITIONS = 1024  # positions whose fp32 logits exist at once in token_ce


def _chunk_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="none")


def token_ce(logits: torch.Tensor, targets: torch.Tensor, chunk: int = CE_CHUNK_POSITIONS) -> torch.Tensor:
    """Per-position CE (B, n) in fp32 without an fp32 copy of all logits.

    With a 152k vocabulary and several streams per page, fp32 logits of a whole batch are the
    largest tensor of a step (8 x 4096 positions x 152k x 4 B = 20 GB). Here at most ``chunk``
    positions are upcast at a time, and each chunk is recomputed in the backward pass
    (activation checkpointing) instead of keeping its fp32 log-softmax, so what stays alive is
    the model-dtype logits plus one chunk.
    """
    batch, n, vocab = logits.shape
    flat, flat_targets = logits.reshape(batch * n, vocab), targets.reshape(batch * n)
    if flat.shape[0] <= chunk:
        return _chunk_ce(flat, flat_targets).reshape(batch, n)

    parts = [checkpoint(_chunk_ce, flat[start : start + chunk], flat_targets[start : start + chunk], use_reentrant=False)
             if flat.requires_grad else _chunk_ce(flat[start : start + chunk], flat_targets[start : start + chunk])
             for start in range(0, flat.shape[0], chunk)]
    return torch.cat(parts).reshape(batch, n)


def weighted_token_ce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-sample weighted mean CE over positions; a sample with zero total weight scores 0.

    ``logits`` (B, n, V), ``targets`` (B, n) with ``IGNORE`` allowed where weight is 0.
    """
    ce = token_ce(logits, targets.clamp_min(0))
    weights = weights.to(ce.dtype) * (targets != IGNORE)
    total = weights.sum(dim=1)
    return torch.where(total > 0, (ce * weights).sum(dim=1) / total.clamp_min(1e-12), ce.new_zeros(()))


def extended_targets(
    tokens: torch.Tensor, lengths: torch.Tensor, ends_with_eos: torch.Tensor, eos_id: int, total: int
) -> torch.Tensor:
    """(B, total) truth per token index: the tokens, then ``<eos>`` (finished) or IGNORE (truncated)."""
    batch, n_tokens = tokens.shape
    index = torch.arange(total, device=tokens.device)[None, :]
    padded = torch.full((batch, total), IGNORE, dtype=tokens.dtype, device=tokens.device)
    width = min(total, n_tokens)
    padded[:, :width] = tokens[:, :width]
    beyond = torch.where(ends_with_eos, eos_id, IGNORE).to(tokens.dtype)[:, None]
    return torch.where(index < lengths[:, None], padded, beyond.expand(batch, total))


def gather_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values (B, T, ...) at per-sample indices (B, n) -> (B, n, ...)."""
    if values.dim() == 2:
        return values.gather(1, index)
    expanded = index[(...,) + (None,) * (values.dim() - 2)].expand(*index.shape, *values.shape[2:])
    return values.gather(1, expanded)


# ----- AR ------------------------------------------------------------------------------------
def ar_loss(clean_logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-sample next-token CE: outputs 0..len-2 predict tokens 1..len-1."""
    targets = tokens[:, 1:]
    valid = torch.arange(1, tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]
    return weighted_token_ce(clean_logits[:, :-1], torch.where(valid, targets, IGNORE), valid.float())


# ----- DAR (DARL window) --------------------------------------------------------------------
@dataclass
class WindowPlan:
    """Where each sample's window sits: committed token at clean index ``offsets``, then
    ``n_pickup`` draft slots (l_p) and ``window - n_pickup`` ``<INIT>`` slots (l_n >= 1)."""

    offsets: torch.Tensor  # (B,)
    n_pickup: torch.Tensor  # (B,)
    window: int

    @property
    def n_new(self) -> torch.Tensor:
        return self.window - self.n_pickup

    def slot_index(self) -> torch.Tensor:
        """(B, w) token index of each slot."""
        slots = torch.arange(self.window, device=self.offsets.device)
        return self.offsets[:, None] + 1 + slots[None, :]

    def pickup_mask(self) -> torch.Tensor:
        slots = torch.arange(self.window, device=self.offsets.device)
        return slots[None, :] < self.n_pickup[:, None]


def sample_window_plan(lengths: torch.Tensor, window: int, generator: torch.Generator | None = None) -> WindowPlan:
    """Offset uniform over the committed tokens before ``<eos>``; l_n uniform in [1, w]."""
    cpu_lengths = lengths.detach().cpu()
    high = (cpu_lengths - 1).clamp_min(1).float()  # offsets 0 .. len-2
    offsets = (torch.rand(len(cpu_lengths), generator=generator) * high).long()
    n_new = torch.randint(1, window + 1, (len(cpu_lengths),), generator=generator)
    return WindowPlan(offsets=offsets.to(lengths.device), n_pickup=(window - n_new).to(lengths.device), window=window)


def window_inputs(plan: WindowPlan, drafts: torch.Tensor, init_id: int) -> torch.Tensor:
    """(B, w) slot inputs: drafts in the first l_p slots, ``<INIT>`` after."""
    return torch.where(plan.pickup_mask(), drafts, torch.full_like(drafts, init_id))


def slot_logits(clean_logits: torch.Tensor, window_logits: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
    """(B, w, V) the logits that predict each slot's token: slot 0 from the committed token's
    output, slot j from the output of slot j-1 (the AR shift)."""
    at_committed = gather_rows(clean_logits, plan.offsets[:, None])
    return torch.cat([at_committed, window_logits[:, :-1]], dim=1)


def corrupt_drafts(
    truth: torch.Tensor, prob: float, draft_ids: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Ground truth with each token replaced, with probability ``prob``, by a random one of
    ``draft_ids`` (the model's content tokens, :meth:`TrainableMarkupLM.draft_token_ids`)."""
    noise = torch.rand(truth.shape, generator=generator).to(truth.device) < prob
    picks = torch.randint(0, len(draft_ids), truth.shape, generator=generator).to(draft_ids.device)
    return torch.where(noise, draft_ids[picks].to(truth.device), truth.clamp_min(0))


def dar_loss(
    clean_logits: torch.Tensor, window_logits: torch.Tensor, targets: torch.Tensor, plan: WindowPlan
) -> torch.Tensor:
    """Per-sample CE of reconstructing the truth from the sequence start through the window.

    ``targets`` = :func:`extended_targets` long enough for index ``offsets + w + 1``. Clean outputs
    0..c predict tokens 1..c+1; window slot j's output predicts token c+2+j.
    """
    n_clean = clean_logits.shape[1]
    clean_index = torch.arange(n_clean, device=targets.device)[None, :]
    clean_targets = targets[:, 1 : n_clean + 1]
    clean_weight = (clean_index <= plan.offsets[:, None]).float()
    window_targets = gather_rows(targets, plan.slot_index() + 1)
    logits = torch.cat([clean_logits, window_logits], dim=1)
    all_targets = torch.cat([torch.where(clean_weight > 0, clean_targets, IGNORE), window_targets], dim=1)
    weights = torch.cat([clean_weight, torch.ones_like(window_targets, dtype=torch.float)], dim=1)
    return weighted_token_ce(logits, all_targets, weights)


# ----- block diffusion (MinerU-Diffusion, PA-BDM) -----------------------------------------
@dataclass
class NoisyBlocks:
    """One noisy copy of the sequence: inputs, the target of every output, where loss applies."""

    input_ids: torch.Tensor  # (B, n) n = blocks * L
    targets: torch.Tensor  # (B, n): token j+1's truth (IGNORE where unknown)
    loss_mask: torch.Tensor  # (B, n) bool
    block_length: int


def block_truth(
    tokens: torch.Tensor, lengths: torch.Tensor, ends_with_eos: torch.Tensor, eos_id: int, block_length: int
) -> torch.Tensor:
    """(B, n+1) truth over whole blocks: finished sequences are padded with ``<eos>`` to the end of
    the block holding their ``<eos>`` (plus the next block's first token), IGNORE after."""
    n = -(-tokens.shape[1] // block_length) * block_length
    truth = extended_targets(tokens, lengths, ends_with_eos, eos_id, n + 1)
    last_block_end = -(-lengths // block_length) * block_length + 1  # exclusive; +1 = next block start
    index = torch.arange(n + 1, device=tokens.device)[None, :]
    return torch.where(index < last_block_end[:, None], truth, IGNORE)


def _noisy_blocks(truth: torch.Tensor, masked: torch.Tensor, block_length: int, mask_id: int) -> NoisyBlocks:
    """Inputs with ``masked`` positions (and unknown ones) as ``<MASK>``; loss where the target is
    masked inside the block, or is the next block's first token."""
    inputs_truth = truth[:, :-1]
    n = inputs_truth.shape[1]
    unknown = inputs_truth == IGNORE
    input_ids = torch.where(masked | unknown, torch.full_like(inputs_truth, mask_id), inputs_truth)
    index = torch.arange(n, device=truth.device)
    is_block_end = (index % block_length) == block_length - 1
    next_masked = torch.cat([masked[:, 1:], torch.zeros_like(masked[:, :1])], dim=1)
    targets = truth[:, 1:]
    loss_mask = (next_masked | is_block_end[None, :]) & (targets != IGNORE)
    return NoisyBlocks(input_ids=input_ids, targets=targets, loss_mask=loss_mask, block_length=block_length)


def mineru_noisy_block(
    truth: torch.Tensor, block_length: int, mask_id: int, generator: torch.Generator | None = None
) -> NoisyBlocks:
    """Masked-diffusion corruption: per (sample, block) a ratio t ~ U(0, 1), each input after the
    block's first masked with probability t."""
    batch, n = truth.shape[0], truth.shape[1] - 1
    n_blocks = n // block_length
    ratio = torch.rand(batch, n_blocks, 1, generator=generator)
    draws = torch.rand(batch, n_blocks, block_length, generator=generator)
    masked = draws < ratio
    masked[:, :, 0] = False  # the block's first input is the committed token c
    return _noisy_blocks(truth, masked.reshape(batch, n).to(truth.device), block_length, mask_id)


def pabdm_noisy_block(
    truth: torch.Tensor, block_length: int, mask_id: int, generator: torch.Generator | None = None
) -> NoisyBlocks:
    """PA-BDM corruption: per (sample, block) a cut m ~ U{1..L-1}; inputs s+m .. s+L-1 masked."""
    batch, n = truth.shape[0], truth.shape[1] - 1
    n_blocks = n // block_length
    cut = torch.randint(1, block_length, (batch, n_blocks, 1), generator=generator)
    masked = torch.arange(block_length)[None, None, :] >= cut
    return _noisy_blocks(truth, masked.reshape(batch, n).to(truth.device), block_length, mask_id)


def masked_diffusion_loss(logits: torch.Tensor, blocks: NoisyBlocks) -> torch.Tensor:
    """Per-sample mean CE over the noisy outputs whose target is unknown to the block."""
    return weighted_token_ce(logits, torch.where(blocks.loss_mask, blocks.targets, IGNORE), blocks.loss_mask.float())


def gold_probability(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """P(gold) per position, detached (IGNORE targets give 0)."""
    with torch.no_grad():
        probs = logits.float().softmax(dim=-1)
        return probs.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1) * (targets != IGNORE)


def csl_gate(gold_prob: torch.Tensor, loss_mask: torch.Tensor, block_length: int, tau: float) -> torch.Tensor:
    """Confidence gate: inside each block, supervise loss positions left to right up to and
    including the first whose gold probability is below ``tau``; later ones get weight 0.

    The first unconfident target stays supervised so a fresh model still learns (at start every
    confidence is low and the gate opens one target per block).
    """
    batch, n = loss_mask.shape
    failing = (loss_mask & (gold_prob < tau)).reshape(batch, n // block_length, block_length).long()
    failures_before = failing.cumsum(dim=-1) - failing
    return loss_mask & (failures_before == 0).reshape(batch, n)


def pabdm_csl_loss(logits: torch.Tensor, blocks: NoisyBlocks, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample CSL loss and the fraction of loss positions the gate kept (for logging)."""
    gate = csl_gate(gold_probability(logits, blocks.targets), blocks.loss_mask, blocks.block_length, tau)
    loss = weighted_token_ce(logits, torch.where(gate, blocks.targets, IGNORE), gate.float())
    kept = gate.sum(dim=1).float() / blocks.loss_mask.sum(dim=1).clamp_min(1).float()
    return loss, kept


# ----- Stage 2 ------------------------------------------------------------------------------
def consistency_weights(consistency: torch.Tensor, beta: float) -> torch.Tensor:
    """Sample weights 1 + beta (1 - C(x)); NaN (no score, e.g. a Stage-1 page) gives weight 1."""
    known = ~torch.isnan(consistency)
    if known.any() and ((consistency[known] < 0) | (consistency[known] > 1)).any():
        raise ValueError(f"consistency scores must lie in [0, 1], got {consistency[known].tolist()}")
    return torch.where(known, 1.0 + beta * (1.0 - consistency), torch.ones_like(consistency))
