"""The Prefect flows on a temporary Prefect API: curation end to end, the schedule, config checks."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from components.data.page_store import PageDataset
from components.pipeline import PipelineConfigError, load_pipeline_config


@pytest.fixture(scope="module")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


def _pipeline_yaml(tmp_path, **sections) -> str:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    config = {
        "name": "flowtest",
        "repo_root": str(repo),
        "work_dir": str(tmp_path / "work"),
        "ingest": {"synthetic_pages": 12, "synthetic_seed": 500, "shard_rows": 3},
        "curation": {"preannotation": {"backend": "rapidocr", "max_pages": 4},
                     "label_studio": {"enabled": False}},
        "training": {"stages": {"stage1": {"config": "configs/train/stage1.yaml"}}},
        **sections,
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_pipeline_config_rejects_unknown_keys_and_a_first_stage_that_cannot_start_the_chain(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"training": {"stages": {"warmup": {"config": "x", "hard_examples": True}}}}))
    with pytest.raises(PipelineConfigError, match="starts the chain"):
        load_pipeline_config(path)
    path.write_text(yaml.safe_dump({"training": {"stages": {"stage1": {"config": "x", "hard_example": True}}}}))
    with pytest.raises(PipelineConfigError, match="hard_example"):
        load_pipeline_config(path)
    path.write_text(yaml.safe_dump({"training": {"stages": {"stage1": {"config": "x"}}}, "evalution": {}}))
    with pytest.raises(PipelineConfigError, match="evalution"):
        load_pipeline_config(path)
    with pytest.raises(PipelineConfigError, match="does not exist"):
        load_pipeline_config(tmp_path / "missing.yaml")


def test_a_data_dir_outside_its_repository_is_refused_when_the_config_is_read(tmp_path):
    """Found when the config is read, before ingestion and pre-annotation ran (was: a traceback at
    the versioning step, after them)."""
    config = _pipeline_yaml(tmp_path)
    outside = str(tmp_path / "elsewhere" / "data")
    with pytest.raises(PipelineConfigError, match=r"data_dir .* is not inside repo_root"):
        load_pipeline_config(config, {"data_dir": outside})
    with pytest.raises(PipelineConfigError, match="is not inside repo_root"):
        load_pipeline_config(config, {"data_dir": "../sibling"})
    assert load_pipeline_config(config, {"data_dir": "nested/data"}).data_root.name == "data"


def test_the_chain_follows_the_stages_the_config_declares(tmp_path):
    """Stage names are the team's: what a stage does is declared (mine first, train beside the
    chain); the shipped names keep their roles as defaults."""
    from lifecycle.stages import stage_overrides

    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "own", "training": {"base_model": "var/models/mine", "stages": {
        "warmup": {"config": "configs/train/stage1.yaml"},
        "hard-pages": {"config": "configs/train/stage2.yaml", "hard_examples": True},
        "element-model": {"config": "configs/train/stage1.yaml", "beside_chain": True},
        "stage2": {"config": "configs/train/stage2.yaml"}, "elements": {"config": "configs/train/stage1.yaml"}}}},
        sort_keys=False))
    stages = load_pipeline_config(path).training.stages
    assert list(stages) == ["warmup", "hard-pages", "element-model", "stage2", "elements"]
    assert [s.hard_examples for s in stages.values()] == [False, True, False, True, False]
    assert [s.beside_chain for s in stages.values()] == [False, False, True, False, True]
    cfg = load_pipeline_config(path)
    base = str(Path("var/models/mine").resolve())
    start = {stage: stage_overrides(cfg, stage, tmp_path, None, None, None).get("model.init_from")
             for stage in ("warmup", "hard-pages", "element-model")}
    assert start == {"warmup": base, "hard-pages": None, "element-model": base}  # the chain's stages get theirs handed


def test_the_pipeline_names_the_base_model_stage1_continues(tmp_path):
    from lifecycle.stages import stage_overrides

    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "byo", "training": {"base_model": "var/models/my-qwen25", "stages": {
        "stage1": {"config": "configs/train/stage1.yaml"}, "stage2": {"config": "configs/train/stage2.yaml"}}}}))
    cfg = load_pipeline_config(path)
    first = stage_overrides(cfg, "stage1", tmp_path / "train", None, None, None)
    assert first["model.init_from"].endswith("var/models/my-qwen25") and first["model.bootstrap"] is None
    second = stage_overrides(cfg, "stage2", tmp_path / "train", tmp_path / "stage1-model", None, None)
    assert second["model.init_from"] == str(tmp_path / "stage1-model")


def test_multi_node_launch_commands(tmp_path):
    from lifecycle.stages import launch_command

    def command(**training):
        path = tmp_path / "pipeline.yaml"
        path.write_text(yaml.safe_dump({"name": "mn", "training": {
            "stages": {"stage1": {"config": "configs/train/stage1.yaml"}}, **training}}))
        return launch_command(load_pipeline_config(path), Path("configs/train/stage1.yaml"), {"train.steps": 3})

    single = command(launcher="torchrun", num_processes=8)
    assert "--standalone" in single and "--nproc-per-node=8" in single
    two = command(launcher="torchrun", num_processes=8, nodes=2, rdzv_endpoint="node0:29400")
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", "--rdzv-id=mn-stage1"} <= set(two)
    assert "--standalone" not in two and two[-2:] == ["--set", "train.steps=3"]
    hosts = command(launcher="deepspeed", num_processes=8, nodes=2, hostfile="var/hostfile")
    assert Path(hosts[0]).name == "deepspeed" and "--num_nodes=2" in hosts and "--num_gpus=8" in hosts
    assert any(arg.startswith("--hostfile=") and arg.endswith("var/hostfile") for arg in hosts)
    for bad, why in [({"nodes": 2}, "torchrun or deepspeed"), ({"launcher": "torchrun", "nodes": 2}, "rdzv_endpoint"),
                     ({"launcher": "deepspeed", "nodes": 2}, "hostfile")]:
        with pytest.raises(PipelineConfigError, match=why):
            command(**bad)


def test_a_typo_in_a_later_stage_fails_before_any_work_in_one_line(tmp_path):
    import sys

    from components.training.config import TrainConfigError
    from flows._common import resolve

    stages = {"stage1": {"config": "configs/train/stage1.yaml"},
              "darl": {"config": "configs/train/darl.yaml", "overrides": {"darl.candidatez": 4}}}
    path = _pipeline_yaml(tmp_path, training={"stages": stages})
    with pytest.raises(TrainConfigError, match=r"darl\.candidatez: unknown key"):
        resolve(path)
    done = subprocess.run([sys.executable, "-m", "flows.retrain", "--config", path], capture_output=True, text=True,
                          timeout=120)
    err = done.stderr.strip()
    assert done.returncode == 2 and err.startswith("config error:") and "candidatez" in err
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "work").exists()  # nothing ran


def test_deploy_section_sets_how_the_triton_models_serve(tmp_path):
    from deploy.triton.repository import MODEL_NAMES, materialize_repository, read_parameters
    from lifecycle.deployment import repository_options

    cfg = load_pipeline_config("configs/pipeline/default.yaml",
                               {"deploy.instance_count": 2, "deploy.max_batch_size": 0, "deploy.device": "cuda"})
    repository = materialize_repository("models:/m@champion", tmp_path / "repo", **repository_options(cfg))
    for model in MODEL_NAMES:
        text = (repository / model / "config.pbtxt").read_text()
        assert "count: 2" in text and "max_batch_size: 0" in text and "dynamic_batching" not in text
        assert read_parameters(text)["device"] == "cuda"
    with pytest.raises(PipelineConfigError, match="max_batch_size"):
        load_pipeline_config("configs/pipeline/default.yaml", {"deploy.max_batch_size": -1})


@pytest.mark.slow
def test_curate_flow_ingests_preannotates_splits_and_versions(prefect_api, tmp_path, monkeypatch):
    import flows._common
    from flows.curate import curate

    loads = []
    monkeypatch.setattr(flows._common, "load_pipeline_config",
                        lambda *args: loads.append(args) or load_pipeline_config(*args))
    config = _pipeline_yaml(tmp_path)
    summary = curate(config)
    assert len(loads) == 1  # the flow and its inner flow share one resolved config
    cfg = load_pipeline_config(config)
    assert summary["ingest"]["synthetic_added"] == 12
    # 12 pages in store shards of 3: the first 4 pages are pre-annotated by one task per shard
    assert [s["annotated"] + s["skipped"] for s in summary["preannotation"]] == [3, 1]
    assert len({s["shard"] for s in summary["preannotation"]}) == 2
    annotated = [p for p in PageDataset(cfg.pages_dir).pages() if "preannotation" in p.meta]
    assert len(annotated) == 4 and all(0.0 <= p.meta["preannotation"]["confidence"] <= 1.0 for p in annotated)
    assert sum(summary["splits"]["assigned"].values()) == 12
    assert sum(summary["splits"][name] for name in ("train", "val", "test")) == 12  # synthetic: none dropped
    assert (cfg.repository / "data.dvc").exists() and summary["data_version"]["files"] > 12

    resolved = flows._common.resolve(config)
    with pytest.raises(ValueError, match="already"):
        flows._common.resolve(resolved, {"name": "other"})
    loads.clear()
    again = curate(resolved)  # idempotent: nothing new, same data version
    assert loads == []  # a resolved config is handed down, never read again
    assert again["ingest"]["synthetic_added"] == 0
    assert sum(s["annotated"] for s in again["preannotation"]) == 0
    assert again["data_version"]["md5"] == summary["data_version"]["md5"]


def test_retrain_deployment_carries_its_cron_schedule(prefect_api):
    from prefect.client.orchestration import get_client

    from flows.deployments import DEPLOYMENT_NAME, retrain_deployment

    deployment_id = retrain_deployment(cron="15 4 * * 2").apply()
    with get_client(sync_client=True) as client:
        stored = client.read_deployment(deployment_id)
    assert stored.name == DEPLOYMENT_NAME
    assert [s.schedule.cron for s in stored.schedules] == ["15 4 * * 2"]
    assert stored.parameters["replay_traffic"] is False


@pytest.mark.parametrize("gate", ["unchanged", "not promoted"])
def test_retrain_monitors_whatever_the_gate_decided(prefect_api, tmp_path, monkeypatch, gate):
    """Nothing new to promote still runs the drift check and the feedback: production pages were
    served meanwhile, and a scheduled retrain is the scheduled monitoring too."""
    import flows.retrain as chain

    cfg = load_pipeline_config(_pipeline_yaml(tmp_path, deploy={"enabled": False}))
    evaluation = ({"unchanged": True, "gate_failures": ["no stage kept a change"]} if gate == "unchanged"
                  else {"promoted": False, "gate_failures": ["overall_present 90.0 <= champion 90.0"]})
    ran: list[str] = []
    monkeypatch.setattr(chain, "curate", lambda cfg: {})
    monkeypatch.setattr(chain, "train", lambda cfg: {"model_dir": str(tmp_path / "model")})
    monkeypatch.setattr(chain, "evaluate", lambda *args, **kwargs: evaluation)
    monkeypatch.setattr(chain, "deploy", lambda cfg: ran.append("deploy") or {})
    monkeypatch.setattr(chain, "monitor", lambda cfg, since=None: ran.append("monitor") or {"drift": {}})
    summary = chain.retrain(cfg)
    assert ran == ["monitor"] and summary["monitor"] == {"drift": {}}


def test_stage_progress_line_reads_the_metrics_log(tmp_path):
    from lifecycle.stages import progress_line

    metrics = tmp_path / "metrics.jsonl"
    assert progress_line("stage1", metrics, 3.0) == "[train stage1] starting (3s)"
    metrics.write_text('{"step": 1, "total_steps": 4, "loss": 9.0}\n{"step": 2, "total_steps": 4, "loss": 3.25}\n')
    assert progress_line("stage1", metrics, 90.0) == "[train stage1] step 2/4 loss 3.250 ETA 1m30s"


@pytest.mark.parametrize("flow_name", ["curate", "train", "evaluate", "deploy", "monitor", "retrain"])
def test_every_flow_takes_its_config_as_dash_dash_config(flow_name, tmp_path):
    """One command-line convention: ``./run flow NAME --config YAML [--set KEY=VALUE]``; a bad
    config is one line on stderr and exit status 2, before any work or server starts."""
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("ingest: {synthetic_pages: -1}\ntraining: {stages: {stage1: {config: configs/train/stage1.yaml}}}\n")
    extra = ["--model-dir", str(tmp_path)] if flow_name == "evaluate" else []
    done = subprocess.run([sys.executable, "-m", f"flows.{flow_name}", "--config", str(bad), "--set", "name=x", *extra],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().startswith("config error:") and "synthetic_pages" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_stage_that_ends_below_its_input_is_reported_and_the_chain_keeps_the_input(tmp_path, curation_model_dir):
    """The shipped base against an untrained model on the same validation pages: the untrained
    "stage output" is below, so the chain continues from the base; the other way round it is kept."""
    from components.data.synthetic import generate_dataset
    from lifecycle.stage_check import check_stage

    base = Path(__file__).resolve().parents[1] / "models" / "pretrained" / "docmarkup-base"
    cfg = load_pipeline_config(_pipeline_yaml(tmp_path, training={
        "stages": {"stage1": {"config": "configs/train/stage1.yaml"}}, "check_pages": 3}))
    generate_dataset(cfg.split_dir("val"), 3, seed=970_000)
    worse = check_stage(cfg, "stage1", base, curation_model_dir)
    assert worse.below and worse.kept == str(base) and worse.output_overall < worse.input_overall
    assert worse.pages == 3 and "ENDED BELOW" in worse.line()
    better = check_stage(cfg, "stage2", curation_model_dir, base)
    assert not better.below and better.kept == str(base)
    assert "truth: synthetic 3" in better.line()  # the check names the truth it graded on
    twin = Path(shutil.copytree(base, tmp_path / "twin"))  # a stage that changed nothing the check can see
    tie = check_stage(cfg, "stage3", base, twin)
    assert tie.tied and tie.kept == str(base) and "TIED its input" in tie.line()
    cfg.training.keep_ties = True
    assert check_stage(cfg, "stage3", base, twin).kept == str(twin)
    cfg.training.keep_better = False
    assert check_stage(cfg, "stage1", base, curation_model_dir).kept == str(curation_model_dir)


def test_the_stage_check_takes_pages_with_independent_truth_first_and_names_silver_truth(tmp_path):
    from components.data.pages import Page
    from lifecycle.stage_check import check_pages, describe_check_truth

    store = PageDataset(tmp_path / "val")
    records = {"ocr": {"markup": "read by OCR", "confidence": 0.8, "model_version": "rapidocr-3.4", "elements": [],
                       "extra": {"source": "ocr"}},
               "layer": {"markup": "from the text layer", "confidence": 1.0, "model_version": "auto", "elements": [],
                         "extra": {"source": "text-layer"}}}
    pages = [Page(f"p{i}", "images/none.png", 32, 32, [], meta={"preannotation": records[kind], "truth": truth},
                  markup_override=records[kind]["markup"])
             for i, (kind, truth) in enumerate([("ocr", "preannotation:rapidocr-3.4"), ("ocr", "preannotation:rapidocr-3.4"),
                                                ("layer", "text-layer")])]
    store.upsert(pages)
    chosen = check_pages(store, 2)
    assert [page.page_id for page in chosen] == ["p2", "p0"]
    assert describe_check_truth(chosen[1:]).endswith("(silver: graded on a model's pre-annotation, not independent truth)")
    assert describe_check_truth(chosen[:1]) == "text-layer 1"


def test_stage2_without_hard_pages_trains_on_its_dataset_alone(tmp_path):
    """Mining that finds no hard page leaves no hard store: Stage 2 must not point at the YAML's
    default one (the real demo failed there), and with one it mixes it in."""
    from components.data.synthetic import generate_dataset
    from components.training.config import load_train_config
    from lifecycle.stages import stage_overrides

    cfg = load_pipeline_config("configs/pipeline/demo.yaml")
    train = tmp_path / "train"
    generate_dataset(train, 2, seed=3)
    base = Path("models/pretrained/docmarkup-base")
    none = stage_overrides(cfg, "stage2", train, base, None, None)
    config = load_train_config(cfg.training.stages["stage2"].config, none)
    assert config.data.hard_examples is None and config.data.hard_ratio == 0.0
    some = stage_overrides(cfg, "stage2", train, base, tmp_path / "hard", None)
    assert some["data.hard_examples"] == str(tmp_path / "hard") and "data.hard_ratio" not in some
