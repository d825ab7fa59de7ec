"""Pages -> tokenized training batches, in an order that depends only on (seed, step).

Batch composition is a pure function of the seed, the optimizer step, the micro-step and the
rank, so a run resumed from a checkpoint sees exactly the batches the uninterrupted run would
have seen, with no sampler state to save. Each source (the broad pages, and in Stage 2 the
curated hard pages) is read as an endless stream of per-epoch permutations; in Stage 2 every
global batch holds ``round(hard_ratio * G)`` hard pages and the rest broad ones.

Per-sample weights for Stage 2 come from ``page.meta["consistency"]`` (C(x) from curation):
``1 + beta * (1 - C(x))``; pages without a score weigh 1.

With ``unit="element"`` (two-stage parsers: MinerU2.5, PaddleOCR-VL, our element models) every
body element of a page with a box is one example: its native-resolution crop, its category's task
prompt (for families that take one) and its markup (:func:`render_block` of the element) as the
target. Elements of a page share the page's C(x) unless ``meta["element_consistency"]`` gives one
per element; elements with nothing to learn (empty content, a box that leaves no pixels) are
dropped with a count, never a crash in training.
"""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

from components.data.markup import BLOCK_CATEGORIES, render_block
from components.data.page_store import PageDataset, ShardInfo
from components.data.pages import InvalidPageError, Page, load_image
from components.parsing.crops import DEFAULT_CROP, CropSettings, clip_box, native_crop
from components.parsing.prompts import task_prompt
from components.training.objectives import consistency_weights
from models.interface import PageInputs


@dataclass(frozen=True)
class Example:
    page_id: str
    image_path: Path
    token_ids: tuple[int, ...]  # <bos> markup [<eos>]
    ends_with_eos: bool
    consistency: float | None
    box: tuple[float, float, float, float] | None = None  # element unit: the crop in page pixels
    category: str | None = None  # element unit: what the element is (picks its task prompt)


UNITS = ("page", "element")


def element_targets(page: Page, settings: CropSettings = DEFAULT_CROP,
                    markup: bool = True) -> tuple[list[tuple[int, str, str]], int]:
    """``(index, category, target)`` of a page's trainable elements, and how many were dropped. The
    target is the element's markup (``render_block``), or with ``markup=False`` its bare content, for
    a model that reads an element's text and leaves its form to the layout's category (the reader)."""
    kept, dropped = [], 0
    for index, element in enumerate(page.elements):
        if element.category not in BLOCK_CATEGORIES:
            continue  # layout-only (headers, footers, figures): no markup to learn
        x0, y0, x1, y1 = clip_box(element.bbox, page.width, page.height)
        if not element.content.strip() or x1 - x0 < settings.min_side or y1 - y0 < settings.min_side:
            dropped += 1
            continue
        kept.append((index, element.category,
                     render_block(element.category, element.content) if markup else element.content))
    return kept, dropped


@dataclass
class Batch:
    """One micro-batch, already on the training device."""

    pages: PageInputs  # what the model's cpu_preprocessor made of the page images
    tokens: torch.Tensor  # (B, T) padded with <pad>
    lengths: torch.Tensor  # (B,)
    ends_with_eos: torch.Tensor  # (B,) bool
    weights: torch.Tensor  # (B,) per-sample loss weights
    page_ids: list[str]

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
        return Batch(
            # a pixel tensor or a processor's BatchFeature (which casts only its floating tensors)
            pages=self.pages.to(device=device, dtype=dtype),
            tokens=self.tokens.to(device),
            lengths=self.lengths.to(device),
            ends_with_eos=self.ends_with_eos.to(device),
            weights=self.weights.to(device),
            page_ids=self.page_ids,
        )


def encode_markup(tokenizer: PreTrainedTokenizerFast, markup: str, max_tokens: int) -> tuple[list[int], bool]:
    """``<bos> markup <eos>`` cut to ``max_tokens``; the flag says whether ``<eos>`` survived."""
    body = tokenizer(markup, add_special_tokens=False)["input_ids"]
    ids = [tokenizer.bos_token_id, *body, tokenizer.eos_token_id]
    if len(ids) <= max_tokens:
        return ids, True
    return ids[:max_tokens], False


TOKEN_CACHE_DIR = ".token-cache"  # inside the page store; never versioned (see page_store.DERIVED_PATTERNS)


