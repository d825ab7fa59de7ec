"""The one decoding loop, shared by evaluation, benchmarks and the Triton backends.

Every algorithm (AR, DARL SDB, MinerU block diffusion, PA-BDM PPC) is a :class:`Strategy` that
plans a row's next forward and accepts tokens from its logits; this module owns everything
else once: the image prefill, batching rows of different lengths into one forward, the KV cache
(rejected speculative entries are dropped; rows that accepted less than others leave masked
holes), explicit attention masks, stopping at ``<eos>`` / the token budget / the model's
position limit, streaming of committed text, and speed accounting.

The KV cache is static when the model offers a lean decoder (``static_decoder()``, the DocVLM's
Qwen2 text model): buffers are allocated once per batch, a forward writes at the next slots,
and dropping rejected speculation only moves an integer back (``StaticSlots``). Other models
(the Hugging Face family adapters) keep a ``DynamicCache`` that is grown and cropped
(``DynamicSlots``). Both give the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from PIL import Image
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from components.data.pages import validate_image
from components.decoding import masks
from components.decoding.ar import AutoregressiveStrategy
from components.decoding.block_diffusion import BlockDiffusionStrategy
from components.decoding.fixed_step import FixedShapeStep
from components.decoding.ppc import PrefixCommitmentStrategy
from components.decoding.sampling import choose_rows
from components.decoding.sdb import SlidingDiffusionBlockStrategy
from components.decoding.strategy import SpecialIds, Strategy
from components.decoding.types import CommitEvent, DecodeParams, DecodeResult, DecodeStats, RowState
from components.tokenizer import all_special_ids
from models.interface import MarkupLM
from models.static_decoder import StaticKV

STRATEGIES: dict[str, type[Strategy]] = {
    "ar": AutoregressiveStrategy,
    "sdb": SlidingDiffusionBlockStrategy,
    "block": BlockDiffusionStrategy,
    "ppc": PrefixCommitmentStrategy,
}
# The request parameter that sets each parallel decoder's speculative length.
SPEC_PARAMETER = {"sdb": "window", "block": "block_length", "ppc": "span"}


def special_ids_of(tokenizer: PreTrainedTokenizerFast) -> SpecialIds:
    lookup = tokenizer.convert_tokens_to_ids
    ids = SpecialIds(
        bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id,
        init=lookup("<INIT>"), mask=lookup("<MASK>"), other_specials=tuple(sorted(all_special_ids(tokenizer))),
    )
    if None in (ids.bos, ids.eos, ids.pad):
        raise ValueError("tokenizer must define <bos>, <eos> and <pad>")
    return ids


class DecodingEngine:
    """Decode page images to markup with any strategy; stream commits as they happen."""

    def __init__(self, model: MarkupLM, tokenizer: PreTrainedTokenizerFast, static_cache: bool = True,
                 fixed_shapes: bool = False, cuda_graphs: bool = False, compile_step: bool = False):
        """``static_cache``: the lean decoder over preallocated K/V where the model has one.
        ``fixed_shapes``: its step with fixed shapes (:mod:`components.decoding.fixed_step`);
        ``cuda_graphs`` (CUDA only) and ``compile_step`` (``torch.compile``) imply it."""
        self.model = model
        self.tokenizer = tokenizer
        self.ids = special_ids_of(tokenizer)
        self.static_cache = static_cache
        if cuda_graphs and getattr(getattr(model, "device", None), "type", "cpu") != "cuda":
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        self.cuda_graphs, self.compile_step = cuda_graphs, compile_step
        self.fixed_shapes = fixed_shapes or cuda_graphs or compile_step
        self._fixed_step: FixedShapeStep | None = None
        self._fixed_weights = 0  # data pointer of the weights the fixed step was built on

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", static_cache: bool = True,
                        prompt: str | None = None, **switches: bool) -> DecodingEngine:
        """``switches``: ``fixed_shapes``, ``cuda_graphs``, ``compile_step`` (see ``__init__``)."""
        from models.loading import load_markup_model

        model, tokenizer = load_markup_model(path, device=device, prompt=prompt)
        return cls(model, tokenizer, static_cache=static_cache, **switches)

    def fixed_step(self, lean) -> FixedShapeStep | None:
        """The engine's fixed-shape step (kept across calls, so compiled code and captured graphs are
        reused); None unless a fixed-shape switch is on."""
        if not self.fixed_shapes:
            return None
        weights = lean.embed.data_ptr()  # a moved or reloaded model has new weight tensors: start afresh
        if self._fixed_step is None or self._fixed_weights != weights:
            self._fixed_step = FixedShapeStep(lean, cuda_graphs=self.cuda_graphs, compile_step=self.compile_step)
            self._fixed_weights = weights
        return self._fixed_step

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model, "max_positions", 1 << 30))

    @property
    def prefix_length(self) -> int:
        """The model's fixed image-prefix length (0 when it depends on the image, as in HF VLMs)."""
        return int(getattr(self.model, "num_prefix_tokens", 0) or 0)

    def token_room(self, n_prefix: int | None = None) -> int:
        """Tokens the model's positions leave for a page's markup after its image prefix."""
        return self.max_positions - (self.prefix_length if n_prefix is None else n_prefix) - 1

    def check_params(self, params: DecodeParams, n_prefix: int | None = None) -> None:
        """Refuse a window / block / span the model's positions cannot hold, naming the parameter.

        The widest forward holds a stored segment plus a speculative one of the decoder's length,
        after the image prefix (``n_prefix``; the model's fixed prefix length when not given).
        """
        n_prefix = self.prefix_length if n_prefix is None else n_prefix
        room = self.token_room(n_prefix)
        if room < 1:
            raise ValueError(f"model allows {self.max_positions} positions; the image prefix alone takes {n_prefix}")
        name = SPEC_PARAMETER.get(params.decoder)
        spec = STRATEGIES[params.decoder](params, self.ids).spec_length
        if name is not None and 2 * spec >= room:
            raise ValueError(
                f"{name} {getattr(params, name)} is too large for this model: it allows {self.max_positions} positions "
                f"and the image prefix takes {n_prefix}, so {name} must be at most {(room - 1) // 2}")

    def generate(self, images: list[Image.Image], params: DecodeParams | None = None,
                 prompts: list[str | None] | None = None) -> list[DecodeResult]:
        """Decode a batch to completion. ``prompts``: a task prompt per image (element crops of a
        two-stage parse), for models that take them (``takes_task_prompts``)."""
        params = params or DecodeParams()
        rows: dict[int, RowState] = {}
        for _event in self._run(images, params, rows, prompts=prompts):
            pass
        return [self._result(rows[i]) for i in range(len(images))]

    def stream(
        self, images: list[Image.Image], params: DecodeParams | None = None,
        cancelled: Callable[[int], bool] | None = None, prompts: list[str | None] | None = None,
    ) -> Iterator[CommitEvent]:
        """Yield one event per row per forward. Closing the iterator cancels the remaining work.

        ``cancelled(row)`` is asked after every forward; a row it answers True for leaves the
        batch at once (no more forwards, no more events), the others go on.
        """
        return self._run(images, params or DecodeParams(), {}, cancelled, prompts)

    # ------------------------------------------------------------------------------------
    def _result(self, row: RowState) -> DecodeResult:
        generated = [t for t in row.generated if t != self.ids.eos]
        return DecodeResult(
            token_ids=row.generated, text=self.tokenizer.decode(generated, skip_special_tokens=True),
            stats=row.stats, confidences=row.confidences, finished=row.finished, truncated=row.truncated,
        )

    def _run(
        self, images: list[Image.Image], params: DecodeParams, rows: dict[int, RowState],
        cancelled: Callable[[int], bool] | None = None, prompts: list[str | None] | None = None,
    ) -> Iterator[CommitEvent]:
        if not images:
            raise ValueError("decode needs at least one page image")
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise TypeError(f"page {i} is a {type(image).__name__}, expected a PIL image")
            validate_image(image, what=f"page image {i}")
        strategy = STRATEGIES[params.decoder](params, self.ids)
        started = time.perf_counter()
        device = self.model.device
        empty_prompt = torch.zeros(len(images), 0, dtype=torch.long, device=device)
        if prompts is not None:
            if len(prompts) != len(images):
                raise ValueError(f"{len(prompts)} task prompts for {len(images)} images")
            if not getattr(self.model, "takes_task_prompts", False):
                raise ValueError("this model takes no task prompts (it reads an element from its crop alone)")
            _, cache = self.model.prefill(images, empty_prompt, prompts=prompts)
        else:
            _, cache = self.model.prefill(images, empty_prompt)
        n_prefix = cache.get_seq_length()
        self.check_params(params, n_prefix)
        # Leave room for the widest forward (stored block + speculative segment) below the position limit.
        budget = min(params.max_new_tokens, self.max_positions - n_prefix - 2 * strategy.spec_length - 1)
        # A model whose prefix bounds what it can write (the reader: about one token per slot) says so in
        # ``cache.output_budget``; a row that runs away then stops there instead of at max_new_tokens.
        row_budgets = [int(b) for b in getattr(cache, "output_budget", [budget] * len(images))]
        for i in range(len(images)):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device="cpu").manual_seed(params.seed + i)
            rows[i] = RowState(row=i, tokens=[self.ids.bos], budget=min(budget, row_budgets[i]), generator=generator)
            strategy.start(rows[i])
        active = [rows[i] for i in range(len(images))]
        adjust = getattr(self.model, "adjust_logits", None)
        lean = self.model.static_decoder() if self.static_cache and hasattr(self.model, "static_decoder") else None
        if lean is not None:
            slots: StaticSlots | DynamicSlots = StaticSlots(
                lean, StaticKV.from_cache(cache, n_prefix + 2 * (budget + 2 * strategy.spec_length)), n_prefix,
                prefix_validity(cache, len(images), n_prefix, device), self.fixed_step(lean))
        else:
            slots = DynamicSlots(self.model, cache, len(images), n_prefix)

        while active:
            plans = [strategy.plan(row) for row in active]
            n_stored = max(len(plan.stored) for plan in plans)
            width = n_stored + strategy.spec_length
            input_ids = torch.full((len(active), width), self.ids.pad, dtype=torch.long)
            position_ids = torch.zeros((len(active), width), dtype=torch.long)
            stored_valid = torch.zeros((len(active), n_stored), dtype=torch.bool)
            for i, (row, plan) in enumerate(zip(active, plans, strict=True)):
                k = len(plan.stored)
                first = n_prefix + row.cached  # absolute position of the first stored token
                input_ids[i, n_stored - k : n_stored] = torch.tensor(plan.stored, dtype=torch.long)
                position_ids[i, n_stored - k : n_stored] = torch.arange(first, first + k)
                stored_valid[i, n_stored - k :] = True
                input_ids[i, n_stored:] = torch.tensor(plan.spec, dtype=torch.long)
                position_ids[i, n_stored:] = torch.arange(first + k, first + k + strategy.spec_length)
            attention = masks.decode_step(slots.past_valid(), stored_valid.to(device), strategy.spec_length,
                                          strategy.pattern)
            spec_logits = slots.forward(input_ids.to(device), position_ids.to(device), attention, n_stored)
            if adjust is not None:  # a model's own term on its logits (the reader's copy prior)
                spec_logits = adjust(spec_logits, position_ids[:, n_stored:], torch.tensor([r.row for r in active]), cache)
            choices = choose_rows(spec_logits, params, [row.generator for row in active], strategy.banned)

            new_valid = torch.zeros((len(active), width), dtype=torch.bool)
            new_valid[:, :n_stored] = stored_valid
            extent = 0  # slots of this forward that some row keeps
            now = time.perf_counter()
            for i, (row, plan) in enumerate(zip(active, plans, strict=True)):
                acceptance = strategy.accept(row, *choices[i])
                row.cached += len(plan.stored) + acceptance.keep_spec
                new_valid[i, n_stored : n_stored + acceptance.keep_spec] = True
                if acceptance.keep_spec:
                    extent = max(extent, n_stored + acceptance.keep_spec)
                elif plan.stored:
                    extent = max(extent, n_stored)
                event = self._commit(row, acceptance.commit, acceptance.confidences, acceptance.decided)
                row.stats.seconds = now - started
                yield event

            slots.keep(new_valid.to(device), extent)
            if cancelled is not None:
                for row in active:
                    row.cancelled = row.cancelled or (not row.done and cancelled(row.row))
            if any(row.done for row in active):
                keep = [i for i, row in enumerate(active) if not row.done]
                active = [active[i] for i in keep]
                if active:
                    slots.select_rows(torch.tensor(keep, device=device))

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
        if row.detokenizer is None:
            row.detokenizer = DecodeStream(skip_special_tokens=True)
        content = [t for t in tokens if t != self.ids.eos]
        delta = (row.detokenizer.step(self.tokenizer.backend_tokenizer, content) or "") if content else ""
        if row.done:
            full = self.tokenizer.decode([t for t in row.generated if t != self.ids.eos], skip_special_tokens=True)
            delta = full[len(row.emitted_text) :]
        row.emitted_text += delta
        return CommitEvent(
            row=row.row, token_ids=tokens, text=delta, confidences=confidences, forward_pass=row.stats.forward_passes,
            decided=decided, finished=row.finished, truncated=row.truncated,
        )


