"""LoRA through peft: only adapters train, and the saved folder is the merged, plain model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from components.data.synthetic import generate_dataset, generate_page
from components.training.config import load_train_config
from components.training.lora import apply_lora, merged_state_dict
from components.training.streams import compose
from components.training.trainer import run_training
from models.loading import load_markup_model, save_markup_model

ROOT = Path(__file__).resolve().parents[1]


def _logits(model, tokenizer) -> torch.Tensor:
    """A causal forward over one page through the training interface (any family)."""
    image = generate_page(3)[1]
    body = tokenizer("<table><tr><td>model</td></tr></table>", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([[tokenizer.bos_token_id, *body]])
    with torch.no_grad():
        prefix = model.encode_pages(model.cpu_preprocessor()([image]))
        layout = compose(ids, [], prefix.length)
        return model(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                     position_ids=layout.position_ids, prefix=prefix)["logits"]


@pytest.mark.parametrize("family", ["docvlm", "qwen2_5_vl"])
def test_the_merged_folder_computes_what_the_adapted_model_computes(family, tmp_path):
    from recipes.tiny_checkpoint import write_tiny

    model, tokenizer = load_markup_model(write_tiny(family, tmp_path / "base", seed=1, n_texts=40))
    before = _logits(model, tokenizer)
    counts = apply_lora(model, r=4, alpha=8.0)
    assert 0 < counts["trainable"] < counts["parameters"] / 5
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; give the adapters an effect to merge
            torch.nn.init.normal_(param, std=0.05)
    adapted = _logits(model, tokenizer)
    assert not torch.allclose(adapted, before, atol=1e-3)
    folder = save_markup_model(model, tokenizer, tmp_path / "merged", state_dict=merged_state_dict(model))
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
    assert names and not any("lora" in name or "base_layer" in name for name in names)
    plain, plain_tokenizer = load_markup_model(folder)
    assert torch.allclose(_logits(plain, plain_tokenizer), adapted, atol=1e-5)


@pytest.mark.slow
def test_a_lora_stage_trains_only_the_adapters_and_saves_a_plain_folder(tmp_path):
    from components.training.bootstrap import bootstrap_model

    generate_dataset(tmp_path / "pages", 8, seed=300)
    bootstrap_model(tmp_path / "pages", tmp_path / "init", vocab_size=384, seed=0)
    config = load_train_config(ROOT / "configs/train/quick.yaml", {
        "output_dir": str(tmp_path / "out"), "data.dataset": str(tmp_path / "pages"), "model.bootstrap": None,
        "model.init_from": str(tmp_path / "init"), "model.lora": {"r": 8, "alpha": 16.0}, "train.steps": 4,
        "train.save_every": 2, "train.micro_batch_size": 2, "optim.lr": 5e-3, "optim.warmup_steps": 1, "deepspeed": "configs/deepspeed/zero1.json"})
    result = run_training(config)
    assert result.model_dir is not None and result.losses[-1] < result.losses[0]
    trained, _ = load_markup_model(result.model_dir)
    start, _ = load_markup_model(tmp_path / "init")
    changed = {n for n, p in trained.state_dict().items() if not torch.equal(p, start.state_dict()[n])}
    outside = sorted(n for n in changed if not (n.endswith("proj.weight") and n.startswith("language_model.")))
    assert changed and not outside, outside
