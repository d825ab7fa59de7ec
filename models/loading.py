"""Load any supported page-to-markup checkpoint from a local folder, tiny or real.

A model folder holds ``config.json`` + weights + tokenizer files (what ``save_pretrained``
writes). The config's ``model_type`` picks the family: ``docvlm`` is ours; Qwen2-VL-style
checkpoints of the Hugging Face doc-VLM families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, PaddleOCR-VL) go
through :mod:`models.hf_adapter`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from models.docvlm import DocVLMConfig, DocVLMForConditionalGeneration, base_config, tiny_config
from models.hf_adapter import SUPPORTED_MODEL_TYPES, HFMarkupModel
from models.interface import MarkupLM, TrainableMarkupLM
from models.reader import MODEL_TYPE as READER_MODEL_TYPE
from models.reader import ReaderForConditionalGeneration
from models.tokenizer import SPECIAL_TOKENS, load_tokenizer, special_token_ids

SUPPORTED_FAMILIES = ("docvlm", READER_MODEL_TYPE, *SUPPORTED_MODEL_TYPES)


class ModelLoadError(RuntimeError):
    """A model folder that is missing, incomplete, or of an unsupported family."""


def model_family(path: str | Path) -> str:
    config_file = Path(path) / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} is not a model folder (no config.json)")
    try:
        return json.loads(config_file.read_text())["model_type"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise ModelLoadError(f"{config_file} has no readable model_type: {exc}") from exc


# transformers builds models on the meta device and then materialises them; two threads doing
# that at once fail ("Cannot copy out of meta tensor") and can leave the process unable to load
# again, so loads in one process take turns (pre-annotation shards load in threads).
_LOAD_LOCK = threading.Lock()


def model_fingerprint(path: str | Path) -> str:
    """A short content hash of a model folder's config and weights: two folders with the same
    fingerprint decode alike, whatever they are called (every trained folder is named ``model``)."""
    digest = hashlib.sha256()
    folder = Path(path)
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors")), *sorted(folder.glob("*.bin"))]
    for file in files:
        if file.is_file():
            digest.update(file.name.encode())
            with file.open("rb") as handle:
                for chunk in iter(lambda h=handle: h.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()[:12]


def load_markup_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, prompt: str | None = None
) -> tuple[MarkupLM, PreTrainedTokenizerFast]:
    """The model (in eval mode) and its tokenizer, ready for the decoding engine (thread-safe).

    ``prompt``: the instruction in a chat model's page prompt (default
    :data:`models.hf_adapter.DEFAULT_PROMPT`; PaddleOCR-VL is trained on ``OCR:``); DocVLM has none.
    """
    with _LOAD_LOCK:
        return _load_markup_model(Path(path), device, dtype, prompt)


def _load_markup_model(
    path: Path, device: str | torch.device, dtype: torch.dtype | None, prompt: str | None
) -> tuple[MarkupLM, PreTrainedTokenizerFast]:
    family = model_family(path)
    if family == "docvlm":
        model = DocVLMForConditionalGeneration.from_pretrained(str(path), dtype=dtype or torch.float32)
        tokenizer = load_tokenizer(path)
    elif family == READER_MODEL_TYPE:
        model = ReaderForConditionalGeneration.from_pretrained(str(path), dtype=dtype or torch.float32)
        tokenizer = load_tokenizer(path)
    elif family in SUPPORTED_MODEL_TYPES or family == "dots_ocr":  # dots.ocr gets the adapter's explanation
        model, tokenizer = HFMarkupModel.load(path, dtype=dtype, **({"prompt": prompt} if prompt else {}))
    else:
        raise ModelLoadError(f"unsupported model family {family!r} at {path}; supported: {', '.join(SUPPORTED_FAMILIES)}")
    model.to(device).eval()
    return model, tokenizer


def new_tiny_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, architecture: str = "tiny", **overrides
) -> DocVLMForConditionalGeneration:
    """A freshly initialised CPU-sized model whose special ids match ``tokenizer``
    (``architecture``: ``tiny`` for tests, ``base`` for the shipped pretrained model)."""
    builders = {"tiny": tiny_config, "base": base_config}
    if architecture not in builders:
        raise ModelLoadError(f"unknown DocVLM architecture {architecture!r}; choose one of {sorted(builders)}")
    missing = [t for t in SPECIAL_TOKENS if t not in tokenizer.get_vocab()]
    if missing:
        raise ModelLoadError(f"tokenizer lacks special tokens {missing}")
    torch.manual_seed(seed)
    config: DocVLMConfig = builders[architecture](len(tokenizer), special_token_ids(tokenizer), **overrides)
    return DocVLMForConditionalGeneration(config).eval()


def save_markup_model(model: TrainableMarkupLM, tokenizer: PreTrainedTokenizerBase, path: str | Path,
                      state_dict: dict | None = None) -> Path:
    """Write a folder :func:`load_markup_model` loads, whatever the family (``state_dict``: other
    weights under the model's own names, e.g. LoRA-merged ones)."""
    return model.save_folder(Path(path), tokenizer, state_dict)