class ShardedExamples(Sequence[Example]):
    """The examples of a page store, tokenised once per shard and cached next to the store.

    A sequence over the live pages of the shards as they were when it was opened (example ``i``
    is row ``i - offset`` of the shard it falls in). Only a few shards' token ids are held in
    memory at once, so a rank's memory does not grow with the corpus; the cache file of a shard
    is written by whichever process needs it first (under a lock) and read by every other rank,
    DataLoader worker and later stage. Bad records (empty markup, C(x) outside [0, 1]) fail in
    :meth:`prepare`, before training starts.
    """

    def __init__(self, root: str | Path, tokenizer: PreTrainedTokenizerFast, max_tokens: int, shards_in_memory: int = 3,
                 unit: str = "page", markup: bool = True):
        self.store = PageDataset(root)
        if not self.store.exists():
            raise FileNotFoundError(f"training dataset {self.store.root} has no page store; create or pull it first")
        self.shards = [s for s in self.store.shards() if s.live]
        self.offsets = np.cumsum([0, *(s.live for s in self.shards)]).tolist()
        if not self.offsets[-1]:
            raise InvalidPageError(f"training dataset {self.store.root} holds no pages")
        if unit not in UNITS:
            raise ValueError(f"data.unit must be one of {UNITS}, got {unit!r}")
        self.tokenizer, self.max_tokens, self.unit, self.markup = tokenizer, max_tokens, unit, markup
        vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True) + f"|{tokenizer.bos_token_id}|{tokenizer.eos_token_id}|{max_tokens}"
        vocab += "" if unit == "page" else f"|{unit}" + ("" if markup else "|content")
        self.cache_key = hashlib.sha256(vocab.encode()).hexdigest()[:16]
        self._loaded: OrderedDict[int, dict] = OrderedDict()
        self._in_memory = shards_in_memory
        self._statistics: dict[str, float] | None = None

    def __len__(self) -> int:
        return self.offsets[-1]

    @property
    def shard_sizes(self) -> list[int]:
        """Examples per shard (pages; in element mode, elements, known after :meth:`prepare`)."""
        if self.unit == "element":
            self.prepare()
            return list(self._sizes)
        return [s.live for s in self.shards]

    def _element_offsets(self) -> None:
        """In element mode a shard holds as many examples as its pages' trainable elements: the
        counts are known once every shard is tokenised (or read from its cache)."""
        sizes = [len(self._load(index)["page_ids"]) for index in range(len(self.shards))]
        self.offsets = np.cumsum([0, *sizes]).tolist()
        self._sizes = sizes
        if not self.offsets[-1]:
            raise InvalidPageError(f"training dataset {self.store.root} holds no element with a box and content")

    def _cache_path(self, shard: ShardInfo) -> Path:
        """Shard files never change, but their live rows do (a newer shard supersedes some): a shard
        with dead rows is cached under the hash of its live ids too."""
        tag = shard.name.removesuffix(".parquet")
        if shard.dead:
            live = self.store.unit_page_ids({"shard": shard.name, "page_ids": None})
            tag += "-" + hashlib.sha256("\n".join(live).encode()).hexdigest()[:12]
        return self.store.root / TOKEN_CACHE_DIR / f"{tag}-{self.cache_key}.npz"

    def _tokenise(self, shard: ShardInfo) -> dict:
        pages = self.store.shard_pages(shard)
        if self.unit == "element":
            return self._encode(*self._element_units(pages, self.markup))
        return self._encode([self._page_unit(page) for page in pages])

    def _page_unit(self, page: Page) -> tuple[Page, str, object, int | None, str | None]:
        """(page, target markup, C(x), element index, category) of a whole-page example."""
        if not page.markup.strip():
            raise InvalidPageError(f"page {page.page_id} in {self.store.root} has empty markup; curation should drop it")
        return page, page.markup, page.meta.get("consistency"), None, None

    @staticmethod
    def _element_units(pages: list[Page], markup: bool = True) -> tuple[list[tuple[Page, str, object, int | None, str | None]], int]:
        """One unit per trainable element (its own C where mining gave one, else the page's), and
        how many elements were dropped."""
        units, dropped = [], 0
        for page in pages:
            kept, lost = element_targets(page, markup=markup)
            dropped += lost
            per_element = page.meta.get("element_consistency")
            for index, category, target in kept:
                own = per_element[index] if per_element and index < len(per_element) else None
                units.append((page, target, page.meta.get("consistency") if own is None else own, index, category))
        return units, dropped

    def _encode(self, units: list[tuple[Page, str, object, int | None, str | None]], dropped: int | None = None) -> dict:
        """Token ids and per-example arrays of a shard's units (element units add boxes and categories)."""
        ids, lengths, finished, consistency = [], [], [], []
        for page, target, value, _, _ in units:
            if value is not None and not 0.0 <= float(value) <= 1.0:
                raise InvalidPageError(f"page {page.page_id} has consistency {value}; expected a value in [0, 1]")
            tokens, ok = encode_markup(self.tokenizer, target, self.max_tokens)
            ids += tokens
            lengths.append(len(tokens))
            finished.append(ok)
            consistency.append(math.nan if value is None else float(value))
        arrays = {"page_ids": np.array([u[0].page_id for u in units], dtype=str),
                  "images": np.array([u[0].image for u in units], dtype=str),
                  "ids": np.array(ids, dtype=np.int32), "offsets": np.cumsum([0, *lengths]).astype(np.int64),
                  "ends_with_eos": np.array(finished, dtype=bool),
                  "consistency": np.array(consistency, dtype=np.float64)}
        if dropped is not None:
            arrays |= {"boxes": np.array([u[0].elements[u[3]].bbox for u in units], dtype=np.float64).reshape(-1, 4),
                       "categories": np.array([u[4] for u in units], dtype=str), "dropped": np.array(dropped, dtype=np.int64)}
        return arrays

    def _load(self, index: int) -> dict:
        if index in self._loaded:
            self._loaded.move_to_end(index)
            return self._loaded[index]
        shard = self.shards[index]
        path = self._cache_path(shard)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not path.exists():  # another rank may have written it while this one waited
                    arrays = self._tokenise(shard)
                    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                    with open(tmp, "wb") as handle:
                        np.savez(handle, **arrays)
                    os.replace(tmp, path)
        with np.load(path, allow_pickle=False) as cached:
            arrays = {key: cached[key] for key in cached.files}
        self._loaded[index] = arrays
        while len(self._loaded) > self._in_memory:
            self._loaded.popitem(last=False)
        return arrays

    def prepare(self) -> dict[str, float]:
        """Tokenise (or read) every shard once, validating every record; returns token statistics
        (computed on the first call, which reads every shard's cache; later calls reuse them)."""
        if self._statistics is not None:
            return self._statistics
        count = total = longest = truncated = dropped = 0
        for index in range(len(self.shards)):
            arrays = self._load(index)
            lengths = np.diff(arrays["offsets"])
            count, total = count + len(lengths), total + int(lengths.sum())
            longest = max(longest, int(lengths.max(initial=0)))
            truncated += int((~arrays["ends_with_eos"]).sum())
            dropped += int(arrays["dropped"]) if "dropped" in arrays else 0
        if self.unit == "element":
            self._element_offsets()
        self._statistics = {"n_examples": count, "mean_tokens": total / max(count, 1), "max_tokens": longest,
                            "truncated": truncated}
        if self.unit == "element":
            self._statistics["dropped_elements"] = dropped
            if dropped:
                print(f"[data] {self.store.root.name}: dropped {dropped} element(s) with no content or no pixels")
        return self._statistics

    def __getitem__(self, position: int) -> Example:  # type: ignore[override]
        if not 0 <= position < len(self):
            raise IndexError(position)
        index = bisect.bisect_right(self.offsets, position) - 1
        row = position - self.offsets[index]
        arrays = self._load(index)
        start, stop = int(arrays["offsets"][row]), int(arrays["offsets"][row + 1])
        consistency = float(arrays["consistency"][row])
        box = tuple(float(v) for v in arrays["boxes"][row]) if "boxes" in arrays else None
        return Example(str(arrays["page_ids"][row]), self.store.root / str(arrays["images"][row]),
                       tuple(int(t) for t in arrays["ids"][start:stop]), bool(arrays["ends_with_eos"][row]),
                       None if math.isnan(consistency) else consistency, box,
                       str(arrays["categories"][row]) if "categories" in arrays else None)


