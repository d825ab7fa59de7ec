"""Which synthetic seeds a model has seen, so no evaluation scores it on its own training pages.

Synthetic pages are identified by their seed (``page.meta["seed"]``). Every trained model folder
records the seed runs of its training data plus those of the model it started from
(``seen_seeds`` in ``training_meta.json`` or ``pretrain.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from components.data.page_store import PageDataset


def merge_ranges(ranges: list[list[int]]) -> list[list[int]]:
    """Sorted ``[first, last]`` seed runs with overlapping or touching runs merged."""
    runs: list[list[int]] = []
    for first, last in sorted(ranges):
        if runs and first <= runs[-1][1] + 1:
            runs[-1][1] = max(runs[-1][1], last)
        else:
            runs.append([first, last])
    return runs


def seed_ranges(seeds: list[int], also: list[list[int]] = ()) -> list[list[int]]:
    """The runs covering ``seeds`` and the runs ``also``."""
    return merge_ranges([[s, s] for s in seeds] + [list(r) for r in also])


def synthetic_seeds(root: str | Path) -> list[int]:
    """Seeds of a dataset's synthetic pages (``page.meta["seed"]``); other pages have none."""
    seeds = []
    for table in PageDataset(root).scan(["source", "meta"]):  # two columns, shard by shard
        for source, meta in zip(table.column("source").to_pylist(), table.column("meta").to_pylist(), strict=True):
            if source == "synthetic" and '"seed"' in meta:
                seeds.append(int(json.loads(meta)["seed"]))
    return seeds


def seen_seeds(model_dir: str | Path) -> list[list[int]]:
    """Synthetic seeds a model folder was trained on, through its whole ``init_model`` chain."""
    meta_file = Path(model_dir) / "training_meta.json"
    if not meta_file.is_file():
        meta_file = Path(model_dir) / "pretrain.json"
    if not meta_file.is_file():
        return []
    meta = json.loads(meta_file.read_text())
    return [list(r) for r in meta.get("seen_seeds", [])]
