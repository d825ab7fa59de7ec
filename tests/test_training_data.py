"""Training data order, Stage-2 mixing and weights, config validation, DeepSpeed config resolution."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from components.data.page_store import PageDataset
from components.data.pages import InvalidPageError
from components.data.synthetic import generate_dataset
from components.training.config import TrainConfigError, load_train_config, parse_train_config
from components.training.data import (
    BatchPlan,
    TrainingData,
    collate,
    dataset_fingerprint,
    encode_markup,
    load_examples,
)
from components.training.runtime import lr_factor, resolve_deepspeed_config

ROOT = Path(__file__).resolve().parents[1]


def _raw(tmp_path: Path, **changes) -> dict:
    raw = {
        "name": "t", "output_dir": str(tmp_path / "out"), "deepspeed": "configs/deepspeed/zero1.json",
        "model": {"bootstrap": {}}, "data": {"dataset": str(tmp_path / "data")},
        "objectives": {"ar": 1.0}, "train": {"steps": 10},
    }
    for key, value in changes.items():
        node = raw
        *parents, leaf = key.split("__")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return raw


# ----- data order ---------------------------------------------------------------------------
def test_plan_is_a_function_of_seed_and_step_and_covers_each_epoch_once():
    plan = BatchPlan(n_base=12, n_hard=0, hard_ratio=0.0, seed=7, micro_batch=2, grad_accum=1, world_size=2)
    again = BatchPlan(n_base=12, n_hard=0, hard_ratio=0.0, seed=7, micro_batch=2, grad_accum=1, world_size=2)
    epoch = [idx for step in range(3) for _, idx in plan.global_indices(step)]
    assert sorted(epoch) == list(range(12))
    assert [again.global_indices(s) for s in (5, 0, 2)] == [plan.global_indices(s) for s in (5, 0, 2)]
    other_seed = BatchPlan(n_base=12, n_hard=0, hard_ratio=0.0, seed=8, micro_batch=2, grad_accum=1, world_size=2)
    assert [other_seed.global_indices(s) for s in range(3)] != [plan.global_indices(s) for s in range(3)]
    rank0, rank1 = plan.micro_indices(4, 0, 0), plan.micro_indices(4, 0, 1)
    assert len(rank0) == len(rank1) == 2 and not set(rank0) & set(rank1)
    assert rank0 + rank1 == plan.global_indices(4)


def test_stage2_batches_mix_hard_pages_at_the_configured_ratio():
    plan = BatchPlan(n_base=50, n_hard=6, hard_ratio=0.25, seed=0, micro_batch=4, grad_accum=2, world_size=1)
    for step in range(10):
        sources = Counter(source for source, _ in plan.global_indices(step))
        assert sources == {"hard": 2, "base": 6}
    hard_seen = [i for step in range(3) for s, i in plan.global_indices(step) if s == "hard"]
    assert sorted(hard_seen) == list(range(6))  # hard pages cycle through their own epochs


def test_a_ratio_too_small_for_the_batch_is_rejected():
    with pytest.raises(ValueError, match="no hard page"):
        BatchPlan(n_base=50, n_hard=6, hard_ratio=0.01, seed=0, micro_batch=4, grad_accum=1, world_size=1)


# ----- examples, collate, weights -----------------------------------------------------------
@pytest.fixture(scope="module")
def pages_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("training-data") / "pages"
    generate_dataset(root, 6, seed=11)
    return root


def test_examples_are_bos_markup_eos_and_truncation_is_flagged(pages_dir, tokenizer):
    examples = load_examples(pages_dir, tokenizer, max_tokens=256)
    page = PageDataset(pages_dir).pages()[0]
    ids, finished = encode_markup(tokenizer, page.markup, 256)
    assert examples[0].token_ids == tuple(ids) and finished
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[1:-1]) == page.markup
    short = load_examples(pages_dir, tokenizer, max_tokens=8)
    assert all(len(e.token_ids) <= 8 for e in short) and not any(e.ends_with_eos for e in short)


def test_collate_pads_and_weights_hard_pages(pages_dir, tokenizer):
    examples = load_examples(pages_dir, tokenizer, max_tokens=256)
    examples = [replace(examples[0], consistency=0.25), examples[1]]
    batch = collate(examples, tokenizer.pad_token_id, consistency_beta=2.0,
                    preprocess=lambda images: torch.zeros(len(images), 1, 4, 4))
    n0, n1 = (len(e.token_ids) for e in examples)
    assert batch.lengths.tolist() == [n0, n1]
    assert batch.tokens.shape == (2, max(n0, n1))
    assert (batch.tokens[1, n1:] == tokenizer.pad_token_id).all()
    assert batch.weights.tolist() == pytest.approx([1 + 2.0 * 0.75, 1.0])


def test_bad_consistency_and_empty_pages_fail_before_training(tmp_path, pages_dir, tokenizer):
    dataset = PageDataset(pages_dir)
    pages = dataset.pages()
    bad = PageDataset(tmp_path / "bad")
    pages[0].meta["consistency"] = 1.7
    bad.write(pages)
    with pytest.raises(InvalidPageError, match=r"consistency 1\.7"):
        load_examples(bad.root, tokenizer, 256)
    pages[0].meta.pop("consistency")
    pages[1] = replace(pages[1], markup_override="   ")
    bad.write(pages)
    with pytest.raises(InvalidPageError, match="empty markup"):
        load_examples(bad.root, tokenizer, 256)
    with pytest.raises(FileNotFoundError, match=r"no page store"):
        load_examples(tmp_path / "missing", tokenizer, 256)


def test_training_data_batches_are_reproducible(pages_dir, tokenizer):
    examples = load_examples(pages_dir, tokenizer, 256)
    plan = BatchPlan(len(examples), 0, 0.0, seed=3, micro_batch=2, grad_accum=1, world_size=1)
    data = TrainingData(examples, None, plan, tokenizer.pad_token_id, 0.0, lambda imgs: torch.zeros(len(imgs), 1, 2, 2))
    first, again = data.batch(2, 0, 0), data.batch(2, 0, 0)
    assert first.page_ids == again.page_ids and torch.equal(first.tokens, again.tokens)


def test_fingerprint_changes_with_the_records(tmp_path, pages_dir):
    print_ = dataset_fingerprint(pages_dir)
    assert print_["n_pages"] == 6 and print_ == dataset_fingerprint(pages_dir)
    copy = PageDataset(tmp_path / "copy")
    pages = PageDataset(pages_dir).pages()
    copy.write(pages)
    before = dataset_fingerprint(copy.root)["pages_sha256"]
    pages[0].meta["consistency"] = 0.5
    copy.upsert([pages[0]])
    assert dataset_fingerprint(copy.root)["pages_sha256"] != before


# ----- config validation ----------------------------------------------------------------------
def test_valid_minimal_config(tmp_path):
    config = parse_train_config(_raw(tmp_path))
    assert config.active_objectives == {"ar": 1.0}
    assert config.optim.lr == 2e-5 and config.optim.warmup_steps == 500 and config.optim.weight_decay == 0.01


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"train__stpes": 3}, "train.stpes: unknown key"),
        ({"objectives": {"ar": 1.0, "diffusion": 1.0}}, "unknown objective(s) ['diffusion']"),
        ({"objectives": {"dar": 1.0, "darl": 1.0}}, "'dar' and 'darl' cannot be combined"),
        ({"objectives": {"ar": 0.0}}, "at least one objective"),
        ({"objectives": {"ar": -1.0}}, "must be >= 0"),
        ({"data__hard_ratio": 0.5}, "needs data.hard_examples"),
        ({"data__hard_examples": "x"}, "would never be sampled"),
        ({"model": {"bootstrap": {}, "init_from": "x"}}, "exactly one of model.init_from"),
        ({"objectives": {"block_diffusion": 1.0}, "data__max_tokens": 16}, "block length 32 exceeds"),
        ({"dar__draft": "oracle"}, "dar.draft"),
        ({"deepspeed": "configs/deepspeed/nope.json"}, "does not exist"),
        ({"model": {"init_from": "var/no-such-model"}}, "is not a model folder"),
    ],
)
def test_invalid_configs_are_rejected_with_the_key_named(tmp_path, changes, message):
    with pytest.raises(TrainConfigError) as info:
        parse_train_config(_raw(tmp_path, **changes))
    assert message in str(info.value)


def test_a_run_shorter_than_its_warmup_warms_up_for_half_its_steps(tmp_path):
    with pytest.warns(UserWarning, match=r"warmup_steps \(50\) >= train.steps \(10\)"):
        config = parse_train_config(_raw(tmp_path, optim__schedule="cosine", optim__warmup_steps=50))
    assert config.optim.warmup_steps == 5


def test_shipped_stage_configs_parse(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    stages = sorted((ROOT / "configs" / "train").glob("*.yaml"))
    assert {p.stem for p in stages} >= {"stage1", "stage2", "darl", "quick"}
    for path in stages:
        overrides = {"model.init_from": str(model_dir)} if "init_from" in path.read_text() else {}
        config = load_train_config(path, overrides)
        assert config.active_objectives
    stage2 = load_train_config(ROOT / "configs/train/stage2.yaml", {"model.init_from": str(model_dir)})
    assert stage2.data.hard_ratio > 0 and stage2.data.consistency_beta > 0
    darl = load_train_config(ROOT / "configs/train/darl.yaml", {"model.init_from": str(model_dir)})
    assert darl.darl.dtpo_coef == 0.1 and darl.darl.candidates == 4
    paper = load_train_config(ROOT / "configs/train/darl_paper.yaml", {"model.init_from": str(model_dir)})
    assert (paper.optim.lr, paper.optim.warmup_steps, paper.optim.weight_decay) == (2e-5, 500, 0.01)
    assert paper.train.epochs == 2 and paper.train.steps is None


def test_epochs_become_steps_from_the_data_and_the_schedule_is_checked_then():
    config = load_train_config(ROOT / "configs/train/quick.yaml", {"train.steps": None, "train.epochs": 2.0,
                                                                   "optim.schedule": "cosine", "optim.warmup_steps": 10})
    assert config.with_steps_for(n_examples=100, global_batch=8).train.steps == 25  # ceil(2 * 100 / 8)
    with pytest.warns(UserWarning, match="warmup_steps"):
        short = config.with_steps_for(n_examples=20, global_batch=8)  # 5 steps, less than the warmup
    assert (short.train.steps, short.optim.warmup_steps) == (5, 2)
    with pytest.raises(TrainConfigError, match=r"exactly one of train\.steps or train\.epochs"):
        load_train_config(ROOT / "configs/train/quick.yaml", {"train.epochs": 1.0})


def test_cli_overrides_and_bad_yaml(tmp_path):
    config = load_train_config(ROOT / "configs/train/quick.yaml", ["train.steps=70", "objectives.ar=0.5"])
    assert config.train.steps == 70 and config.objectives["ar"] == 0.5
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(TrainConfigError, match="not valid YAML"):
        load_train_config(broken)
    with pytest.raises(TrainConfigError, match=r"section\.key=value"):
        load_train_config(ROOT / "configs/train/quick.yaml", ["train.steps"])


# ----- DeepSpeed config and schedule ------------------------------------------------------------
def test_deepspeed_autos_are_filled_from_the_yaml(tmp_path):
    config = parse_train_config(_raw(tmp_path, train__micro_batch_size=3, train__grad_accum=2, optim__lr=5e-4))
    resolved = resolve_deepspeed_config(config)
    assert resolved["train_micro_batch_size_per_gpu"] == 3 and resolved["gradient_accumulation_steps"] == 2
    assert resolved["optimizer"]["params"]["lr"] == 5e-4 and resolved["optimizer"]["params"]["torch_adam"] is True
    assert resolved["zero_optimization"]["stage"] == 1 and "scheduler" not in resolved


def test_deepspeed_json_may_not_contradict_the_yaml(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                              "scheduler": {"type": "WarmupLR"}}))
    config = parse_train_config(_raw(tmp_path, deepspeed=str(ds)))
    with pytest.raises(TrainConfigError) as info:
        resolve_deepspeed_config(config)
    for key in ("train_micro_batch_size_per_gpu", "optimizer.params.lr", "scheduler"):
        assert key in str(info.value)


def test_lr_schedule_warms_up_then_decays():
    assert lr_factor(0, 4, 20, "constant", 0.0) == pytest.approx(0.25)  # the first step already moves
    assert lr_factor(3, 4, 20, "constant", 0.0) == 1.0 and lr_factor(19, 4, 20, "constant", 0.0) == 1.0
    assert lr_factor(4, 4, 20, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(20, 4, 20, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(12, 4, 20, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(0, 0, 10, "constant", 0.0) == 1.0


# ----- streaming from a sharded store -------------------------------------------------------
@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, pages_dir) -> Path:
    root = tmp_path_factory.mktemp("sharded") / "pages"
    source = PageDataset(pages_dir)
    store = PageDataset(root, shard_rows=2)
    pages = source.pages()
    for page in pages:
        store.store_image(source.load_image(page))
    store.write(pages)
    assert len(store.shards()) == 3
    return root


def test_sharded_examples_tokenise_each_shard_once_and_cover_the_store(sharded_dir, tokenizer, monkeypatch):
    from components.training.data import ShardedExamples

    examples = load_examples(sharded_dir, tokenizer, 256)
    assert sorted(e.page_id for e in examples) == sorted(PageDataset(sharded_dir).ids())
    caches = sorted((sharded_dir / ".token-cache").glob("*.npz"))
    assert len(caches) == 3 and examples.shard_sizes == [2, 2, 2]
    monkeypatch.setattr(ShardedExamples, "_tokenise", lambda *_: pytest.fail("a cached shard was tokenised again"))
    again = load_examples(sharded_dir, tokenizer, 256)
    assert [e.token_ids for e in again] == [e.token_ids for e in examples]


def test_the_token_cache_follows_pages_a_newer_shard_replaced(tmp_path, pages_dir, tokenizer):
    source = PageDataset(pages_dir)
    store = PageDataset(tmp_path / "store", shard_rows=4)
    pages = source.pages()
    for page in pages:
        store.store_image(source.load_image(page))
    store.write(pages)
    before = {e.page_id: e.token_ids for e in load_examples(store.root, tokenizer, 256)}
    changed = replace(pages[0], markup_override="# Changed title")
    store.upsert([changed])  # the first shard keeps its file, with one dead row
    assert [s.dead for s in store.shards()] == [1, 0, 0]
    after = {e.page_id: e.token_ids for e in load_examples(store.root, tokenizer, 256)}
    assert after.keys() == before.keys()
    assert tokenizer.decode(after[changed.page_id][1:-1]) == "# Changed title"
    assert all(after[pid] == before[pid] for pid in before if pid != changed.page_id)


def test_block_shuffle_covers_each_epoch_once_and_reads_few_shards_at_a_time():
    sizes = [5] * 40
    plan = BatchPlan(sizes, 0, 0.0, seed=1, micro_batch=4, grad_accum=1, world_size=1)
    epoch = [i for step in range(50) for _, i in plan.global_indices(step)]
    assert sorted(epoch) == list(range(200))
    for start in range(0, 200, 20):  # each stretch of 20 examples comes from one block of 4 shards
        assert len({i // 5 for i in epoch[start : start + 20]}) <= 4
    assert epoch != sorted(epoch)


def test_dataloader_workers_give_the_same_batches_as_the_main_process(sharded_dir, tokenizer):
    from functools import partial

    from models.docvlm import page_pixels

    examples = load_examples(sharded_dir, tokenizer, 256)
    plan = BatchPlan(examples.shard_sizes, 0, 0.0, seed=5, micro_batch=2, grad_accum=2, world_size=1)
    preprocess = partial(page_pixels, image_size=(64, 48), ink_scale=1.0)
    data = TrainingData(examples, None, plan, tokenizer.pad_token_id, 0.0, preprocess)
    expected = [data.batch(step, micro, 0) for step in range(3, 6) for micro in range(2)]
    streamed = list(data.batches(3, 6, rank=0, workers=2))
    assert [b.page_ids for b in streamed] == [b.page_ids for b in expected]
    assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.pages, b.pages)
               for a, b in zip(streamed, expected, strict=True))