def load_examples(root: str | Path, tokenizer: PreTrainedTokenizerFast, max_tokens: int,
                  unit: str = "page", markup: bool = True) -> ShardedExamples:
    """The store's examples (pages, or their elements), every shard tokenised (or read from its
    cache) and validated now (``markup``: see :func:`element_targets`)."""
    examples = ShardedExamples(root, tokenizer, max_tokens, unit=unit, markup=markup)
    examples.prepare()
    return examples


def dataset_fingerprint(root: str | Path) -> dict[str, str | int]:
    """Which data a model was trained on: folder, the store's content fingerprint, page count."""
    dataset = PageDataset(root)
    return {"path": str(Path(root).resolve()), "pages_sha256": dataset.fingerprint(), "n_pages": len(dataset)}


class _EpochStream:
    """Position p of an endless stream of example indices, shuffled in blocks of shards.

    Epoch e visits the shards in a seeded order, ``mix`` shards at a time; the rows of those
    shards are shuffled together. So the stream reads a few shards at a time (bounded memory,
    sequential reads) and still mixes pages across shards; with one shard it is a plain
    per-epoch permutation. A pure function of (seed, source, position): resuming needs no state.
    """

    def __init__(self, sizes: Sequence[int] | int, seed: int, source_id: int, mix: int = 4):
        self.sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        self.size = sum(self.sizes)
        self.offsets = np.cumsum([0, *self.sizes])
        self.seed, self.source_id, self.mix = seed, source_id, mix
        self._blocks: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._orders: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's shard order and the cumulative sizes of its blocks of ``mix`` shards."""
        if epoch not in self._orders:
            order = np.random.default_rng([self.seed, self.source_id, epoch]).permutation(len(self.sizes))
            block_sizes = [sum(self.sizes[i] for i in order[b : b + self.mix]) for b in range(0, len(order), self.mix)]
            self._orders[epoch] = (order, np.cumsum([0, *block_sizes]))
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def _block(self, epoch: int, block: int) -> np.ndarray:
        """Example indices of one block of shards, shuffled."""
        key = (epoch, block)
        if key not in self._blocks:
            order, _ = self._order(epoch)
            members = order[block * self.mix : (block + 1) * self.mix]
            rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in members])
            self._blocks[key] = rows[np.random.default_rng([self.seed, self.source_id, epoch, 1 + block]).permutation(len(rows))]
            while len(self._blocks) > 4:
                self._blocks.popitem(last=False)
        return self._blocks[key]

    def __getitem__(self, position: int) -> int:
        epoch, offset = divmod(position, self.size)
        _, block_offsets = self._order(epoch)
        block = int(np.searchsorted(block_offsets, offset, side="right")) - 1
        return int(self._block(epoch, block)[offset - block_offsets[block]])


