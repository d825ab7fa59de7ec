"""Several views of one page in a single forward: ``[image prefix | clean tokens | stream 1 | ...]``.

Every objective of the mix reads the same clean sequence (the ordinary causal AR pass) and
adds a *stream*: a DARL window, a MinerU noisy copy, a PA-BDM noisy copy. A stream position
sees the image prefix, the clean tokens strictly before a per-position limit, and its own
stream with a given pattern; streams never see each other. That is exactly what a separate
forward over ``[prefix, clean[:limit], stream]`` would compute (same position ids), so one
pass replaces one forward per objective. The block streams take their masks from
:func:`components.decoding.masks.two_stream`, the same code the decoders' training layout is
defined by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.decoding import masks


@dataclass
class Stream:
    """A segment appended after the clean tokens.

    ``positions``: token-index positions (0 = ``<bos>``) of each stream input, which are also
    their rotary positions. ``clean_limit``: a stream row attends clean tokens with index
    ``< clean_limit``. ``self_mask``: (n, n) or (B, n, n) bool attention inside the stream.
    """

    name: str
    input_ids: torch.Tensor  # (B, n)
    positions: torch.Tensor  # (B, n)
    clean_limit: torch.Tensor  # (B, n)
    self_mask: torch.Tensor  # (n, n) or (B, n, n)

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


@dataclass
class Layout:
    """Model inputs for one multi-stream forward and where each stream's logits are."""

    input_ids: torch.Tensor  # (B, T + sum n)
    position_ids: torch.Tensor  # (B, P + T + sum n)
    attention_mask: torch.Tensor  # (B, 1, L, L) bool, True = attend
    n_clean: int
    spans: dict[str, slice]  # stream name -> slice of the token part (= of the logits)

    def clean_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, : self.n_clean]

    def stream_logits(self, logits: torch.Tensor, name: str) -> torch.Tensor:
        return logits[:, self.spans[name]]


def compose(clean_ids: torch.Tensor, streams: list[Stream], n_prefix: int) -> Layout:
    """Lay out the clean tokens and the streams for one forward."""
    batch, n_clean = clean_ids.shape
    device = clean_ids.device
    total_tokens = n_clean + sum(s.length for s in streams)
    total = n_prefix + total_tokens
    mask = torch.zeros(batch, total, total, dtype=torch.bool, device=device)
    mask[:, : n_prefix + n_clean, : n_prefix + n_clean] = masks.causal(n_prefix + n_clean, device)
    clean_index = torch.arange(n_clean, device=device)
    ids = [clean_ids]
    positions = [torch.arange(n_prefix + n_clean, device=device).expand(batch, -1)]
    spans: dict[str, slice] = {}
    offset = n_clean
    for stream in streams:
        if stream.name in spans:
            raise ValueError(f"two streams are named {stream.name!r}")
        rows = slice(n_prefix + offset, n_prefix + offset + stream.length)
        mask[:, rows, :n_prefix] = True
        mask[:, rows, n_prefix : n_prefix + n_clean] = clean_index[None, None, :] < stream.clean_limit[:, :, None]
        mask[:, rows, rows] = stream.self_mask
        ids.append(stream.input_ids)
        positions.append(n_prefix + stream.positions)
        spans[stream.name] = slice(offset, offset + stream.length)
        offset += stream.length
    return Layout(
        input_ids=torch.cat(ids, dim=1),
        position_ids=torch.cat(positions, dim=1),
        attention_mask=mask[:, None],
        n_clean=n_clean,
        spans=spans,
    )


def block_stream(name: str, input_ids: torch.Tensor, block_length: int, pattern: masks.Pattern) -> Stream:
    """A noisy copy of the sequence in blocks of ``block_length`` (the two-stream training layout).

    Block b covers token positions ``s .. s+L-1`` (s = b*L); it sees clean tokens ``< s`` and
    itself with ``pattern`` (bidirectional: MinerU-Diffusion, causal: PA-BDM).
    """
    batch, length = input_ids.shape
    device = input_ids.device
    reference = masks.two_stream(0, length, block_length, pattern, device)  # [clean | noisy] for n_prefix=0
    noisy_rows = reference[length:]
    clean_limit = noisy_rows[:, :length].sum(dim=1)  # each row's clean part is a left prefix
    positions = torch.arange(length, device=device)
    return Stream(
        name=name,
        input_ids=input_ids,
        positions=positions.expand(batch, -1),
        clean_limit=clean_limit.expand(batch, -1),
        self_mask=noisy_rows[:, length:],
    )


def window_stream(name: str, input_ids: torch.Tensor, offsets: torch.Tensor) -> Stream:
    """A DARL window of w slots after the committed token at clean index ``offsets[b]``.

    Slot j sits at position ``offsets + 1 + j``, sees the clean tokens ``0 .. offsets`` and the
    earlier slots causally: the layout of ``[c, d_1 .. d_w]`` in SDB decoding.
    """
    batch, width = input_ids.shape
    device = input_ids.device
    slots = torch.arange(width, device=device)
    return Stream(
        name=name,
        input_ids=input_ids,
        positions=offsets[:, None] + 1 + slots[None, :],
        clean_limit=(offsets[:, None] + 1).expand(batch, width),
        self_mask=masks.causal(width, device),
    )
