"""Evaluation report, MLflow registration and the champion gates, on a real SQLite MLflow store."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import mlflow
import pytest

from components.data.synthetic import generate_dataset
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.evaluate import evaluate_decoders, merge_reports
from components.registry import mlflow_registry as registry
from lifecycle.evaluation import log_report
from models.loading import new_tiny_model, save_markup_model


@pytest.fixture(scope="module")
def tiny_model_dir(tokenizer, tmp_path_factory):
    return save_markup_model(new_tiny_model(tokenizer), tokenizer, tmp_path_factory.mktemp("model"))


DECODERS = [DecodeParams(decoder=name, max_new_tokens=24) for name in ("sdb", "ppc")]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return generate_dataset(tmp_path_factory.mktemp("pages"), 3, seed=123)


@pytest.fixture(scope="module")
def report(tiny_model_dir, dataset):
    return evaluate_decoders(DecodingEngine.from_pretrained(tiny_model_dir), dataset, DECODERS)


def test_reports_of_disjoint_shards_merge_into_the_report_of_all_pages(report, tiny_model_dir, dataset):
    engine = DecodingEngine.from_pretrained(tiny_model_dir)
    pages = dataset.pages()
    parts = [evaluate_decoders(engine, dataset, DECODERS, pages=pages[:2]), evaluate_decoders(engine, dataset, DECODERS, pages=pages[2:])]
    merged = merge_reports(parts)
    assert merged.n_pages == 3 and list(merged.decoders) == list(report.decoders)
    for name, whole in report.decoders.items():
        assert merged.decoders[name].scores == pytest.approx(whole.scores)
        assert merged.decoders[name].outputs == whole.outputs
        assert merged.decoders[name].speed["forward_passes"] == whole.speed["forward_passes"]
        assert [row["page_id"] for row in merged.decoders[name].pages] == [p.page_id for p in pages]
    assert merged.ratios()["sdb"]["forward_reduction"] == pytest.approx(report.ratios()["sdb"]["forward_reduction"])


def test_report_compares_every_decoder_with_ar_in_one_run(report):
    assert list(report.decoders) == ["ar", "sdb", "ppc"]  # AR is added as the baseline
    ratios = report.ratios()
    assert ratios["ar"]["forward_reduction"] == pytest.approx(1.0)
    assert ratios["sdb"]["same_output_as_ar"] == 1.0  # greedy SDB is exact
    assert report.decoders["ar"].speed["tokens_per_forward"] == pytest.approx(1.0)
    flat = report.flat_metrics()
    assert {"ar.overall", "sdb.forward_reduction", "ppc.overall_delta", "ar.forwards_per_page"} <= set(flat)
    assert "decoder" in report.table() and "sdb" in report.table()


def test_one_overall_in_the_table_named_for_the_terms_present(report):
    """A near-perfect prose-only reading shows 99.68 (the terms present, as gated), never the
    capped 33.23; the formula term is named only where formulas exist."""
    from components.metrics import reported_overall

    prose = copy.deepcopy(report)
    for ev in prose.decoders.values():
        ev.scores = {"overall": 33.23, "overall_present": 99.68, "overall_terms": 1.0, "text_edit": 0.0032}
    table = prose.table()
    assert table.splitlines()[0].startswith("Overall of the terms present (text); truth:")
    assert "99.68" in table and "33.23" not in table and "formula term" not in table
    full = {"overall": 90.0, "overall_present": 90.0, "text_edit": 0.1, "table_teds": 0.9, "formula_edit": 0.1}
    assert reported_overall(full) == (90.0, "Overall")


def test_gates_are_checked_against_the_champion():
    gates = registry.Gates(max_score_drop=1.0, min_speedup=1.5, min_overall=10.0)
    good = {"ar.overall": 50.0, "sdb.forward_reduction": 2.0}
    assert registry.check_gates(good, None, gates) == []
    assert registry.check_gates(good, {"ar.overall": 49.9}, gates) == []  # better than the champion
    # A first champion (nothing served yet) may be within the allowed drop of its starting checkpoint.
    assert registry.check_gates(good, {"ar.overall": 50.5}, gates, incumbent_serves=False) == []
    [reason] = registry.check_gates(good, {"ar.overall": 52.0}, gates)
    assert "below the champion" in reason
    [reason] = registry.check_gates({"ar.overall": 50.0, "sdb.forward_reduction": 1.2}, None, gates)
    assert "1.20 is below the required 1.50x" in reason
    assert len(registry.check_gates({}, None, gates)) == 2
    assert "below the floor" in registry.check_gates({"ar.overall": 5.0, "sdb.forward_reduction": 2.0}, None, gates)[0]


def test_a_tie_with_the_champion_is_not_promoted_unless_it_is_faster():
    """Each promotion is a reload in production: equal to every digit is not an improvement; a
    challenger within the allowed drop needs the stated speed gain; min_improvement raises the bar."""
    gates = registry.Gates(max_score_drop=1.0, min_speedup=0.0)
    champion = {"ar.overall_present": 99.68, "ar.overall_terms": 1.0, "ar.tokens_per_second": 100.0,
                "sdb.forward_reduction": 2.0}
    tie = dict(champion)
    [reason] = registry.check_gates(tie, champion, gates)
    assert "does not improve on the champion's 99.68" in reason and "a tie is not promoted" in reason
    assert registry.check_gates({**tie, "ar.overall_present": 99.69}, champion, gates) == []
    assert registry.check_gates({**tie, "ar.tokens_per_second": 130.0}, champion, gates) == []  # stated speed gain
    assert registry.check_gates({**tie, "ar.overall_present": 99.0, "ar.tokens_per_second": 130.0}, champion, gates) == []
    [reason] = registry.check_gates({**tie, "ar.overall_present": 98.0, "ar.tokens_per_second": 130.0}, champion, gates)
    assert "below the champion's 99.68 - 1.0" in reason
    demanding = registry.Gates(min_improvement=0.5, min_speedup=0.0)
    assert registry.check_gates({**tie, "ar.overall_present": 100.0}, champion, demanding)
    assert registry.check_gates({**tie, "ar.overall_present": 100.0}, champion, registry.Gates(min_speedup=0.0)) == []


def test_register_and_promote_only_when_gates_pass(report, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    experiment_id = registry.configure(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="test-registry")
    gates = registry.Gates(max_score_drop=0.0, min_speedup=0.0)
    started = time.time() - 30.0  # an evaluation that took 30 s before it was logged
    run_1 = log_report(report, tiny_model_dir, params={"stage": "one"}, data_version="abc123", started_at=started,
                       experiment_id=experiment_id)
    version_1 = registry.register_version(run_1, name="tiny")
    decision = registry.promote_if_passing("tiny", version_1, gates)
    assert decision.passed and decision.previous_champion is None
    assert str(registry.champion("tiny").version) == version_1
    client = mlflow.MlflowClient()
    # Opens on its runs (not MLflow 3's GenAI overview); the run spans the evaluation; the version says why.
    assert client.get_experiment(experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    info = client.get_run(run_1).info
    assert (info.end_time - info.start_time) / 1000 >= 30.0
    registered = client.get_model_version("tiny", version_1)
    assert registered.tags["created_by"] == info.user_id and info.user_id  # MLflow leaves "Created by" blank
    description = registered.description
    assert description.startswith("PROMOTED to champion") and "ar.overall = " in description and ">= floor 0.00" in description

    worse = copy.deepcopy(report)
    worse.decoders["ar"].scores["overall"] = report.decoders["ar"].overall - 5.0
    run_2 = log_report(worse, tiny_model_dir)
    version_2 = registry.register_version(run_2, name="tiny")
    decision = registry.promote_if_passing("tiny", version_2, gates)
    assert not decision.passed and any("below the champion" in reason for reason in decision.reasons)
    assert str(registry.champion("tiny").version) == version_1  # alias did not move

    local = registry.download_model("models:/tiny@champion", tmp_path / "download")
    assert (local / "config.json").exists()
    page_set = generate_dataset(tmp_path / "p", 1, seed=5)
    [result] = DecodingEngine.from_pretrained(local).generate([page_set.load_image(page_set.pages()[0])], DecodeParams(max_new_tokens=4))
    assert result.stats.new_tokens >= 1
    with pytest.raises(LookupError, match="cannot resolve model"):
        registry.download_model("models:/tiny@nobody", tmp_path / "nothing")


def test_gates_on_a_prose_only_test_set_use_the_terms_present_and_say_so():
    from components.metrics import score_dataset

    prose = [("A paragraph of body text read well.", "A paragraph of body text read well.")] * 3
    scores = score_dataset(prose)
    assert scores.overall == pytest.approx(100 / 3) and scores.overall_present == pytest.approx(100.0)
    metrics = {f"ar.{k}": v for k, v in scores.as_dict().items()} | {"sdb.forward_reduction": 2.0}
    gates = registry.Gates(min_overall=82.0, min_speedup=1.5)
    assert registry.score_key_for(metrics, gates) == "ar.overall_present"
    assert registry.check_gates(metrics, None, gates) == []
    strict = registry.Gates(min_overall=82.0, min_speedup=1.5, score_metric="overall")
    [reason] = registry.check_gates(metrics, None, strict)
    assert reason.startswith("ar.overall=33.33 is below the floor")
    full = {"ar.overall": 90.0, "ar.overall_terms": 3.0, "ar.overall_present": 90.0, "sdb.forward_reduction": 2.0}
    assert registry.score_key_for(full, gates) == "ar.overall"


def test_pages_without_ground_truth_are_refused_with_a_count_not_scored_as_empty(tiny_model_dir, dataset):
    from dataclasses import replace

    from components.evaluation.evaluate import NoGroundTruthError

    engine = DecodingEngine.from_pretrained(tiny_model_dir)
    pages = dataset.pages()
    imported = replace(pages[0], page_id="imported", elements=[], markup_override=None)  # never pre-annotated
    report = evaluate_decoders(engine, dataset, DECODERS[:1], pages=[imported, *pages[1:]])
    assert report.n_pages == 2 and report.refused_no_truth == 1
    assert [row["page_id"] for row in report.decoders["ar"].pages] == [p.page_id for p in pages[1:]]
    assert report.decoders["ar"].scores["truncated_pages"] == 2.0  # 24 tokens never reach <eos> on these pages
    with pytest.raises(NoGroundTruthError, match="none of the 1 pages"):
        evaluate_decoders(engine, dataset, DECODERS[:1], pages=[imported])


def test_challenger_is_gated_against_the_baseline_scored_on_its_own_pages(report, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    registry.configure(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="test-baseline")
    gates = registry.Gates(max_score_drop=1.0, min_speedup=0.0)
    version = registry.register_version(log_report(report, tiny_model_dir), name="tiny-baseline")
    score = report.decoders["ar"].overall
    better = {"ar.overall": score + 1.5, "ar.overall_terms": 3.0}  # the starting checkpoint, same pages
    decision = registry.promote_if_passing("tiny-baseline", version, gates, baseline=better, baseline_label="starting checkpoint")
    assert not decision.passed and decision.baseline == "starting checkpoint"
    [reason] = decision.reasons
    assert "below starting checkpoint (same pages, this run)" in reason
    description = mlflow.MlflowClient().get_model_version("tiny-baseline", version).description
    assert description.startswith("NOT promoted") and "(starting checkpoint)" in description
    close = {"ar.overall": score + 0.5, "ar.overall_terms": 3.0}  # within the allowed drop
    assert registry.promote_if_passing("tiny-baseline", version, gates, baseline=close, baseline_label="x").passed


def test_the_starting_checkpoint_is_what_stage_one_continues():
    from components.pipeline import load_pipeline_config
    from lifecycle.stages import starting_checkpoint

    cfg = load_pipeline_config("configs/pipeline/demo.yaml")
    assert starting_checkpoint(cfg).resolve() == (Path("models/pretrained/docmarkup-base")).resolve()
    mine = load_pipeline_config("configs/pipeline/demo.yaml", {"training.base_model": "tests/fixtures"})
    assert starting_checkpoint(mine).resolve() == Path("tests/fixtures").resolve()


def test_auto_token_budget_comes_from_the_targets_and_the_models_positions(tiny_model_dir, dataset):
    from dataclasses import replace

    from components.evaluation.evaluate import token_budget

    engine = DecodingEngine.from_pretrained(tiny_model_dir)
    pages = dataset.pages()
    budget = token_budget(engine, pages)
    lengths = [len(engine.tokenizer(p.markup, add_special_tokens=False)["input_ids"]) + 1 for p in pages]
    assert budget.longest_target == max(lengths) and budget.too_long == 0
    assert max(lengths) * 1.1 <= budget.max_new_tokens < max(lengths) * 1.1 + 32 and budget.max_new_tokens % 32 == 0
    assert budget.room == engine.max_positions - engine.model.num_prefix_tokens - 1
    long_page = replace(pages[0], markup_override=" ".join(["analysis of the layer output"] * 2000))
    capped = token_budget(engine, [*pages, long_page])
    assert capped.max_new_tokens == capped.room and capped.too_long == 1
    assert "1 pages are longer than the model can emit" in capped.describe()


def test_the_free_ocr_reference_is_scored_on_the_same_real_pages():
    """RapidOCR reads held-out corpus pages (real documents, their text layer the truth) and is
    scored with the page metrics evaluation uses; an unknown reference is a config error."""
    from pydantic import ValidationError

    from components.data.page_store import PageDataset
    from components.evaluation.reference import ocr_reference_scores
    from components.pipeline import EvaluationSection

    store = PageDataset(Path(__file__).parent / "fixtures" / "corpus_pages")
    pages = list(store.pages())[:2]
    reference = ocr_reference_scores("rapidocr", store, pages, "edit")
    assert reference["pages"] == 2 and reference["model_version"].startswith("rapidocr-")
    # prose pages: the Overall counts the missing table and formula terms as 0, the terms present do not
    assert reference["text_edit"] < 0.1 and reference["overall_present"] > 90 > 40 > reference["overall"], reference
    with pytest.raises(ValidationError):
        EvaluationSection(ocr_reference="tesseract")