class BatchPlan:
    """Which examples form each micro-batch of each rank at each step."""

    def __init__(
        self, n_base: Sequence[int] | int, n_hard: Sequence[int] | int, hard_ratio: float, seed: int, micro_batch: int,
        grad_accum: int, world_size: int,
    ):
        """``n_base``/``n_hard``: example counts, or per-shard counts to shuffle in blocks of shards."""
        self.global_batch = micro_batch * grad_accum * world_size
        self.micro_batch, self.grad_accum, self.world_size = micro_batch, grad_accum, world_size
        self.seed = seed
        n_hard_total = n_hard if isinstance(n_hard, int) else sum(n_hard)
        self.n_hard_per_batch = round(hard_ratio * self.global_batch) if n_hard_total else 0
        if hard_ratio > 0 and self.n_hard_per_batch == 0:
            raise ValueError(f"hard_ratio {hard_ratio} gives no hard page in a global batch of {self.global_batch}")
        self.base = _EpochStream(n_base, seed, 0)
        self.hard = _EpochStream(n_hard, seed, 1) if n_hard_total else None

    def global_indices(self, step: int) -> list[tuple[str, int]]:
        """(source, index) for every sample of the step's global batch, in a seeded shuffle."""
        n_hard = self.n_hard_per_batch
        n_base = self.global_batch - n_hard
        chosen = [("base", self.base[step * n_base + i]) for i in range(n_base)]
        if self.hard is not None:
            chosen += [("hard", self.hard[step * n_hard + i]) for i in range(n_hard)]
        order = np.random.default_rng([self.seed, 2, step]).permutation(len(chosen))
        return [chosen[i] for i in order]

    def micro_indices(self, step: int, micro: int, rank: int) -> list[tuple[str, int]]:
        start = (micro * self.world_size + rank) * self.micro_batch
        return self.global_indices(step)[start : start + self.micro_batch]

    def epoch_of(self, step: int) -> float:
        n_base = self.global_batch - self.n_hard_per_batch
        return step * n_base / self.base.size


