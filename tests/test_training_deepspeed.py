"""Training through a real DeepSpeed engine on CPU: resume exactness, MLflow, model folders, 2 processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from components.data.page_store import PageDataset
from components.data.synthetic import generate_dataset
from components.training.config import load_train_config
from components.training.trainer import latest_checkpoint, run_training

ROOT = Path(__file__).resolve().parents[1]
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
             "ROLE_RANK", "LOCAL_SIZE")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """12 synthetic pages and one bootstrapped starting model shared by the runs below."""
    from components.training.bootstrap import bootstrap_model

    root = tmp_path_factory.mktemp("deepspeed-training")
    generate_dataset(root / "pages", 12, seed=100)
    bootstrap_model(root / "pages", root / "init", vocab_size=384, seed=0)
    return root


# One recipe for every run below (in-process and launched), so their losses are comparable.
# Constant lr after a 2-step warmup: a resume that forgot the scheduler would re-warm and differ.
RECIPE = {
    "train.micro_batch_size": 2, "optim.warmup_steps": 2, "optim.schedule": "constant", "data.max_tokens": 160,
    "deepspeed": "configs/deepspeed/zero1.json",
}


def _config(workspace: Path, out: str, **overrides):
    values = {
        "output_dir": str(workspace / out), "data.dataset": str(workspace / "pages"), "model.bootstrap": None,
        "model.init_from": str(workspace / "init"), "train.steps": 6, "train.save_every": 2, **RECIPE, **overrides,
    }
    return load_train_config(ROOT / "configs/train/quick.yaml", values)


@pytest.fixture(scope="module")
def uninterrupted(workspace):
    return run_training(_config(workspace, "straight"))


def test_training_lowers_the_loss_and_writes_a_loadable_model(uninterrupted, workspace):
    from models.loading import load_markup_model

    result = uninterrupted
    assert result.final_step == 6 and not result.interrupted
    assert result.losses[-1] < result.losses[0]
    for key in ("loss_ar", "loss_dar", "loss_block_diffusion", "loss_pabdm_csl", "lr", "grad_norm", "csl_kept"):
        assert key in result.history[-1], key
    model, tokenizer = load_markup_model(result.model_dir)
    assert model.config.init_token_id == tokenizer.convert_tokens_to_ids("<INIT>")
    meta = json.loads((result.model_dir / "training_meta.json").read_text())
    assert meta["data"]["dataset"]["pages_sha256"] == PageDataset(workspace / "pages").fingerprint()
    assert meta["deepspeed"]["zero_stage"] == 1 and meta["steps"] == 6
    lines = (result.output_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in result.history[:3]] == pytest.approx([1e-3, 2e-3, 2e-3])  # warmup, then constant


def test_interrupted_run_resumes_on_the_same_loss_curve_and_logs_one_mlflow_run(uninterrupted, workspace):
    import mlflow
    from mlflow import MlflowClient

    from models.loading import load_markup_model

    uri = f"sqlite:///{workspace / 'mlflow' / 'mlflow.db'}"
    (workspace / "mlflow").mkdir(exist_ok=True)
    config = _config(workspace, "resumed", **{"train.steps": 4, "mlflow.enabled": True, "mlflow.tracking_uri": uri,
                                              "mlflow.experiment": "training-test", "data.version": "dvc-abc123"})
    first = run_training(config, stop_at_step=2)
    assert first.interrupted and first.model_dir is None and first.final_step == 2
    assert latest_checkpoint(first.output_dir) == ("step_0000002", 2)
    assert first.losses == pytest.approx(uninterrupted.losses[:2], rel=1e-6)

    second = run_training(config)
    assert second.start_step == 2 and second.final_step == 4 and not second.interrupted
    assert second.losses == pytest.approx(uninterrupted.losses[2:4], rel=1e-5)
    assert [r["lr"] for r in second.history] == pytest.approx([r["lr"] for r in uninterrupted.history[2:4]])
    checkpoint = torch.load(uninterrupted.output_dir / "checkpoints" / "step_0000004" / "mp_rank_00_model_states.pt",
                            map_location="cpu", weights_only=False)["module"]
    resumed = load_markup_model(second.model_dir)[0].state_dict()
    assert len(checkpoint) > 50
    assert all(torch.allclose(value, resumed[key.removeprefix("model.")], atol=1e-6) for key, value in checkpoint.items())

    assert first.mlflow_run_id == second.mlflow_run_id
    mlflow.set_tracking_uri(uri)
    client = MlflowClient()
    run = client.get_run(second.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["objectives.ar"] == "1.0" and run.data.params["deepspeed"].endswith("zero1.json")
    assert run.data.tags["data_version"] == "dvc-abc123"
    meta = json.loads((second.model_dir / "training_meta.json").read_text())
    assert meta["data"]["version"] == "dvc-abc123"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert {"model/config.json", "model/training_meta.json", "model/model.safetensors"} <= artifacts


def _stage_config(name: str, workspace: Path, out: str, **overrides):
    """A shipped stage config, shrunk to a couple of CPU steps."""
    values = {"output_dir": str(workspace / out), "data.dataset": str(workspace / "pages"), "train.steps": 2,
              "train.micro_batch_size": 2, "train.save_every": None, "train.progress": False, "mlflow.enabled": False,
              "optim.warmup_steps": 1, "data.max_tokens": 160, **overrides}
    return load_train_config(ROOT / "configs" / "train" / f"{name}.yaml", values)


def test_darl_fine_tune_runs_through_deepspeed(uninterrupted, workspace):
    config = _stage_config("darl", workspace, "darl", **{"model.init_from": str(uninterrupted.model_dir), "dar.window": 8})
    result = run_training(config)
    record = result.history[-1]
    for key in ("loss_darl", "darl_dar", "darl_dtpo", "reward_r1", "reward_r2", "reward_greedy"):
        assert key in record, key
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in result.history)
    assert 0.0 <= record["reward_r1"] <= 1.0 and 0.0 <= record["reward_r2"] <= 1.0
    # The authors' recipe: DAR's loss already holds next-token CE over the prefix, so no AR term.
    assert "loss_ar" not in record
    assert json.loads((result.model_dir / "training_meta.json").read_text())["objectives"] == {"darl": 1.0}


def test_stage2_mixes_weighted_hard_pages(uninterrupted, workspace):
    from components.data.page_store import PageDataset

    hard = PageDataset(workspace / "hard")
    pages = PageDataset(workspace / "pages").pages()[:4]
    for page, score in zip(pages, (0.1, 0.3, 0.5, 0.2), strict=True):
        page.image = str((workspace / "pages" / page.image).resolve())  # images stay in the broad dataset
        page.meta["consistency"] = score
    hard.write(pages)
    config = _stage_config("stage2", workspace, "stage2", **{
        "model.init_from": str(uninterrupted.model_dir), "data.hard_examples": str(hard.root), "data.hard_ratio": 0.5,
        "data.consistency_beta": 1.0})
    result = run_training(config)
    assert all(r["sample_weight"] > 1.0 for r in result.history)  # one hard page (weight 1.5..1.9) per micro-batch
    meta = json.loads((result.model_dir / "training_meta.json").read_text())
    assert meta["data"]["hard_examples"]["n_pages"] == 4


def test_train_quick_model_bootstraps_and_returns_a_model_folder(workspace):
    from components.training.quick import train_quick_model
    from models.loading import load_markup_model

    model_dir = train_quick_model(workspace / "quick", workspace / "pages", steps=2, seed=1,
                                  overrides={"train.micro_batch_size": 2, "data.max_tokens": 128})
    model, _ = load_markup_model(model_dir)
    assert model.config.mask_token_id is not None
    assert (workspace / "quick" / "bootstrap_model" / "tokenizer.json").exists()
    assert json.loads((model_dir / "training_meta.json").read_text())["steps"] == 2


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _launch_args(workspace: Path, out: str, steps: int, *extra: str) -> list[str]:
    values = {"output_dir": workspace / out, "data.dataset": workspace / "pages", "model.bootstrap": "null",
              "model.init_from": workspace / "init", "train.steps": steps, **RECIPE}
    sets = [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]
    return ["-m", "recipes.launch", "--config", "configs/train/quick.yaml", *sets, *extra]


@pytest.mark.slow
def test_two_process_deepspeed_run_decreases_loss_and_ranks_agree(workspace):
    """torchrun, 2 CPU processes, gloo, ZeRO-2: replicas stay identical while each sees its own shard."""
    from components.services.process import free_port

    report = workspace / "ranks"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()),
               *_launch_args(workspace, "two-procs", 6, "--set", "deepspeed=configs/deepspeed/zero2.json",
                             "--rank-report", str(report))]
    done = subprocess.run(command, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((report / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world_size"] == 2 and r["final_step"] == 6 for r in ranks)
    assert ranks[0]["param_checksum"] == ranks[1]["param_checksum"]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the logged loss is the mean over ranks
    assert ranks[0]["local_losses"] != ranks[1]["local_losses"]  # ... of different data shards
    losses = ranks[0]["losses"]
    assert losses[-1] < losses[0] and min(losses[3:]) < min(losses[:3])
    assert (workspace / "two-procs" / "model" / "training_meta.json").exists()


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_resumed_run_matches(workspace, uninterrupted):
    """A real interruption: SIGTERM a plain-python training, resume it, compare with an uninterrupted run."""
    out = workspace / "killed"
    process = subprocess.Popen([sys.executable, *_launch_args(workspace, "killed", 40)], cwd=ROOT, env=_clean_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        metrics = out / "metrics.jsonl"
        while time.time() < deadline and process.poll() is None:
            if metrics.exists() and metrics.read_text().strip():
                break
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 3, stderr[-3000:]
    _, stopped_at = latest_checkpoint(out)
    assert 1 <= stopped_at <= 4, "the run should stop right after the step in progress"
    resumed = run_training(_config(workspace, "killed", **{"train.steps": 6, "train.save_every": None}))
    assert resumed.start_step == stopped_at
    assert resumed.losses == pytest.approx(uninterrupted.losses[stopped_at:], rel=1e-5)


def test_a_run_measured_in_epochs_trains_the_steps_the_data_gives(workspace):
    result = run_training(_config(workspace, "epochs", **{"train.steps": None, "train.epochs": 1.0, "train.save_every": None}))
    assert result.final_step == 6  # 12 pages, 2 per step
    meta = json.loads((result.model_dir / "training_meta.json").read_text())
    assert meta["steps"] == 6
