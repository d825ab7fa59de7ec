"""docmarkup-reader: an element model for real documents, built on a pretrained line recogniser.

The vision tower is PP-OCRv6's text-line recogniser (:mod:`models.ocr_encoder`, frozen; run in
onnxruntime on CPU): on a page, the reader reads the lines the page front end's detector found
(:mod:`components.parsing.frontend`, one crop per line, marked ``TEXT_LINE_INFO``); an element crop
without a detector (the ground-truth layout, training) is cut into its lines by its ink profile
(:func:`find_lines`). Each line is encoded at 48 pixels high, and its CTC frames are collapsed
greedily (one frame per character the recogniser emits).
Each kept frame becomes one prefix slot: the tower's 120-d feature, projected, plus the mean of
the decoder's own token embedding of each of the character's UTF-8 bytes, one slot per byte (the
embedding table is shared, so a slot says which byte the tower saw in the decoder's own terms). A start slot carries the
element's line height (titles are set larger), a separator slot before every line its
indentation in characters (code keeps its indentation). A Qwen2 decoder over byte tokens
writes the element's text; the layout's category gives its form (``writes_markup: false``).

Positions align reading with writing: prefix slot ``j`` gets the RoPE position ``P + j - 2``
(``P`` the prefix length), so token ``k`` (position ``P + k``, ``<bos>`` at 0) sits at the
same position as the slot of the ``k``-th character it has to write: copying is attention at
relative distance 0, which a small decoder learns in a few hundred CPU steps. The engine's
positions are unchanged (tokens continue at ``P + k``); only the prefix's are chosen here, once,
in :meth:`ReaderForConditionalGeneration.prefill` and in the training forward alike.

The copy prior: every logit gets ``copy_gate`` added on the token of the slot that shares its
position (:meth:`ReaderForConditionalGeneration.copy_bias`), in training and in every decoder (the
engine's ``adjust_logits`` hook). A fresh reader (gate 12, decoder random) therefore writes the
recogniser's collapsed CTC reading token for token and stops at the end slot; training moves away
from that reading only where its targets say so.

The model implements :class:`models.interface.TrainableMarkupLM`, so every decoder of the engine
decodes it and every objective of the mix trains it. Batches of elements have prefixes of
different lengths: they are right-padded, and the padding is hidden by ``prefix_valid`` (the
engine reads it off the prefill's cache).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from huggingface_hub.dataclasses import strict
from PIL import Image
from torch import nn
from transformers import (
    AutoConfig,
    DynamicCache,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.configuration_utils import SubConfigSpec

from models.docvlm import attention_implementations
from models.interface import TEXT_LINE_INFO, PagePrefix
from models.ocr_encoder import (
    COLUMN_STRIDE,
    LINE_HEIGHT,
    OnnxRecognizer,
    load_ppocr_recognizer,
    ppocr_charset,
    ppocr_recognizer_path,
)
from models.qwen2_decoder import Qwen2DecoderMixin
from models.tokenizer import special_token_ids, train_markup_tokenizer

MODEL_TYPE = "docmarkup_reader"
INK_THRESHOLD = 170  # a pixel darker than this is ink
LINE_MARGIN = 3  # pixels kept around a line's ink
# White columns (at 48 px high) before and after a line: the recogniser's CTC emits a line's first
# and last characters only with blank columns around them (RapidOCR pads its crops too); without
# them "will" read as "wil" and "list" as "ist" on real pages.
QUIET_LEFT, QUIET_RIGHT = 8, 16
MAX_BYTES = 4  # UTF-8 bytes of one character
FIRST_CHARACTER_SLOT = 2  # slot 0 is the start, slot 1 the first line's separator
MAX_CACHED_LINES = 200_000
TOWER_CACHE_ENV = "DOCMARKUP_READER_TOWER_CACHE"  # a file keeping the tower's frames of training lines
CACHE_SAVE_EVERY = 4000  # new lines between saves of that file
RULE_COVER = 0.9  # a column inked over this share of a crop's rows is a vertical rule
MIN_RULED_HEIGHT = 48  # crop rows from which such a column can be a rule (a 144-dpi text line is ~20)
SLOTS_BOUND = 6  # CTC columns one character takes at most (measured ~2.4 on 144-dpi pages)
COLUMNS_PER_CHARACTER = 2.0  # fewer than measured, so that a piece's slots are over-estimated
PIECE_FILL = 0.75  # a reading piece's estimated slots, as a share of the training prefix budget
COPY_PRIOR = 12.0  # a new reader's copy gate: above a random decoder's logit spread, so it copies
SPACE_TOKEN = "Ġ"  # the byte-level tokenizer's space
OUTPUT_SLACK, OUTPUT_MARGIN = 4, 16  # tokens written at most: slots + slots / 4 + 16 (one per slot when read right)


@strict
class ReaderConfig(PreTrainedConfig):
    """Config of :class:`ReaderForConditionalGeneration` (saved as ``config.json``)."""

    model_type = MODEL_TYPE
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="qwen2")}

    text_config: dict | PreTrainedConfig | None = None
    feature_size: int = 120  # the tower's feature per CTC frame
    num_classes: int = 18710  # the tower's CTC classes, 0 the blank
    tower_sha256: str = ""  # of the ONNX recogniser the tower is built from (checked on load)
    max_line_width: int = 2048  # pixels at 48 high; a longer line is squeezed to it
    width_bucket: int = 64  # a line's width is padded up to a multiple of this (never to its batch's)
    height_buckets: int = 96  # line heights in page pixels the start slot tells apart
    indent_buckets: int = 48  # indentations in characters a separator slot tells apart
    # While training, a prefix is cut to this many slots: targets are cut to data.max_tokens, and the
    # slots past them only cost time (one long element pads a whole batch to its length).
    max_train_slots: int = 448
    # False: the reader writes an element's text and the layout's category gives its form (# title,
    # code fence), so every written token has a slot; True: it writes the markup form itself.
    writes_markup: bool = False
    # The copy prior: the logit of the byte the position-aligned slot stands for gets ``copy_gate``
    # added (a learned scalar that starts here), so an untrained decoder writes the recogniser's
    # collapsed CTC reading and training departs from it only where the data says so. 0 = none (the
    # readers trained before it). A line separator slot stands for ``separator_token_id`` (a space).
    copy_prior: float = 0.0
    # The least weight the copy prior keeps where the recogniser was unsure of a character (its CTC
    # probability is the weight otherwise): on scans the recogniser is unsure of many characters, and a
    # decoder that has not learned them writes worse than the copy. 0 = the probability as it is.
    copy_floor: float = 0.0
    separator_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    init_token_id: int | None = None
    mask_token_id: int | None = None
    attn_implementation_preference: Literal["sdpa", "eager"] = "sdpa"
    tie_word_embeddings: bool = True


def reader_config(vocab_size: int, special_ids: dict[str, int], **overrides) -> ReaderConfig:
    """The shipped reader's shape: a 4-layer, 192-wide Qwen2 decoder over byte tokens."""
    text = Qwen2Config(
        vocab_size=vocab_size, hidden_size=192, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
        intermediate_size=512, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=10000.0,
    )
    return ReaderConfig(text_config=text, tower_sha256=_file_sha256(ppocr_recognizer_path()), **special_ids,
                        **overrides)


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ----- lines of a crop --------------------------------------------------------------------------
def find_lines(gray: np.ndarray, ink_threshold: int = INK_THRESHOLD) -> list[tuple[int, int, int, int]]:
    """Text lines of a crop (x0, y0, x1, y1), top to bottom, from its horizontal ink profile.

    Runs of inked rows are lines; a run much taller than the typical line (touching
    descenders and ascenders) is cut at its least-inked row; slivers (a rule, an accent alone) join
    the nearest line when close to it and are dropped otherwise. In a crop taller than a line, a
    column inked over nearly its whole height is a rule (code listings' line-number bar, a frame)
    and is not ink: it would join every line into one."""
    ink = gray < ink_threshold
    if gray.shape[0] >= MIN_RULED_HEIGHT:
        ink &= ~(ink.mean(axis=0) >= RULE_COVER)
    rows = ink.sum(axis=1)
    runs: list[list[int]] = []
    start = None
    for y, count in enumerate([*rows.tolist(), 0]):
        if count and start is None:
            start = y
        elif not count and start is not None:
            runs.append([start, y])
            start = None
    if not runs:
        return []
    typical = float(np.median([b - a for a, b in runs]))
    split: list[list[int]] = []
    for a, b in runs:
        while b - a > 1.8 * typical and typical >= 4:
            low, high = a + int(0.6 * typical), b - int(0.6 * typical)
            if high <= low:
                break
            cut = low + int(np.argmin(rows[low:high]))
            split.append([a, cut])
            a = cut
        split.append([a, b])
    typical = float(np.median([b - a for a, b in split]))
    lines: list[list[int]] = []
    for a, b in split:
        if b - a >= 0.4 * typical:
            lines.append([a, b])
    if not lines:
        lines = [max(split, key=lambda r: r[1] - r[0])]
    for a, b in split:  # slivers: join a line within reach
        if b - a < 0.4 * typical:
            nearest = min(lines, key=lambda r: min(abs(a - r[1]), abs(r[0] - b)))
            if min(abs(a - nearest[1]), abs(nearest[0] - b)) <= 0.35 * typical:
                nearest[0], nearest[1] = min(nearest[0], a), max(nearest[1], b)
    boxes = []
    for a, b in sorted(lines):
        columns = np.flatnonzero(ink[a:b].any(axis=0))
        boxes.append((int(columns[0]), a, int(columns[-1]) + 1, b))
    return boxes


