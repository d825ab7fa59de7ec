"""The one decoding engine, shared by evaluation, mining, benchmarks and the Triton backends.

Every algorithm (AR, DARL SDB, MinerU block diffusion, PA-BDM PPC) is a :class:`Strategy` that
plans a row's next forward and accepts tokens from its logits; everything else is written once:

- this module: the model and tokenizer, request checks against the model's positions, and the
  closed-batch calls ``generate`` / ``stream`` (every page admitted at once);
- :mod:`components.decoding.batch`: the step runner (prefill, rows of different lengths in one
  forward, explicit attention masks, ``<eos>`` / budget / position-limit stops, streaming of
  committed text, speed accounting), with rows that may join between steps;
- :mod:`components.decoding.slots`: the KV cache, static when the model offers a lean decoder
  (``static_decoder()``: buffers allocated once, dropping rejected speculation moves an integer
  back) and a ``DynamicCache`` otherwise (the Hugging Face family adapters); the same tokens;
- :mod:`components.decoding.scheduler`: continuous batching (a waiting queue admitted into free
  rows at every step), what the Triton backend serves with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

from PIL import Image
from transformers import PreTrainedTokenizerFast

from components.decoding.ar import AutoregressiveStrategy
from components.decoding.batch import DecodeBatch
from components.decoding.block_diffusion import BlockDiffusionStrategy
from components.decoding.fixed_step import FixedShapeStep
from components.decoding.ppc import PrefixCommitmentStrategy
from components.decoding.sdb import SlidingDiffusionBlockStrategy
from components.decoding.strategy import SpecialIds, Strategy
from components.decoding.types import CommitEvent, DecodeParams, DecodeResult, DecodeStats, RowState
from models.interface import MarkupLM, ModelCapabilities, capabilities_of
from models.loading import load_markup_model
from models.tokenizer import all_special_ids

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


def engine_capabilities(engine) -> ModelCapabilities:
    """What the engine's model declares; a stand-in without a model (a test's wrapper) reads as a page model."""
    return getattr(engine, "capabilities", None) or ModelCapabilities()


class DecodingEngine:
    """Decode page images to markup with any strategy; stream commits as they happen."""

    def __init__(self, model: MarkupLM, tokenizer: PreTrainedTokenizerFast, static_cache: bool = True,
                 fixed_shapes: bool = False, cuda_graphs: bool = False, compile_step: bool = False):
        """``static_cache``: the lean decoder over preallocated K/V where the model has one.
        ``fixed_shapes``: its step with fixed shapes (:mod:`components.decoding.fixed_step`);
        ``cuda_graphs`` (CUDA only) and ``compile_step`` (``torch.compile``) imply it."""
        self.model = model
        self.capabilities = capabilities_of(model)
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
        return self.capabilities.max_positions

    @property
    def prefix_length(self) -> int:
        """The model's fixed image-prefix length (0 when it depends on the image, as in HF VLMs)."""
        return self.capabilities.prefix_length

    def reading_pieces(self, crop: Image.Image) -> list[Image.Image]:
        """The pieces the model reads a crop in (runs of whole lines its trained prefix holds), or the crop."""
        return self.model.reading_pieces(crop) if self.capabilities.reads_in_pieces else [crop]

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
        return [self.result_of(rows[i]) for i in range(len(images))]

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
    def result_of(self, row: RowState) -> DecodeResult:
        generated = [t for t in row.generated if t != self.ids.eos]
        return DecodeResult(
            token_ids=row.generated, text=self.tokenizer.decode(generated, skip_special_tokens=True),
            stats=row.stats, confidences=row.confidences, finished=row.finished, truncated=row.truncated,
        )

    def _run(
        self, images: list[Image.Image], params: DecodeParams, rows: dict[int, RowState],
        cancelled: Callable[[int], bool] | None = None, prompts: list[str | None] | None = None,
    ) -> Iterator[CommitEvent]:
        """A closed batch: every page admitted at once, stepped until the last row leaves (the
        batch's prefill checks the images)."""
        started = time.perf_counter()
        batch = self.new_batch(params)
        seeds = [None if params.seed is None else params.seed + i for i in range(len(images))]
        for row in batch.admit(images, list(range(len(images))), seeds, prompts=prompts, started=started):
            rows[row.row] = row
        while batch:
            yield from batch.step()
            if cancelled is not None:
                batch.cancel(cancelled)

    def new_batch(self, params: DecodeParams) -> DecodeBatch:
        """An empty batch of ``params``'s decoder; rows join with ``admit`` and advance with ``step``."""
        return DecodeBatch(self, params, STRATEGIES[params.decoder](params, self.ids))


def decode_stats_summary(results: list[DecodeResult]) -> DecodeStats:
    """Pool the speed accounting of many pages (forwards and tokens add up, time too)."""
    return DecodeStats.merge((result.stats for result in results), concurrent=False)
