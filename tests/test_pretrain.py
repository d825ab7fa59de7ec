"""``./run pretrain`` end to end at toy size: pages, an interrupted run resumed, curve, card, folder."""

from __future__ import annotations

import json

from components.data.page_store import PageDataset
from models.loading import load_markup_model
from recipes.pretrain import main


def test_pretrain_resumes_and_writes_a_model_card(tmp_path):
    out, work = tmp_path / "base", tmp_path / "work"
    args = ["--pages", "16", "--lines-pages", "8", "--eval-pages", "2", "--max-new-tokens", "16", "--curve-every", "2",
            "--decoders", "ar,sdb", "--work-dir", str(work), "--out", str(out), "--set", "train.steps=4",
            "--set", "train.save_every=2", "--set", "optim.warmup_steps=1", "--set", "train.micro_batch_size=2"]
    assert main([*args, "--stop-at-step", "2"]) == 3  # interrupted: checkpoint kept, no folder yet
    assert not out.exists()
    pages = PageDataset(work / "pages").pages()[-1].to_json()
    assert pages["page_id"].startswith("lines-") and pages["meta"]["preset"] == "lines"
    assert main(args) == 0  # resumes at step 2
    meta = json.loads((out / "pretrain.json").read_text())
    assert meta["steps"] == 4 and meta["sessions"] == 2 and [c["step"] for c in meta["curve"]] == [2]
    assert set(meta["evaluation"]["decoders"]) == {"ar", "sdb"}
    card = (out / "README.md").read_text()
    assert "docmarkup-base" in card and "| sdb |" in card
    model, _ = load_markup_model(out)
    assert model.config.vision_stem == "conv"
    seen = json.loads((out / "training_meta.json").read_text())["seen_seeds"]
    assert [10_000_000, 10_000_015] in seen and [20_000_000, 20_000_007] in seen
