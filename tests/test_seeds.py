"""Held-out evaluation: a model's recorded training seeds are refused as evaluation pages."""

from __future__ import annotations

import json

import pytest

from components.data.seeds import merge_ranges, seed_ranges, seen_seeds
from components.data.synthetic import generate_dataset
from components.evaluation.evaluate import NotHeldOutError, assert_held_out


def test_seed_runs_merge_touching_and_overlapping_ranges():
    assert seed_ranges([5, 3, 4, 9, 10, 12]) == [[3, 5], [9, 10], [12, 12]]
    assert merge_ranges([[10, 20], [0, 4], [5, 7], [15, 30]]) == [[0, 7], [10, 30]]
    assert seed_ranges([1], also=[[2, 8]]) == [[1, 8]]


def test_evaluation_refuses_pages_the_model_was_trained_on(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "training_meta.json").write_text(json.dumps({"seen_seeds": [[0, 99], [1000, 1999]]}))
    assert seen_seeds(model) == [[0, 99], [1000, 1999]]
    seen = generate_dataset(tmp_path / "seen", n_pages=3, seed=1500)
    with pytest.raises(NotHeldOutError, match=r"3 pages .* \(seeds \[1500, 1501, 1502\]"):
        assert_held_out(model, seen)
    assert_held_out(model, generate_dataset(tmp_path / "fresh", n_pages=3, seed=500))
