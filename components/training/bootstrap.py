"""The starting point of Stage 1: a tokenizer trained on the dataset's markup and a fresh tiny model.

No pretrained weights can be downloaded here, so the first model is initialised from scratch;
its vocabulary comes from the pages it will learn, which keeps the CPU-sized model small.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from components.data.page_store import PageDataset
from components.data.pages import InvalidPageError
from models.loading import new_tiny_model, save_markup_model
from models.tokenizer import train_markup_tokenizer


def bootstrap_model(
    dataset_dirs: str | Path | Iterable[str | Path], out_dir: str | Path, vocab_size: int = 512, min_frequency: int = 2,
    seed: int = 0,
    architecture: str = "tiny",
) -> Path:
    """Train a markup tokenizer on the datasets' pages, create the tiny model, save both to ``out_dir``."""
    roots = [dataset_dirs] if isinstance(dataset_dirs, str | Path) else list(dataset_dirs)
    texts = []
    for root in roots:
        dataset = PageDataset(root)
        if not dataset.exists():
            raise FileNotFoundError(f"cannot bootstrap from {root}: no page store there")
        texts += [page.markup for page in dataset.iter_pages() if page.markup.strip()]
    if not texts:
        raise InvalidPageError(f"cannot bootstrap: no page with markup in {[str(r) for r in roots]}")
    tokenizer = train_markup_tokenizer(texts, vocab_size=vocab_size, min_frequency=min_frequency)
    model = new_tiny_model(tokenizer, seed=seed, architecture=architecture)
    out = save_markup_model(model, tokenizer, out_dir)
    (out / "bootstrap.json").write_text(json.dumps(
        {"datasets": [str(Path(r).resolve()) for r in roots], "vocab_size": len(tokenizer), "seed": seed,
         "architecture": architecture, "n_pages": len(texts)}, indent=2))
    return out
