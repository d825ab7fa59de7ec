"""The step runner: rows decoded together, one forward per step for all of them.

A :class:`DecodeBatch` holds the rows of one decoding strategy and their KV slots. :meth:`admit`
prefills pages and adds their rows — at the start (a closed batch: ``DecodingEngine.generate``)
or between any two steps (continuous batching: :mod:`components.decoding.scheduler`); :meth:`step`
runs one forward for every row still decoding, accepts tokens by the strategy, and returns one
:class:`CommitEvent` per row; finished and cancelled rows leave the batch after the step.

A row's result does not depend on when it joined or with whom: every row has its own positions
(its prefix length plus its cached tokens), its own attention over the slots it owns, its own
random generator and the model's per-row prefix state (``adjust_logits`` gets the cache of the
row's own prefill). Hence continuous batching is token-identical to decoding the row alone
(``tests/test_scheduler.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from PIL import Image
from tokenizers.decoders import DecodeStream

from components.data.pages import validate_image
from components.decoding import masks
from components.decoding.sampling import choose_rows
from components.decoding.slots import DynamicSlots, StaticSlots, prefix_validity
from components.decoding.strategy import Strategy
from components.decoding.types import CommitEvent, DecodeParams, RowState
from models.static_decoder import StaticKV

if TYPE_CHECKING:  # the engine builds batches; a type only, no import at run time
    from components.decoding.engine import DecodingEngine


@dataclass
class Prefill:
    """Pages run through the model's prefix, waiting to join a batch as rows."""

    cache: object  # the model's prefill cache (KV, and its per-row prefix state)
    n_prefix: int
    rows: int


def check_images(images: list[Image.Image]) -> None:
    if not images:
        raise ValueError("decode needs at least one page image")
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(f"page {i} is a {type(image).__name__}, expected a PIL image")
        validate_image(image, what=f"page image {i}")


