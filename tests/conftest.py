"""Shared pytest fixtures. Service fixtures keep their logic in components/services/."""

from __future__ import annotations

import pytest
import torch

# Tiny models on a 2-core machine: more than one intra-op thread only adds contention.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def label_studio():
    """A real Label Studio server for the session, stopped by PID at the end."""
    from components.services.labelstudio import running_label_studio

    with running_label_studio() as connection:
        yield connection


@pytest.fixture(scope="session")
def tokenizer():
    """A markup tokenizer trained on 300 synthetic pages (about a second)."""
    from components.data.synthetic import generate_page
    from models.tokenizer import train_markup_tokenizer

    return train_markup_tokenizer([generate_page(seed)[0].markup for seed in range(300)], vocab_size=512)


@pytest.fixture(scope="session")
def curation_model_dir(tokenizer, tmp_path_factory):
    """An untrained tiny DocVLM saved to disk: deterministic when greedy, its samples disagree."""
    from models.loading import new_tiny_model, save_markup_model

    return save_markup_model(new_tiny_model(tokenizer, seed=0), tokenizer, tmp_path_factory.mktemp("curation-model"))