def main_line(gray: np.ndarray, ink_threshold: int = INK_THRESHOLD) -> list[tuple[int, int, int, int]]:
    """The ink of a detector's line crop: of the ink runs, the one with the most ink (the box may
    catch a neighbouring line's descenders or ascenders); its height is the line's."""
    boxes = find_lines(gray, ink_threshold)
    if len(boxes) <= 1:
        return boxes
    ink = gray < ink_threshold
    return [max(boxes, key=lambda b: int(ink[b[1]:b[3], b[0]:b[2]].sum()))]


def line_groups(gray: np.ndarray, max_slots: float) -> list[tuple[int, int]]:
    """Rows (top, bottom) cutting a crop into runs of whole lines whose estimated prefix slots stay
    within ``max_slots`` (a line of width w at height h fills about w·48/h / stride / columns-per-character
    slots); one run covering the crop when it fits whole. Cuts fall midway between two lines."""
    boxes = find_lines(gray)
    groups: list[list[tuple[int, int, int, int]]] = [[]]
    filled = 0.0
    for box in boxes:
        scale = LINE_HEIGHT / max(1, box[3] - box[1] + 2 * LINE_MARGIN)
        slots = (box[2] - box[0]) * scale / COLUMN_STRIDE / COLUMNS_PER_CHARACTER + 1
        if groups[-1] and filled + slots > max_slots:
            groups.append([])
            filled = 0.0
        groups[-1].append(box)
        filled += slots
    cuts = [(previous[-1][3] + following[0][1]) // 2 for previous, following in itertools.pairwise(groups)]
    edges = [0, *cuts, gray.shape[0]]
    return list(itertools.pairwise(edges))


def line_pixels(gray: np.ndarray, box: tuple[int, int, int, int], max_width: int) -> np.ndarray:
    """One line, ``LINE_HEIGHT`` pixels high, as the recogniser's input values (H, W) in [-1, 1]."""
    x0, y0, x1, y1 = box
    height, width = gray.shape
    crop = Image.fromarray(gray[max(0, y0 - LINE_MARGIN): min(height, y1 + LINE_MARGIN),
                                max(0, x0 - LINE_MARGIN): min(width, x1 + LINE_MARGIN)])
    scaled = min(max_width, max(16, round(crop.width * LINE_HEIGHT / max(1, crop.height))))
    crop = crop.resize((scaled, LINE_HEIGHT), Image.Resampling.BILINEAR)
    return np.asarray(crop, dtype=np.float32) / 127.5 - 1.0


@dataclass
class ReaderInputs:
    """Preprocessed element crops: their lines at 48 pixels, grouped by element (CPU-made, picklable)."""

    lines: list[torch.Tensor]  # each (48, W): W a multiple of the width bucket, white-padded
    widths: torch.Tensor  # (N,) the unpadded width of each line
    element: torch.Tensor  # (N,) which crop each line belongs to
    indent: torch.Tensor  # (N,) the line's left edge in crop pixels (from the leftmost line)
    span: torch.Tensor  # (N,) the line's width in crop pixels
    height: torch.Tensor  # (B,) the crop's median line height in page pixels
    n_elements: int

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ReaderInputs:
        return ReaderInputs([t.to(device=device, dtype=dtype) for t in self.lines], self.widths.to(device),
                            self.element.to(device), self.indent.to(device), self.span.to(device), self.height.to(device),
                            self.n_elements)


def reader_inputs(images: list[Image.Image], max_line_width: int = 2048, width_bucket: int = 64) -> ReaderInputs:
    """Cut each crop into lines and scale them for the tower (a crop with no ink gets no lines)."""
    lines, widths, owner, indent, span, heights = [], [], [], [], [], []
    for index, image in enumerate(images):
        gray = np.asarray(image.convert("L"))
        boxes = main_line(gray) if image.info.get(TEXT_LINE_INFO) else find_lines(gray)
        heights.append(float(np.median([b[3] - b[1] for b in boxes])) if boxes else 0.0)
        if image.info.get(TEXT_LINE_INFO) and boxes:
            # the detector's box is the line as the recogniser reads it: descenders included (an ink
            # run cut at the baseline by a neighbour's ascenders would lose them), and its margins
            # kept (trimmed to the ink, "will" read as "wil" and "100." as "100" on real pages)
            boxes = [(0, 0, gray.shape[1], gray.shape[0])]
        left = min((b[0] for b in boxes), default=0)
        for box in boxes:
            pixels = line_pixels(gray, box, max_line_width)
            width = QUIET_LEFT + pixels.shape[1] + QUIET_RIGHT
            padded = -(-width // width_bucket) * width_bucket
            line = np.ones((LINE_HEIGHT, padded), dtype=np.float32)
            line[:, QUIET_LEFT:QUIET_LEFT + pixels.shape[1]] = pixels
            lines.append(torch.from_numpy(line))
            widths.append(width)
            owner.append(index)
            indent.append(box[0] - left)
            span.append(max(1, box[2] - box[0]))
    return ReaderInputs(lines, torch.tensor(widths, dtype=torch.long), torch.tensor(owner, dtype=torch.long),
                        torch.tensor(indent, dtype=torch.float32), torch.tensor(span, dtype=torch.float32), torch.tensor(heights, dtype=torch.float32),
                        len(images))


@dataclass
class ReaderPrefix(PagePrefix):
    """Right-padded element prefixes: ``valid`` (B, P) is False on padding; ``slot_tokens`` (B, P) the
    token each slot stands for (a character's byte, a separator, the end's ``<eos>``; -1 none) and
    ``slot_weights`` (B, P) how sure the recogniser was of it (its CTC frame's probability; 1 for a
    separator or the end)."""

    valid: torch.Tensor
    slot_tokens: torch.Tensor
    slot_weights: torch.Tensor

    def __getitem__(self, index) -> ReaderPrefix:
        return ReaderPrefix(self.embeds[index], self.valid[index], self.slot_tokens[index], self.slot_weights[index])


class _Tower:
    """The frozen recogniser, kept out of the module tree (its weights ship in the rapidocr wheel,
    checked by hash, not in our checkpoint); it returns (CTC probabilities, features) per frame. On
    CPU it runs in onnxruntime (the converted module is ~10x slower there); on an accelerator the
    converted torch module runs on the model's device."""

    def __init__(self, expected_sha256: str):
        self.path = ppocr_recognizer_path()
        if expected_sha256 and _file_sha256(self.path) != expected_sha256:
            raise ValueError(f"{self.path} is not the recogniser this reader was trained on (sha256 differs): "
                             "install the rapidocr version named in requirements")
        self._module: nn.Module | None = None
        self._onnx: OnnxRecognizer | None = None
        self._captured: list[torch.Tensor] = []
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    @property
    def module(self) -> nn.Module:
        if self._module is None:
            module = load_ppocr_recognizer(self.path)
            for parameter in module.parameters():
                parameter.requires_grad_(False)
            head = dict(module.named_modules())["MatMul/12"]  # the CTC head's matmul: its input is the feature
            head.register_forward_hook(lambda _m, inputs, _out: self._captured.append(inputs[0]))
            self._module = module.to(self.device, self.dtype)
        return self._module

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self.device = torch.device(device) if device is not None else self.device
        self.dtype = dtype if dtype is not None and dtype.is_floating_point else self.dtype
        if self._module is not None:
            self._module.to(self.device, self.dtype)

    @torch.no_grad()
    def __call__(self, lines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type == "cpu":
            if self._onnx is None:
                self._onnx = OnnxRecognizer(self.path)
            return self._onnx(lines)
        self._captured.clear()
        probs = self.module(lines.to(self.device, self.dtype)[:, None].expand(-1, 3, -1, -1))
        return probs, self._captured.pop()


class FrameCache:
    """The frozen tower's frames of lines already seen, keyed by the line's pixels: one per tower
    (its sha256) for the whole process, so every reader on that tower shares it: training epochs,
    the next training run, and repeated reads of the same pages (a benchmark's rounds) pay for the
    tower once. With TOWER_CACHE_ENV naming a file it is loaded from there and saved there while
    training, so the next phase or a resumed run in another process starts warm."""

    def __init__(self, tower_sha256: str | None):
        self.tower_sha256 = tower_sha256
        self.lines: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        path = os.environ.get(TOWER_CACHE_ENV)
        if path and Path(path).is_file() and tower_sha256:
            stored = torch.load(path, weights_only=True)
            if stored.get("tower_sha256") == tower_sha256:
                self.lines = {k: (c, f.float()) for k, (c, f) in stored["lines"].items()}
        self.saved_size = len(self.lines)

    def __len__(self) -> int:
        return len(self.lines)

    @property
    def full(self) -> bool:
        return len(self.lines) >= MAX_CACHED_LINES

    def save_if_grown(self) -> None:
        """Write the file (rank 0 only) once CACHE_SAVE_EVERY new lines have come in."""
        path = os.environ.get(TOWER_CACHE_ENV)
        if not path or len(self.lines) - self.saved_size < CACHE_SAVE_EVERY or int(os.environ.get("RANK", "0")):
            return
        lines = {k: (c, f.half()) for k, (c, f) in self.lines.items()}
        partial = Path(path).with_suffix(".partial")
        torch.save({"tower_sha256": self.tower_sha256, "lines": lines}, partial)
        partial.replace(path)
        self.saved_size = len(self.lines)


_FRAME_CACHES: dict[str | None, FrameCache] = {}
_KEEP_INFERENCE_FRAMES = False


def frame_cache(tower_sha256: str | None) -> FrameCache:
    """The process's frame cache of this tower (created, and loaded from TOWER_CACHE_ENV, on first use)."""
    if tower_sha256 not in _FRAME_CACHES:
        _FRAME_CACHES[tower_sha256] = FrameCache(tower_sha256)
    return _FRAME_CACHES[tower_sha256]


def keep_frames_at_inference(enabled: bool = True) -> None:
    """Reuse the tower's frames of lines read before at inference too (off by default: a server
    sees each page once, and the cache would only grow). Loops that read the same pages with one
    model after another (the annotation loop's rounds) turn it on."""
    global _KEEP_INFERENCE_FRAMES
    _KEEP_INFERENCE_FRAMES = enabled


class ReaderForConditionalGeneration(Qwen2DecoderMixin, PreTrainedModel):
    """Line recogniser prefix + byte-level Qwen2 decoder; implements :class:`models.interface.TrainableMarkupLM`."""

    takes_task_prompts = False  # the crop alone says what it is: its line height, its font, its indentation
    # On a page with a detected layout it reads the text lines the page front end's detector found
    # (components.parsing.frontend), one crop per line; the front end makes the blocks.
    reads_text_lines = True
    config_class = ReaderConfig
    base_model_prefix = "reader"
    main_input_name = "pixel_values"
    _supports_sdpa = True
    supports_gradient_checkpointing = True
    _tied_weights_keys = {"language_model.lm_head.weight": "language_model.model.embed_tokens.weight"}

    def __init__(self, config: ReaderConfig):
        super().__init__(config)
        _, text_attn = attention_implementations(config.attn_implementation_preference)
        config.text_config._attn_implementation = text_attn
        hidden = config.text_config.hidden_size
        self.feature_projector = nn.Sequential(
            nn.LayerNorm(config.feature_size + 1), nn.Linear(config.feature_size + 1, hidden), nn.GELU(),
            nn.Linear(hidden, hidden))
        self.start_embedding = nn.Embedding(config.height_buckets, hidden)
        self.separator_embedding = nn.Embedding(config.indent_buckets, hidden)
        self.end_embedding = nn.Parameter(torch.zeros(hidden))
        self.copy_gate = nn.Parameter(torch.full((1,), float(config.copy_prior)))  # 1-d: DeepSpeed broadcasts no 0-d
        self.language_model = Qwen2ForCausalLM(config.text_config)
        # The byte tokens of each tower class (-1 padded): set by new_reader_model from the tokenizer.
        self.register_buffer("class_bytes", torch.full((config.num_classes, MAX_BYTES), -1, dtype=torch.long))
        self._tower: _Tower | None = None
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """A checkpoint saved before the copy prior has no ``copy_gate``: it starts at the config's
        ``copy_prior`` (0 for those), never at uninitialised memory."""
        if module is self:
            with torch.no_grad():
                self.copy_gate.fill_(float(self.config.copy_prior))
            return
        super()._init_weights(module)

    # ----- the tower ---------------------------------------------------------------------------
    @property
    def tower(self) -> _Tower:
        if self._tower is None:
            self._tower = _Tower(self.config.tower_sha256)
            self._tower.to(self.device)
        return self._tower

    def _apply(self, fn, recurse=True):
        """``.to()`` and casts move the (unregistered) tower along."""
        result = super()._apply(fn, recurse)
        if self._tower is not None:
            self._tower.to(self.device, self.dtype)
        return result

    def line_frames(self, lines: list[torch.Tensor], widths: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per line: the collapsed CTC frames' classes (n,) and features (n, feature + 1), the extra
        column the frame's probability. Lines of one padded width run as one batch; while training
        (or reading with :func:`keep_frames_at_inference` on), a line already seen is not run again:
        the tower is frozen, so its frames cannot change."""
        cache = frame_cache(self.config.tower_sha256) if self.training or _KEEP_INFERENCE_FRAMES else None
        if cache is not None and cache.full:
            cache = None
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(lines)
        todo: dict[int, list[int]] = {}
        keys: list[bytes | None] = [None] * len(lines)
        for i, line in enumerate(lines):
            if cache is not None:
                keys[i] = hashlib.blake2b(line.float().cpu().numpy().tobytes(), digest_size=16).digest() \
                    + int(widths[i]).to_bytes(4, "little")
                if keys[i] in cache.lines:
                    classes, features = cache.lines[keys[i]]
                    if features.is_inference() and not torch.is_inference_mode_enabled():
                        # kept by a read under inference mode: autograd cannot save such a tensor
                        classes, features = classes.clone(), features.clone()
                        cache.lines[keys[i]] = (classes, features)
                    out[i] = (classes.to(self.device), features.to(self.device, self.dtype))
                    continue
            todo.setdefault(line.shape[-1], []).append(i)
        for _, members in sorted(todo.items()):
            batch = torch.stack([lines[i] for i in members]).to(self.device, self.tower_dtype)
            probs, features = self.tower(batch)
            for row, i in enumerate(members):
                columns = -(-int(widths[i]) // COLUMN_STRIDE)
                best_p, best = probs[row, :columns].float().max(-1)
                keep = best != 0
                keep[1:] &= best[1:] != best[:-1]
                frame = torch.cat([features[row, :columns][keep].float(), best_p[keep, None]], dim=-1)
                out[i] = (best[keep], frame.to(self.dtype))
                if cache is not None:
                    cache.lines[keys[i]] = (best[keep].cpu(), frame.cpu())
        if cache is not None and self.training:
            cache.save_if_grown()
        return out  # type: ignore[return-value]

    @property
    def tower_dtype(self) -> torch.dtype:
        return self.tower.dtype

    # ----- the prefix ---------------------------------------------------------------------------
    def cpu_preprocessor(self):
        return functools.partial(reader_inputs, max_line_width=self.config.max_line_width,
                                 width_bucket=self.config.width_bucket)

    def preprocess(self, images: list[Image.Image]) -> ReaderInputs:
        return self.cpu_preprocessor()(images).to(self.device)

    def reading_pieces(self, image: Image.Image) -> list[Image.Image]:
        """The crop as the pieces this reader reads well: runs of whole lines no longer than the
        prefixes it was trained on (a long element read whole loops or drifts past that length).
        Callers read the pieces and join their texts (see :mod:`components.parsing.pieces`)."""
        if image.info.get(TEXT_LINE_INFO):
            return [image]
        fill = PIECE_FILL * self.config.max_train_slots
        rows = line_groups(np.asarray(image.convert("L")), fill)
        if len(rows) == 1:
            return [image]
        return [image.crop((0, top, image.width, bottom)) for top, bottom in rows]

    @property
    def writes_markup(self) -> bool:
        return bool(self.config.writes_markup)

    def character_slots(self, classes: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """One slot per UTF-8 byte of each character the tower read: the decoder's own embedding of
        that byte token (shared table) plus the projected frame feature. A character the decoder
        writes as three byte tokens (’, —) takes three slots, so slots and written tokens stay aligned."""
        table = self.language_model.get_input_embeddings().weight
        ids = self.class_bytes[classes]  # (n, MAX_BYTES), -1 padded
        present = ids >= 0
        frame = torch.arange(len(classes), device=classes.device).repeat_interleave(present.sum(1))
        return table[ids[present]] + self.feature_projector(features)[frame]

    def encode_pages(self, inputs: ReaderInputs) -> ReaderPrefix:
        inputs = inputs.to(self.device)
        if self.training:  # lines past the training prefix budget are never seen: skip their tower run
            inputs = self._within_training_budget(inputs)
        frames = self.line_frames(inputs.lines, inputs.widths)
        config = self.config
        hidden = config.text_config.hidden_size
        pieces: list[list[torch.Tensor]] = [[] for _ in range(inputs.n_elements)]
        tokens: list[list[torch.Tensor]] = [[] for _ in range(inputs.n_elements)]
        weights: list[list[torch.Tensor]] = [[] for _ in range(inputs.n_elements)]
        one = torch.ones(1, device=self.device)
        none = torch.full((1,), -1, dtype=torch.long, device=self.device)
        separator = none if config.separator_token_id is None else torch.full_like(none, config.separator_token_id)
        heights = inputs.height.round().long().clamp(0, config.height_buckets - 1)
        for b in range(inputs.n_elements):
            pieces[b].append(self.start_embedding(heights[b])[None])
            tokens[b].append(none)
            weights[b].append(one)
        for i, (classes, features) in enumerate(frames):
            owner = int(inputs.element[i])
            if not len(classes):  # a run of ink the recogniser reads as nothing is no line to write
                continue
            # indentation in characters: the line's own crop pixels per character it holds
            indent = round(float(inputs.indent[i]) * len(classes) / float(inputs.span[i])) if len(classes) else 0
            pieces[owner].append(self.separator_embedding(torch.tensor([min(indent, config.indent_buckets - 1)],
                                                                        device=self.device)))
            tokens[owner].append(separator)
            weights[owner].append(one)
            pieces[owner].append(self.character_slots(classes, features))
            byte_ids = self.class_bytes[classes]
            tokens[owner].append(byte_ids[byte_ids >= 0])
            weights[owner].append(features[:, -1].float().repeat_interleave((byte_ids >= 0).sum(1)))
        eos = torch.full_like(none, -1 if config.eos_token_id is None else config.eos_token_id)
        for b in range(inputs.n_elements):
            if len(pieces[b]) == 1:  # nothing read: a separator keeps the end at the first token's slot
                pieces[b].append(self.separator_embedding(torch.zeros(1, dtype=torch.long, device=self.device)))
                tokens[b].append(none)
                weights[b].append(one)
            pieces[b].append(self.end_embedding[None])
            tokens[b].append(eos)
            weights[b].append(one)
        sequences = [torch.cat(p) for p in pieces]
        slot_ids = [torch.cat(t) for t in tokens]
        slot_probs = [torch.cat(w) for w in weights]
        if self.training:
            sequences = [s[: config.max_train_slots] for s in sequences]
            slot_ids = [t[: config.max_train_slots] for t in slot_ids]
            slot_probs = [w[: config.max_train_slots] for w in slot_probs]
        length = max(s.shape[0] for s in sequences)
        embeds = sequences[0].new_zeros(len(sequences), length, hidden)
        valid = torch.zeros(len(sequences), length, dtype=torch.bool, device=self.device)
        slot_tokens = torch.full((len(sequences), length), -1, dtype=torch.long, device=self.device)
        slot_weights = torch.zeros(len(sequences), length, device=self.device)
        for b, sequence in enumerate(sequences):
            embeds[b, : len(sequence)] = sequence
            valid[b, : len(sequence)] = True
            slot_tokens[b, : len(sequence)] = slot_ids[b]
            slot_weights[b, : len(sequence)] = slot_probs[b]
        return ReaderPrefix(embeds=embeds, valid=valid, slot_tokens=slot_tokens, slot_weights=slot_weights)

    def _within_training_budget(self, inputs: ReaderInputs) -> ReaderInputs:
        """Each element's first lines until they surely fill ``max_train_slots`` (a character takes at
        most ``SLOTS_BOUND`` CTC columns, so a line of c columns gives at least c / SLOTS_BOUND slots)."""
        columns = inputs.widths.float() / COLUMN_STRIDE / SLOTS_BOUND
        keep, filled = [], [0.0] * inputs.n_elements
        for i in range(len(inputs.lines)):
            owner = int(inputs.element[i])
            if filled[owner] < self.config.max_train_slots:
                keep.append(i)
            filled[owner] += float(columns[i]) + 1
        index = torch.tensor(keep, dtype=torch.long, device=inputs.widths.device)
        return ReaderInputs([inputs.lines[i] for i in keep], inputs.widths[index], inputs.element[index],
                            inputs.indent[index], inputs.span[index], inputs.height, inputs.n_elements)

    @staticmethod
    def prefix_positions(n_prefix: int, batch: int, device) -> torch.Tensor:
        """Slot ``j`` at ``P + j - 2``: the slot of the ``k``-th character shares token ``k``'s position."""
        return (torch.arange(n_prefix, device=device) + n_prefix - FIRST_CHARACTER_SLOT).expand(batch, -1)

    def copy_bias(self, logits: torch.Tensor, positions: torch.Tensor, slot_tokens: torch.Tensor,
                  slot_weights: torch.Tensor) -> torch.Tensor:
        """``logits`` (B, Q, V) of tokens at engine ``positions`` (B, Q) plus ``copy_gate`` × the
        recogniser's probability on the token of the slot sharing each one's position (slot ``j`` at
        ``P + j - 2``, see the module doc): a character the recogniser was unsure of is copied with
        less weight, so the reader's confidence and its samples (mining) show that doubt."""
        n_prefix = slot_tokens.shape[1]
        aligned = positions - n_prefix + FIRST_CHARACTER_SLOT
        inside = (aligned >= 0) & (aligned < n_prefix)
        slot = aligned.clamp(0, n_prefix - 1)
        target = torch.gather(slot_tokens, 1, slot)
        weight = torch.gather(slot_weights, 1, slot).clamp(min=float(self.config.copy_floor)) * (inside & (target >= 0))
        bias = torch.zeros_like(logits)
        bias.scatter_(-1, target.clamp(min=0)[..., None], weight[..., None].to(logits.dtype))
        return logits + self.copy_gate.to(logits.dtype) * bias

    def adjust_logits(self, logits: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, cache) -> torch.Tensor:
        """The engine's hook after every decoder forward: the copy prior for the rows still decoding."""
        slot_tokens = getattr(cache, "slot_tokens", None)
        if slot_tokens is None or not float(self.copy_gate.detach()):
            return logits
        rows = rows.to(logits.device)
        return self.copy_bias(logits, positions.to(logits.device), slot_tokens.to(logits.device)[rows],
                              cache.slot_weights.to(logits.device)[rows])

    # ----- training interface (the rest comes from Qwen2DecoderMixin) ---------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                prefix: ReaderPrefix, **_unused) -> dict[str, torch.Tensor]:
        """Token streams after the prefix: the prefix's positions are the reader's own, its padding hidden."""
        n_prefix = prefix.length
        positions = position_ids.clone()
        positions[:, :n_prefix] = self.prefix_positions(n_prefix, positions.shape[0], positions.device)
        mask = attention_mask.clone()
        mask[..., :n_prefix] &= prefix.valid[:, None, None, :]
        embeds = torch.cat([prefix.embeds, self.language_model.get_input_embeddings()(input_ids)], dim=1)
        out = self.language_model.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                         use_cache=False)
        logits = self.language_model.lm_head(out.last_hidden_state[:, n_prefix:])
        return {"logits": self.copy_bias(logits, position_ids[:, n_prefix:], prefix.slot_tokens, prefix.slot_weights)}

    # ----- decoding interface ---------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, images: list[Image.Image], prompt_ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
        """Encode the crops and run their prefixes once; the cache carries ``prefix_valid``."""
        prefix = self.encode_pages(self.preprocess(images))
        batch, n_prefix = prefix.valid.shape
        prompt_ids = prompt_ids.to(self.device)
        total = n_prefix + prompt_ids.shape[1]
        positions = torch.cat([self.prefix_positions(n_prefix, batch, self.device),
                               (torch.arange(prompt_ids.shape[1], device=self.device) + n_prefix).expand(batch, -1)], 1)
        mask = torch.tril(torch.ones(total, total, dtype=torch.bool, device=self.device)).expand(batch, 1, -1, -1).clone()
        mask[..., :n_prefix] &= prefix.valid[:, None, None, :]
        mask |= torch.eye(total, dtype=torch.bool, device=self.device)  # a padded slot sees itself: no empty softmax
        embeds = torch.cat([prefix.embeds, self.language_model.get_input_embeddings()(prompt_ids)], dim=1)
        cache = DynamicCache(config=self.config.text_config)
        out = self.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask, cache=cache,
                                  use_cache=True)
        cache.prefix_valid = prefix.valid
        cache.slot_tokens, cache.slot_weights = prefix.slot_tokens, prefix.slot_weights
        slots = prefix.valid.sum(1)
        cache.output_budget = (slots + slots // OUTPUT_SLACK + OUTPUT_MARGIN).tolist()
        prompt_logits = self.copy_bias(out.logits[:, n_prefix:], positions[:, n_prefix:], prefix.slot_tokens,
                                       prefix.slot_weights)
        return prompt_logits, cache


def class_byte_table(tokenizer, charset: list[str], max_bytes: int = MAX_BYTES) -> torch.Tensor:
    """(classes, max_bytes): the token ids of each tower class's character (row 0, the blank, empty)."""
    table = torch.full((len(charset) + 1, max_bytes), -1, dtype=torch.long)
    for index, character in enumerate(charset, start=1):
        ids = tokenizer(character, add_special_tokens=False)["input_ids"][:max_bytes]
        table[index, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return table


def byte_tokenizer():
    """A byte-level tokenizer with our special tokens and no merges: one token per UTF-8 byte."""

    return train_markup_tokenizer(["# title\n\n```\ncode\n```"], vocab_size=256 + 6, min_frequency=10**9)


def new_reader_model(seed: int = 0, **overrides) -> tuple[ReaderForConditionalGeneration, object]:
    """A freshly initialised reader (decoder random, tower pretrained) and its byte tokenizer."""

    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    overrides = {"copy_prior": COPY_PRIOR, "separator_token_id": tokenizer.convert_tokens_to_ids(SPACE_TOKEN)} | overrides
    model = ReaderForConditionalGeneration(reader_config(len(tokenizer), special_token_ids(tokenizer), **overrides))
    model.class_bytes.copy_(class_byte_table(tokenizer, ppocr_charset()))
    return model.eval(), tokenizer