class DecodeBatch:
    """Rows of one decoding strategy sharing each forward; rows may join between steps."""

    def __init__(self, engine: DecodingEngine, params: DecodeParams, strategy: Strategy):
        self.engine, self.params, self.strategy = engine, params, strategy
        self.ids = engine.ids
        self.active: list[RowState] = []
        self.slots: StaticSlots | DynamicSlots | None = None
        self.lean = None
        if engine.static_cache and hasattr(engine.model, "static_decoder"):
            self.lean = engine.model.static_decoder()

    def __len__(self) -> int:
        return len(self.active)

    @property
    def joins_mid_batch(self) -> bool:
        """Whether rows can join while others decode (the static cache); otherwise only an empty batch."""
        return self.slots is None or self.slots.joins_mid_batch

    def admit(self, images: list[Image.Image], row_ids: list[int], seeds: list[int | None],
              prompts: list[str | None] | None = None, started: float | None = None) -> list[RowState]:
        """Prefill ``images`` and add their rows (``row_ids``: the caller's names for them)."""
        started = time.perf_counter() if started is None else started
        return self.join(self.prefill(images, prompts), row_ids, seeds, started)

    def prefill(self, images: list[Image.Image], prompts: list[str | None] | None = None) -> Prefill:
        """Run the model over the pages' images (and task prompts): everything a row needs before it
        joins. Touches no batch state, so it may run on another thread while the batch steps."""
        check_images(images)
        model, device = self.engine.model, self.engine.model.device
        empty_prompt = torch.zeros(len(images), 0, dtype=torch.long, device=device)
        if prompts is not None:
            if len(prompts) != len(images):
                raise ValueError(f"{len(prompts)} task prompts for {len(images)} images")
            if not self.engine.capabilities.takes_task_prompts:
                raise ValueError("this model takes no task prompts (it reads an element from its crop alone)")
            _, cache = model.prefill(images, empty_prompt, prompts=prompts)
        else:
            _, cache = model.prefill(images, empty_prompt)
        n_prefix = cache.get_seq_length()
        self.engine.check_params(self.params, n_prefix)
        return Prefill(cache, n_prefix, len(images))

    def join(self, prefill: Prefill, row_ids: list[int], seeds: list[int | None], started: float) -> list[RowState]:
        """Add a prefill's rows to the batch (between steps)."""
        if not self.joins_mid_batch and self.active:
            raise RuntimeError("this model's cache takes new rows only into an empty batch")
        cache, n_prefix, device = prefill.cache, prefill.n_prefix, self.engine.model.device
        spec = self.strategy.spec_length
        # Leave room for the widest forward (stored block + speculative segment) below the position limit.
        budget = min(self.params.max_new_tokens, self.engine.max_positions - n_prefix - 2 * spec - 1)
        # A model whose prefix bounds what it can write (the reader: about one token per slot) says so in
        # ``cache.output_budget``; a row that runs away then stops there instead of at max_new_tokens.
        row_budgets = [int(b) for b in getattr(cache, "output_budget", [budget] * prefill.rows)]
        rows = []
        for i, (row_id, seed) in enumerate(zip(row_ids, seeds, strict=True)):
            generator = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
            row = RowState(row=row_id, tokens=[self.ids.bos], budget=min(budget, row_budgets[i]), generator=generator,
                           prefix_length=n_prefix, prefill=cache, prefill_row=i, started=started)
            self.strategy.start(row)
            rows.append(row)
        valid = prefix_validity(cache, prefill.rows, n_prefix, device)
        if self.slots is not None and self.active:
            self.slots.admit(cache, n_prefix, valid)
        elif self.lean is not None:
            capacity = n_prefix + 2 * (budget + 2 * spec)
            self.slots = StaticSlots(self.lean, StaticKV.from_cache(cache, capacity), n_prefix, valid,
                                     self.engine.fixed_step(self.lean))
        else:
            self.slots = DynamicSlots(self.engine.model, cache, prefill.rows, n_prefix)
        self.active.extend(rows)
        return rows

    def step(self) -> list[CommitEvent]:
        """One forward for every active row; returns each row's event. Rows that finished leave."""
        if not self.active:
            return []
        strategy, slots, device = self.strategy, self.slots, self.engine.model.device
        active = self.active
        plans = [strategy.plan(row) for row in active]
        n_stored = max(len(plan.stored) for plan in plans)
        width = n_stored + strategy.spec_length
        input_ids = torch.full((len(active), width), self.ids.pad, dtype=torch.long)
        position_ids = torch.zeros((len(active), width), dtype=torch.long)
        stored_valid = torch.zeros((len(active), n_stored), dtype=torch.bool)
        for i, (row, plan) in enumerate(zip(active, plans, strict=True)):
            k = len(plan.stored)
            first = row.prefix_length + row.cached  # absolute position of the first stored token
            input_ids[i, n_stored - k : n_stored] = torch.tensor(plan.stored, dtype=torch.long)
            position_ids[i, n_stored - k : n_stored] = torch.arange(first, first + k)
            stored_valid[i, n_stored - k :] = True
            input_ids[i, n_stored:] = torch.tensor(plan.spec, dtype=torch.long)
            position_ids[i, n_stored:] = torch.arange(first + k, first + k + strategy.spec_length)
        attention = masks.decode_step(slots.past_valid(), stored_valid.to(device), strategy.spec_length,
                                      strategy.pattern)
        spec_logits = slots.forward(input_ids.to(device), position_ids.to(device), attention, n_stored)
        spec_logits = self._adjust(spec_logits, position_ids[:, n_stored:])
        choices = choose_rows(spec_logits, self.params, [row.generator for row in active], strategy.banned)

        new_valid = torch.zeros((len(active), width), dtype=torch.bool)
        new_valid[:, :n_stored] = stored_valid
        extent = 0  # slots of this forward that some row keeps
        now = time.perf_counter()
        events = []
        for i, (row, plan) in enumerate(zip(active, plans, strict=True)):
            acceptance = strategy.accept(row, *choices[i])
            row.cached += len(plan.stored) + acceptance.keep_spec
            new_valid[i, n_stored : n_stored + acceptance.keep_spec] = True
            if acceptance.keep_spec:
                extent = max(extent, n_stored + acceptance.keep_spec)
            elif plan.stored:
                extent = max(extent, n_stored)
            events.append(self._commit(row, acceptance.commit, acceptance.confidences, acceptance.decided))
            row.stats.seconds = now - row.started

        slots.keep(new_valid.to(device), extent)
        self.retire()
        return events

    def cancel(self, cancelled: Callable[[int], bool]) -> list[RowState]:
        """Rows whose id ``cancelled`` answers True for leave the batch now (no more forwards); returned."""
        dropped = [row for row in self.active if cancelled(row.row)]
        for row in dropped:
            row.cancelled = True
        self.retire()
        return dropped

    def retire(self) -> None:
        """Drop the rows that are done (finished, truncated or cancelled) from the batch."""
        if any(row.done for row in self.active):
            keep = [i for i, row in enumerate(self.active) if not row.done]
            self.active = [self.active[i] for i in keep]
            if self.active:
                self.slots.select_rows(torch.tensor(keep, device=self.engine.model.device))
            else:
                self.slots = None  # the next admission starts a fresh cache

    def _adjust(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A model's own term on its logits (the reader's copy prior), asked once per prefill group
        with that prefill's cache and the rows' places in it."""
        adjust = getattr(self.engine.model, "adjust_logits", None)
        if adjust is None:
            return logits
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(self.active):
            groups.setdefault(id(row.prefill), []).append(i)
        if len(groups) == 1:
            return adjust(logits, positions, torch.tensor([r.prefill_row for r in self.active]), self.active[0].prefill)
        out = logits.clone()
        for members in groups.values():
            index = torch.tensor(members)
            rows = torch.tensor([self.active[i].prefill_row for i in members])
            out[index.to(logits.device)] = adjust(logits[index.to(logits.device)], positions[index], rows,
                                                  self.active[members[0]].prefill)
        return out

    def _commit(self, row: RowState, tokens: list[int], confidences: list[float], decided: int) -> CommitEvent:
        """Append accepted tokens to a row, applying <eos> and budget stops; build its stream event."""
        row.stats.forward_passes += 1
        row.stats.accepted_lengths.append(decided)
        tokens = tokens[: row.remaining]
        if self.ids.eos in tokens:
            tokens = tokens[: tokens.index(self.ids.eos) + 1]
            row.finished = True
        confidences = confidences[: len(tokens)]
        row.tokens.extend(tokens)
        row.confidences.extend(confidences)
        row.stats.new_tokens += len(tokens)
        row.stats.confidence_sum += sum(confidences)
        if not row.finished and row.remaining <= 0:
            row.truncated = True
        if not tokens and not row.done:
            return CommitEvent(row=row.row, token_ids=[], text="", confidences=[], forward_pass=row.stats.forward_passes,
                               decided=decided)
        # Incremental: only the new tokens are decoded (DecodeStream holds back half a UTF-8
        # character); the full decode runs once, when the row ends, to flush what is held back.
        tokenizer = self.engine.tokenizer
        if row.detokenizer is None:
            row.detokenizer = DecodeStream(skip_special_tokens=True)
        content = [t for t in tokens if t != self.ids.eos]
        delta = (row.detokenizer.step(tokenizer.backend_tokenizer, content) or "") if content else ""
        if row.done:
            full = tokenizer.decode([t for t in row.generated if t != self.ids.eos], skip_special_tokens=True)
            delta = full[len(row.emitted_text) :]
        row.emitted_text += delta
        return CommitEvent(
            row=row.row, token_ids=tokens, text=delta, confidences=confidences, forward_pass=row.stats.forward_passes,
            decided=decided, finished=row.finished, truncated=row.truncated,
        )
