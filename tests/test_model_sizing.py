"""Checkpoints without downloads (recipes.tiny_checkpoint) and the training launcher's --dry-run memory estimate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from components.training.memory import estimate
from recipes.tiny_checkpoint import main as tiny_main

ROOT = Path(__file__).resolve().parents[1]


def test_the_3b_config_counts_qwen25_vl_3b_parameters_without_weights(tmp_path):
    assert tiny_main(["--family", "qwen2_5_vl", "--preset", "3b", "--out", str(tmp_path / "q3b")]) == 0
    assert [p.name for p in (tmp_path / "q3b").iterdir()] == ["config.json"]
    zero2 = estimate(tmp_path / "q3b", zero_stage=2, gpus_per_node=8)
    zero3 = estimate(tmp_path / "q3b", zero_stage=3, gpus_per_node=8)
    assert 3.6e9 < zero2.parameters < 3.9e9  # Qwen2.5-VL-3B has 3.75B parameters
    assert zero2.largest_layer_parameters == 151936 * 2048  # the (tied) embedding
    # ZeRO-2: bf16 params on every GPU + 18 bytes/param of grads/master/Adam split over 8 GPUs.
    assert zero2.gpu_bytes == 2 * zero2.parameters + int(18 * zero2.parameters / 8)
    assert zero3.gpu_bytes < zero2.gpu_bytes  # ZeRO-3 also shards the parameters
    assert estimate(tmp_path / "q3b", zero_stage=2, gpus_per_node=8, nodes=2).gpu_bytes < zero2.gpu_bytes


def test_dry_run_prints_the_estimate_and_trains_nothing(tmp_path):
    tiny_main(["--family", "qwen2_5_vl", "--preset", "3b", "--out", str(tmp_path / "q3b")])
    for stage in (2, 3):
        out = subprocess.run(
            [sys.executable, "-m", "recipes.launch", "--config", "configs/train/stage1.yaml", "--dry-run",
             "--gpus-per-node", "8", "--set", f"model.init_from={tmp_path / 'q3b'}",
             "--set", f"deepspeed=configs/deepspeed/zero{stage}.json", "--set", f"output_dir={tmp_path / 'out'}"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "qwen2_5_vl, 3.75" in out.stdout and f"ZeRO-{stage} on 8 GPU(s)" in out.stdout
        assert "GiB of model states per GPU" in out.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["docvlm", "qwen2_5_vl"])
def test_tiny_folders_load_and_decode(family, tmp_path):
    from components.data.synthetic import generate_page
    from components.decoding.engine import DecodingEngine
    from components.decoding.types import DecodeParams

    assert tiny_main(["--family", family, "--out", str(tmp_path / family)]) == 0
    assert json.loads((tmp_path / family / "config.json").read_text())["model_type"] == family
    engine = DecodingEngine.from_pretrained(tmp_path / family)
    [result] = engine.generate([generate_page(7)[1]], DecodeParams(decoder="sdb", max_new_tokens=8))
    assert result.stats.new_tokens > 0


def test_an_unsupported_family_names_the_supported_ones(tmp_path, capsys):
    assert tiny_main(["--family", "llava", "--out", str(tmp_path / "x")]) == 2
    assert "docvlm, qwen2_vl, qwen2_5_vl, qwen3_vl, paddleocr_vl" in capsys.readouterr().err


def test_gradient_checkpointing_recomputes_layers_and_keeps_the_gradients(tokenizer):
    import torch

    from components.data.synthetic import generate_page
    from models.loading import new_tiny_model

    model = new_tiny_model(tokenizer, seed=0).train()
    image, ids = generate_page(1)[1], torch.tensor([tokenizer("<table><tr><td>model</td></tr></table>")["input_ids"]])
    calls = []
    # A pre-hook early in the layer: the recomputation stops once it has what the backward needs.
    model.language_model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))

    def gradients():
        calls.clear()
        loss = model(pixel_values=model.preprocess([image]), input_ids=ids, labels=ids)["loss"]
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        return loss.detach(), grads, len(calls)

    loss, grads, plain_calls = gradients()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss_ckpt, grads_ckpt, ckpt_calls = gradients()
    assert (plain_calls, ckpt_calls) == (1, 2)  # the layer ran again in the backward pass
    assert torch.equal(loss, loss_ckpt) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, grads_ckpt, strict=True))