def prefix_validity(cache, batch: int, n_prefix: int, device: torch.device) -> torch.Tensor:
    """Which prefix slots each row may attend: all, unless the prefill padded prefixes of different
    lengths and said so in ``cache.prefix_valid`` (the reader's elements, a chat model's prompts)."""
    valid = getattr(cache, "prefix_valid", None)
    if valid is None:
        return torch.ones(batch, n_prefix, dtype=torch.bool, device=device)
    return valid.to(device=device, dtype=torch.bool)


class DynamicSlots:
    """A growing ``DynamicCache`` plus which slots each row may attend (models without a lean decoder)."""

    def __init__(self, model: MarkupLM, cache, batch: int, n_prefix: int):
        self.model, self.cache = model, cache
        self.valid = prefix_validity(cache, batch, n_prefix, model.device)

    def past_valid(self) -> torch.Tensor:
        return self.valid

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: torch.Tensor,
                logits_from: int) -> torch.Tensor:
        return self.model.forward_tokens(input_ids, position_ids, attention, self.cache)[:, logits_from:]

    def keep(self, new_valid: torch.Tensor, extent: int) -> None:
        """Record which new slots rows kept and crop the trailing ones nobody kept."""
        self.valid = torch.cat([self.valid, new_valid[:, :extent]], dim=1)
        surplus = new_valid.shape[1] - extent
        if surplus > 0:
            self.cache.crop(-surplus)

    def select_rows(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)
        self.valid = self.valid[index]


