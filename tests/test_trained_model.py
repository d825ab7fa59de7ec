"""A tiny model trained for a couple of CPU minutes beats an untrained one on held-out pages."""

from __future__ import annotations

import pytest

from components.data.synthetic import generate_dataset
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.evaluate import evaluate_decoder
from components.training.quick import train_quick_model
from models.loading import load_markup_model, new_tiny_model, save_markup_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    return generate_dataset(root / "train", 600, seed=0), generate_dataset(root / "test", 8, seed=700_000), root


def test_trained_model_scores_better_than_untrained(pages):
    train, test, root = pages
    model_dir = train_quick_model(root / "run", train.root, steps=250, seed=0, overrides={"objectives": {"ar": 1.0}})
    _, tokenizer = load_markup_model(model_dir)
    untrained_dir = save_markup_model(new_tiny_model(tokenizer, seed=0), tokenizer, root / "untrained")
    params = DecodeParams(decoder="ar", max_new_tokens=160)
    trained = evaluate_decoder(DecodingEngine.from_pretrained(model_dir), test, params)
    untrained = evaluate_decoder(DecodingEngine.from_pretrained(untrained_dir), test, params)
    print(f"\nheld-out: trained {trained.overall:.2f} {trained.scores} vs untrained {untrained.overall:.2f} {untrained.scores}")
    assert trained.overall > untrained.overall + 10.0
    # Two CPU minutes teach structure (tables, formulas) before exact words: assert what it learned.
    # How well its tables match varies with the CPU the steps ran on (TEDS-S 0.87 on one machine, 0.0
    # on CI's at 0ff0379, tables written on the wrong pages); that it writes tables at all does not.
    assert untrained.scores["n_pred_table"] == 0 < trained.scores["n_pred_table"]
    assert trained.scores["formula_edit"] < untrained.scores["formula_edit"]
    assert trained.speed["new_tokens"] / len(trained.pages) < params.max_new_tokens  # it learned to stop
