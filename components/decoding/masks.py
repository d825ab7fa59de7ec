"""Explicit boolean attention masks (True = may attend) shared by training and decoding.

Every objective and decoder in this project uses one token convention: the output at input
position ``i`` predicts token ``i + 1`` (the AR shift), so one set of weights can serve AR,
sliding-window (DARL), block-diffusion (MinerU) and prefix-commitment (PA-BDM) decoding. What
differs is who may see whom, and that lives here, once, so a training mask and the decoding
mask it must match are built by the same code.

Shapes: 2-D masks are (Q, K); the model wants (B, 1, Q, K), see :func:`expand`.
"""

from __future__ import annotations

import torch

Pattern = str  # "causal" | "bidirectional"
PATTERNS = ("causal", "bidirectional")


def causal(length: int, device: torch.device | None = None) -> torch.Tensor:
    """Lower-triangular (length, length): position i sees 0..i."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def segment(length: int, pattern: Pattern, device: torch.device | None = None) -> torch.Tensor:
    """Attention inside one segment: causal, or every position sees every other."""
    if pattern == "causal":
        return causal(length, device)
    if pattern == "bidirectional":
        return torch.ones(length, length, dtype=torch.bool, device=device)
    raise ValueError(f"unknown attention pattern {pattern!r}; expected one of {PATTERNS}")


def block_causal(length: int, block_length: int, device: torch.device | None = None) -> torch.Tensor:
    """Lower-triangular over blocks, full inside a block (MinerU-Diffusion's mask)."""
    if block_length <= 0:
        raise ValueError("block_length must be positive")
    block_id = torch.arange(length, device=device) // block_length
    return block_id[:, None] >= block_id[None, :]


def sliding_window_causal(length: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """Causal, but each position sees at most ``window`` positions back (itself included)."""
    if window <= 0:
        raise ValueError("window must be positive")
    idx = torch.arange(length, device=device)
    distance = idx[:, None] - idx[None, :]
    return (distance >= 0) & (distance < window)


def decode_step(
    slot_valid: torch.Tensor, stored_valid: torch.Tensor, draft_length: int, draft_pattern: Pattern = "causal"
) -> torch.Tensor:
    """The (B, 1, Q, K) mask of one decoding forward.

    A forward appends, per row, committed tokens to store (``stored``, attended causally, as AR
    would) and then a speculative segment of ``draft_length`` tokens that sees the whole cache,
    the stored tokens, and itself with ``draft_pattern``. Rows of a batch accept different
    lengths, so two kinds of holes exist: ``slot_valid`` (B, K_past) marks which cached slots hold
    committed tokens of that row (rejected slots stay in the shared cache, unseen), and
    ``stored_valid`` (B, Q_stored) marks the left padding of rows with fewer tokens to store.
    Padding queries still see the image prefix, so no softmax row is empty (that would be NaN).
    """
    batch, past = slot_valid.shape
    n_stored = stored_valid.shape[1]
    device = slot_valid.device
    q_len = n_stored + draft_length
    mask = torch.zeros(batch, 1, q_len, past + q_len, dtype=torch.bool, device=device)
    mask[:, 0, :, :past] = slot_valid[:, None, :]
    mask[:, 0, :n_stored, past : past + n_stored] = causal(n_stored, device)[None] & stored_valid[:, None, :]
    mask[:, 0, n_stored:, past : past + n_stored] = stored_valid[:, None, :]
    mask[:, 0, n_stored:, past + n_stored :] = segment(draft_length, draft_pattern, device)
    return mask


def two_stream(
    n_prefix: int, n_tokens: int, block_length: int, noisy_pattern: Pattern, device: torch.device | None = None
) -> torch.Tensor:
    """Training mask over ``[image prefix | clean tokens | noisy tokens]`` for block diffusion.

    Clean tokens attend causally (so the clean stream is also an ordinary AR pass and its KV is
    what decoding stores for finished blocks). The noisy copy of block ``b`` (input positions
    ``s .. s+L-1``; position ``s`` holds the block's last committed token, unmasked) sees the
    image prefix and the clean tokens strictly before ``s``, and itself with ``noisy_pattern``:
    bidirectional for MinerU-Diffusion, causal for PA-BDM.
    """
    total = n_prefix + 2 * n_tokens
    mask = torch.zeros(total, total, dtype=torch.bool, device=device)
    clean = slice(n_prefix, n_prefix + n_tokens)
    noisy = slice(n_prefix + n_tokens, total)
    mask[: n_prefix + n_tokens, : n_prefix + n_tokens] = causal(n_prefix + n_tokens, device)
    mask[noisy, :n_prefix] = True
    block_id = torch.arange(n_tokens, device=device) // block_length
    block_start = block_id * block_length
    token_idx = torch.arange(n_tokens, device=device)
    mask[noisy, clean] = token_idx[None, :] < block_start[:, None]
    same_block = block_id[:, None] == block_id[None, :]
    inner = same_block if noisy_pattern == "bidirectional" else same_block & causal(n_tokens, device)
    if noisy_pattern not in PATTERNS:
        raise ValueError(f"unknown attention pattern {noisy_pattern!r}; expected one of {PATTERNS}")
    mask[noisy, noisy] = inner
    return mask


def expand(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """(Q, K) -> (B, 1, Q, K) without copying."""
    return mask[None, None].expand(batch, 1, *mask.shape)