class StaticSlots:
    """A ``StaticKV`` and a preallocated validity map: dropping slots moves ``length`` back, nothing else."""

    def __init__(self, lean, kv: StaticKV, n_prefix: int, prefix_valid: torch.Tensor,
                 fixed_step: FixedShapeStep | None = None):
        self.lean, self.kv, self.fixed_step = lean, kv, fixed_step
        self.start = kv.length  # first slot of the latest forward
        self.valid = torch.zeros(kv.keys[0].shape[0], kv.capacity, dtype=torch.bool, device=kv.keys[0].device)
        self.valid[:, :n_prefix] = prefix_valid

    def past_valid(self) -> torch.Tensor:
        return self.valid[:, : self.kv.length]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: torch.Tensor,
                logits_from: int) -> torch.Tensor:
        self.start = self.kv.length
        if self.fixed_step is not None:
            logits = self.fixed_step(input_ids, position_ids, attention, self.kv, logits_from)
        else:
            logits = self.lean.forward(input_ids, position_ids, attention, self.kv, logits_from=logits_from)
        if self.kv.capacity > self.valid.shape[1]:  # the KV buffers grew
            grown = self.valid.new_zeros(self.valid.shape[0], self.kv.capacity)
            grown[:, : self.valid.shape[1]] = self.valid
            self.valid = grown
        return logits

    def keep(self, new_valid: torch.Tensor, extent: int) -> None:
        self.valid[:, self.start : self.start + extent] = new_valid[:, :extent]
        self.kv.length = self.start + extent

    def select_rows(self, index: torch.Tensor) -> None:
        self.kv.select_rows(index)
        self.valid = self.valid.index_select(0, index)


def decode_stats_summary(results: list[DecodeResult]) -> DecodeStats:
    """Pool the speed accounting of many pages (forwards and tokens add up, time too)."""
    total = DecodeStats()
    for result in results:
        total.forward_passes += result.stats.forward_passes
        total.new_tokens += result.stats.new_tokens
        total.seconds += result.stats.seconds
        total.accepted_lengths.extend(result.stats.accepted_lengths)
        total.confidence_sum += result.stats.confidence_sum
    return total