def token_statistics(examples: Sequence[Example]) -> dict[str, float]:
    """Counts and lengths of a list of examples (a :class:`ShardedExamples` reads its shards' caches)."""
    if isinstance(examples, ShardedExamples):
        return examples.prepare()
    lengths = [len(e.token_ids) for e in examples]
    return {"n_examples": len(lengths), "mean_tokens": float(np.mean(lengths)) if lengths else 0.0,
            "max_tokens": max(lengths, default=0), "truncated": sum(not e.ends_with_eos for e in examples)}


class TrainingData:
    """The examples of a run plus the plan that batches them."""

    def __init__(
        self,
        base: Sequence[Example],
        hard: Sequence[Example] | None,
        plan: BatchPlan,
        pad_id: int,
        consistency_beta: float,
        preprocess: Callable[..., PageInputs],
        prompt_style: str = "none",
    ):
        self.sources: dict[str, Sequence[Example]] = {"base": base, "hard": hard or []}
        self.plan = plan
        self.pad_id = pad_id
        self.beta = consistency_beta
        self.preprocess = preprocess
        self.prompt_style = prompt_style

    def batch(self, step: int, micro: int, rank: int) -> Batch:
        picked = [self.sources[source][index] for source, index in self.plan.micro_indices(step, micro, rank)]
        return collate(picked, self.pad_id, self.beta, self.preprocess, self.prompt_style)

    def batches(self, start_step: int, stop_step: int, rank: int, workers: int = 0) -> Iterator[Batch]:
        """The rank's micro-batches of steps ``[start_step, stop_step)`` in order. With ``workers``,
        DataLoader worker processes read the token caches, decode and preprocess the images ahead
        of the training loop (``preprocess`` must then work on CPU tensors)."""

        accum = self.plan.grad_accum
        items = _MicroBatches(self, rank, start_step * accum)
        loader = DataLoader(items, batch_size=None, shuffle=False, num_workers=workers, collate_fn=_identity,
                            prefetch_factor=2 if workers else None, persistent_workers=False)
        for _, batch in zip(range((stop_step - start_step) * accum), loader, strict=False):
            yield batch

    def token_statistics(self) -> dict[str, float]:
        parts = [token_statistics(source) for source in self.sources.values() if len(source)]
        count = sum(p["n_examples"] for p in parts)
        return {"n_examples": count, "mean_tokens": sum(p["mean_tokens"] * p["n_examples"] for p in parts) / max(count, 1),
                "max_tokens": max(p["max_tokens"] for p in parts), "truncated": sum(p["truncated"] for p in parts)}


def _identity(batch: Batch) -> Batch:
    return batch


class _MicroBatches(torch.utils.data.Dataset):
    """Micro-batch ``k`` of a rank, counted from ``first`` (k = step * grad_accum + micro)."""

    def __init__(self, data: TrainingData, rank: int, first: int):
        self.data, self.rank, self.first = data, rank, first

    def __len__(self) -> int:
        return 1 << 40  # endless: the caller stops at its last step

    def __getitem__(self, k: int) -> Batch:
        step, micro = divmod(self.first + k, self.data.plan.grad_accum)
        return self.data.batch(step, micro, self.rank)


def example_image(example: Example) -> Image.Image:
    """The page image, or in element mode the element's native-resolution crop."""
    image = load_image(example.image_path)
    return image if example.box is None else native_crop(image, example.box)


def collate(
    examples: list[Example], pad_id: int, consistency_beta: float, preprocess: Callable[..., PageInputs],
    prompt_style: str = "none",
) -> Batch:
    """Pad token ids to the batch maximum, preprocess images (element crops with their task
    prompts, for families that take them), compute Stage-2 weights."""
    width = max(len(e.token_ids) for e in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    for row, example in enumerate(examples):
        tokens[row, : len(example.token_ids)] = torch.tensor(example.token_ids)
    consistency = torch.tensor(
        [math.nan if e.consistency is None else e.consistency for e in examples], dtype=torch.float32
    )
    images = [example_image(e) for e in examples]
    if prompt_style != "none" and any(e.category for e in examples):
        pages = preprocess(images, [task_prompt(prompt_style, e.category) if e.category else None for e in examples])
    else:
        pages = preprocess(images)
    return Batch(
        pages=pages,
        tokens=tokens,
        lengths=torch.tensor([len(e.token_ids) for e in examples]),
        ends_with_eos=torch.tensor([e.ends_with_eos for e in examples]),
        weights=consistency_weights(consistency, consistency_beta),
        page_ids=[e.page_id for e in examples],
    )
