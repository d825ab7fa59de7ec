"""A scripted MarkupLM whose behaviour is known exactly, to test the decoding loops hard.

Each page has a target token sequence. The oracle reads what a query may see *through the
attention mask the engine built* (the KV cache stores token ids, positions and page ids), and:

- predicts the right next token with confidence ``sure`` when every position before and at the
  query is visible and correct (it can do AR);
- when the query sits ``d`` steps past the last correct contiguous token (placeholders or wrong
  guesses in between), predicts the right token with confidence ``guess(d)`` while ``d`` is
  within ``horizon``, and a wrong token with low confidence beyond it;
- any visible wrong *committed-looking* token (a rejected draft the engine forgot to hide) breaks
  the contiguous run, so mask or cache bugs show up as wrong output.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache

IMAGE_TOKEN = -7.0


class OracleModel:
    def __init__(self, targets: list[list[int]], vocab_size: int, placeholders: tuple[int, ...], horizon: int = 4,
                 sure: float = 0.999, guess_decay: float = 0.02, n_prefix: int = 5, max_positions: int = 4096):
        self.targets = targets
        self.vocab_size = vocab_size
        self.placeholders = set(placeholders)
        self.horizon = horizon
        self.sure = sure
        self.guess_decay = guess_decay
        self.n_prefix = n_prefix
        self.max_positions = max_positions
        self.device = torch.device("cpu")
        self.forward_calls = 0
        self.widths: list[int] = []

    def guess(self, distance: int) -> float:
        return max(0.5, 0.99 - self.guess_decay * (distance - 1))

    def prefill(self, images, prompt_ids):
        batch = len(images)
        cache = DynamicCache()
        keys = torch.full((batch, 1, self.n_prefix, 2), IMAGE_TOKEN)
        keys[:, 0, :, 1] = torch.arange(batch, dtype=torch.float)[:, None]
        values = torch.arange(self.n_prefix, dtype=torch.float).expand(batch, 1, self.n_prefix)[..., None].clone()
        cache.update(keys, values, 0)
        return torch.zeros(batch, 0, self.vocab_size), cache

    def _logits_for(self, token: int, confidence: float) -> torch.Tensor:
        rest = (1.0 - confidence) / (self.vocab_size - 1)
        logits = torch.full((self.vocab_size,), math.log(rest))
        logits[token] = math.log(confidence)
        return logits

    def _wrong(self, token: int) -> int:
        candidate = (token + 1) % self.vocab_size
        while candidate in self.placeholders:
            candidate = (candidate + 1) % self.vocab_size
        return candidate

    def forward_tokens(self, input_ids, position_ids, attention_mask, cache):
        self.forward_calls += 1
        self.widths.append(input_ids.shape[1])
        batch, width = input_ids.shape
        page_ids = cache.layers[0].keys[:, 0, 0, 1]
        keys = torch.stack([input_ids.float(), page_ids[:, None].expand(batch, width)], dim=-1)[:, None]
        all_keys, all_values = cache.update(keys, position_ids.float()[:, None, :, None], 0)
        assert attention_mask.shape == (batch, 1, width, all_keys.shape[2]), "mask must cover cache + new tokens"
        out = torch.zeros(batch, width, self.vocab_size)
        for b in range(batch):
            target = self.targets[int(page_ids[b])]
            for q in range(width):
                visible = attention_mask[b, 0, q].nonzero().flatten().tolist()
                query_index = int(position_ids[b, q]) - self.n_prefix
                seen: dict[int, int] = {}
                for slot in visible:
                    token = int(all_keys[b, 0, slot, 0])
                    index = int(all_values[b, 0, slot, 0]) - self.n_prefix
                    if token == IMAGE_TOKEN:
                        continue
                    assert index not in seen or seen[index] == token, f"two different tokens visible at index {index}"
                    seen[index] = token
                run = -1  # last index of the contiguous correct run starting at <bos>
                while run + 1 in seen and run + 1 < len(target) and seen[run + 1] == target[run + 1]:
                    run += 1
                nxt = query_index + 1
                if nxt >= len(target):
                    out[b, q] = self._logits_for(target[-1], self.sure)
                    continue
                distance = query_index - run
                if distance <= 0:
                    out[b, q] = self._logits_for(target[nxt], self.sure)
                elif distance <= self.horizon:
                    out[b, q] = self._logits_for(target[nxt], self.guess(distance))
                else:
                    out[b, q] = self._logits_for(self._wrong(target[nxt]), 0.3)
        return out
