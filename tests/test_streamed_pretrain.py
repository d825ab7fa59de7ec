"""Pretraining on pages rendered while training: resume, replay, seeds, and installing the result."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from components.training.data import Batch
from models.loading import load_markup_model
from recipes import pretrain, streamed_pretrain
from recipes.streamed_pretrain import BatchFeed, PageMix, lr_factor, page_seed


def _batch(value: int) -> Batch:
    return Batch(pages=torch.full((1, 1, 2, 2), float(value)), tokens=torch.tensor([[value]]), lengths=torch.tensor([1]),
                 ends_with_eos=torch.tensor([True]), weights=torch.ones(1), page_ids=[str(value)])


def test_feed_replays_only_while_rendering_lags_and_within_the_reuse_cap():
    release = threading.Event()

    def loader():
        yield _batch(1)
        release.wait(timeout=10)
        yield _batch(2)

    feed = BatchFeed(loader(), torch.device("cpu"), replay=4, reuse=1.0)
    first, fresh = feed.next()
    assert fresh and first.page_ids == ["1"]
    replayed, fresh = feed.next()  # batch 2 is not rendered yet: batch 1 again
    assert not fresh and replayed.page_ids == ["1"]
    threading.Timer(0.2, release.set).start()
    second, fresh = feed.next()  # one replay per fresh batch used up: waits for batch 2
    assert fresh and second.page_ids == ["2"]
    time.sleep(0.2)  # let the feed thread queue its end marker
    assert feed.next() == (None, True)
    assert (feed.fresh, feed.replayed) == (2, 1)


def test_feed_without_replay_always_waits_for_fresh_batches():
    feed = BatchFeed(iter([_batch(1), _batch(2)]), torch.device("cpu"), replay=0, reuse=5.0)
    assert [feed.next()[0].page_ids for _ in range(2)] == [["1"], ["2"]]
    assert feed.replayed == 0


def test_page_mix_and_seeds_are_fixed_by_the_data_step():
    mix = PageMix(lines=0.2, early_lines=0.5, early_steps=10)
    assert mix.presets(3, 64, 0) == mix.presets(3, 64, 0) != mix.presets(4, 64, 0)
    early = sum(p == "lines" for s in range(10) for p in mix.presets(s, 64, 0)) / 640
    late = sum(p == "lines" for s in range(10, 20) for p in mix.presets(s, 64, 0)) / 640
    assert 0.4 < early < 0.6 and 0.1 < late < 0.3
    seeds = {page_seed(p, s, 8, i) for s in range(5) for i, p in enumerate(mix.presets(s, 8, 0))}
    assert len(seeds) == 40  # no page twice
    assert all(pretrain.PRETRAIN_SEED <= x < pretrain.HELD_OUT_SEED for x in seeds)


def test_lr_factor_warms_up_then_decays_to_the_floor():
    assert lr_factor(0.0, 0.1, 0.05) == pytest.approx(1e-3)
    assert lr_factor(0.05, 0.1, 0.05) == pytest.approx(0.5)
    assert lr_factor(0.1, 0.1, 0.05) == pytest.approx(1.0)
    assert lr_factor(1.0, 0.1, 0.05) == pytest.approx(0.05)


def test_streamed_pretrain_resumes_then_installs_as_the_base(tmp_path):
    work, out = tmp_path / "work", tmp_path / "base"
    common = ["--batch", "2", "--eval-every", "1", "--val-pages", "2", "--max-tokens", "64", "--work-dir", str(work),
              "--lr", "1e-3", "--device", "cpu"]
    assert streamed_pretrain.main([*common, "--steps", "2", "--workers", "1"]) == 0  # spawned render worker
    folder = work / "lr-0.001" / "model"
    assert json.loads((folder / "streamed.json").read_text())["steps"] == 2
    assert streamed_pretrain.main([*common, "--steps", "3", "--workers", "0"]) == 0  # resumes at step 2
    made = json.loads((folder / "streamed.json").read_text())
    assert made["steps"] == 3 and [p["step"] for p in made["curve"]] == [1, 2, 3]
    assert made["seen_seeds"] == [[10_000_000, 10_000_005], [20_000_000, 20_000_005]]

    args = ["--publish", str(folder), "--out", str(out), "--work-dir", str(work / "publish"), "--eval-pages", "2",
            "--max-new-tokens", "8", "--decoders", "ar,sdb"]
    assert pretrain.main(args) == 0
    meta = json.loads((out / "pretrain.json").read_text())
    assert meta["steps"] == 3 and meta["seen_seeds"] == made["seen_seeds"]
    assert set(meta["evaluation"]["decoders"]) == {"ar", "sdb"}
    card = (out / "README.md").read_text()
    assert "| sdb |" in card and "| 3 | 0.001 |" in card
    assert not (out / "streamed.json").exists()
    load_markup_model(out)
    assert pretrain.main(["--publish", str(tmp_path), "--out", str(tmp_path / "x")]) == 2  # not such a folder
