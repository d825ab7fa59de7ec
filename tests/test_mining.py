"""Consistency mining with a real tiny model, hard-example export, and deterministic splits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from components.curation.mining import (
    JOURNAL_NAME,
    consistency_weight,
    hard_examples,
    mine_consistency,
    page_seed,
    write_hard_examples,
)
from components.curation.splits import SPLITS_FILE, assign_split, make_splits, validate_ratios
from components.data.page_store import PageDataset
from components.data.synthetic import generate_dataset, generate_page
from components.decoding.engine import DecodingEngine

T = 4
MAX_TOKENS = 16


class CountingEngine:
    """The real engine, with every generate() call recorded (and an optional crash on call k)."""

    def __init__(self, engine: DecodingEngine, crash_on_call: int | None = None):
        self.engine = engine
        self.calls: list[tuple[int, int | None, float]] = []  # (batch rows, seed, temperature)
        self.crash_on_call = crash_on_call

    def generate(self, images, params):
        self.calls.append((len(images), params.seed, params.temperature))
        if self.crash_on_call is not None and len(self.calls) == self.crash_on_call:
            raise RuntimeError("simulated crash")
        return self.engine.generate(images, params)


@pytest.fixture(scope="module")
def engine(curation_model_dir) -> DecodingEngine:
    return DecodingEngine.from_pretrained(curation_model_dir)


def _mine(engine, dataset, **overrides):
    settings = {"T": T, "temperature": 1.5, "tau_train": 0.9, "seed": 11, "max_new_tokens": MAX_TOKENS, "model_version": "tiny"}
    return mine_consistency(engine, dataset, **{**settings, **overrides})


def test_rejects_bad_settings(engine, tmp_path):
    dataset = generate_dataset(tmp_path / "pages", 1)
    with pytest.raises(ValueError, match="at least T=2"):
        _mine(engine, dataset, T=1)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        _mine(engine, dataset, temperature=0.0)
    with pytest.raises(ValueError, match="not boxes"):
        _mine(engine, dataset, kind="layout")
    with pytest.raises(ValueError, match="tau_train"):
        _mine(engine, dataset, tau_train=1.5)
    with pytest.raises(ValueError, match="decoder must be one of"):
        _mine(engine, dataset, decoder="beam")


def test_samples_that_agree_score_one(engine, tmp_path):
    """At a vanishing temperature every sample is the greedy decode, so C(x) = 1 and nothing is hard."""
    dataset = generate_dataset(tmp_path / "pages", 2, seed=20)
    report = _mine(CountingEngine(engine), dataset, temperature=1e-4)
    assert report.scores == {p.page_id: 1.0 for p in dataset.pages()} and report.hard == []
    assert all(p.meta["consistency"] == 1.0 and p.meta["hard"] is False for p in dataset.pages())


def test_disagreeing_samples_are_hard_stored_and_exported(engine, tmp_path):
    dataset = generate_dataset(tmp_path / "pages", 3, seed=30)
    counting = CountingEngine(engine)
    report = _mine(counting, dataset)
    ids = [p.page_id for p in dataset.pages()]
    # One batched engine call per page: T rows of the same image, seeded per page.
    assert counting.calls == [(T, page_seed(11, pid), 1.5) for pid in ids]
    assert set(report.scores) == set(ids) and all(0.0 <= c <= 1.0 for c in report.scores.values())
    assert min(report.scores.values()) < 1.0  # an untrained model sampled hot disagrees with itself
    assert report.hard == sorted((pid for pid, c in report.scores.items() if c < 0.9), key=lambda p: (report.scores[p], p))
    for page in dataset.pages():
        assert page.meta["consistency"] == report.scores[page.page_id]
        assert page.meta["hard"] == (report.scores[page.page_id] < 0.9)
        assert page.meta["consistency_run"]["T"] == T and page.meta["consistency_run"]["tau_train"] == 0.9
        assert consistency_weight(page, beta=2.0) == pytest.approx(1.0 + 2.0 * (1.0 - report.scores[page.page_id]))

    hard = hard_examples(dataset)
    assert [p.page_id for p in hard] == report.hard
    exported = write_hard_examples(dataset, tmp_path / "hard")
    assert [p.page_id for p in exported.pages()] == report.hard
    for page in exported.pages():
        assert exported.image_path(page).read_bytes() == dataset.image_path(page).read_bytes()


def test_element_mining_scores_each_element_and_marks_the_hard_ones(engine, tmp_path):
    """Two-stage models: a page's T parses are one engine batch of T x elements; each element gets
    its own C, the page's C is their mean, and Stage 2 sees each element's own C."""
    from components.parsing import ParseSettings
    from components.training.data import load_examples

    dataset = generate_dataset(tmp_path / "pages", 2, seed=50)
    counting = CountingEngine(engine)
    report = _mine(counting, dataset, parsing=ParseSettings("elements", "ground-truth"))
    for page in dataset.pages():
        body = [i for i, e in enumerate(page.elements) if e.category in ("title", "text", "table", "formula")]
        scores = page.meta["element_consistency"]
        assert len(scores) == len(page.elements)
        assert [i for i, c in enumerate(scores) if c is not None] == body
        assert page.meta["consistency"] == pytest.approx(sum(scores[i] for i in body) / len(body), abs=1e-5)
        hard = page.meta["hard_elements"]
        assert [e["index"] for e in hard] == [i for i in body if scores[i] < 0.9]
        assert page.meta["hard"] == bool(hard)
        assert all(e["box"] == [round(v, 1) for v in page.elements[e["index"]].bbox] for e in hard)
    assert [rows for rows, _, _ in counting.calls] == [
        T * sum(e.category in ("title", "text", "table", "formula") for e in p.elements) for p in dataset.pages()]
    assert min(report.scores.values()) < 1.0
    examples = load_examples(dataset.root, engine.tokenizer, 64, unit="element")
    first = dataset.pages()[0]
    expected = [c for c in first.meta["element_consistency"] if c is not None]
    assert [e.consistency for e in examples if e.page_id == first.page_id] == pytest.approx(expected)


def test_resume_skips_finished_pages_and_retau_only_relabels(engine, tmp_path):
    dataset = generate_dataset(tmp_path / "pages", 3, seed=40)
    first = _mine(CountingEngine(engine), dataset)

    again = CountingEngine(engine)
    second = _mine(again, dataset)
    assert again.calls == [] and second.scores == first.scores and second.skipped == list(first.scores)

    stricter = CountingEngine(engine)
    relabelled = _mine(stricter, dataset, tau_train=1.0)
    assert stricter.calls == []
    assert sorted(relabelled.hard) == sorted(pid for pid, c in first.scores.items() if c < 1.0)
    assert all(p.meta["hard"] == (p.meta["consistency"] < 1.0) for p in dataset.pages())

    other_settings = CountingEngine(engine)
    _mine(other_settings, dataset, T=3)  # different settings: every page is mined again
    assert len(other_settings.calls) == 3

    redo = CountingEngine(engine)
    redone = _mine(redo, dataset, resume=False)
    assert len(redo.calls) == 3 and redone.scores == first.scores  # same seeds, same samples


def test_crash_keeps_finished_pages_and_resume_completes(engine, tmp_path):
    dataset = generate_dataset(tmp_path / "pages", 4, seed=50)
    ids = [p.page_id for p in dataset.pages()]
    with pytest.raises(RuntimeError, match="simulated crash"):
        _mine(CountingEngine(engine, crash_on_call=3), dataset, flush_every=100)
    assert [p.page_id for p in dataset.pages() if "consistency" in p.meta] == ids[:2]

    resumed = CountingEngine(engine)
    report = _mine(resumed, dataset)
    assert [seed for _, seed, _ in resumed.calls] == [page_seed(11, pid) for pid in ids[2:]]
    assert report.skipped == ids[:2] and report.mined == ids[2:]
    records = [json.loads(line) for line in (dataset.root / JOURNAL_NAME).read_text().splitlines()]
    assert [r["page_id"] for r in records] == ids

    # A page scored alone gets the same C as in the full run: its seed depends on its id only.
    alone = PageDataset(tmp_path / "alone")
    generate_dataset(alone.root, 4, seed=50)
    solo = _mine(engine, alone, page_ids=[ids[3]])
    assert solo.scores == {ids[3]: report.scores[ids[3]]}


def test_corrupt_page_is_reported_and_skipped(engine, tmp_path):
    dataset = generate_dataset(tmp_path / "pages", 3, seed=60)
    pages = dataset.pages()
    dataset.image_path(pages[1]).write_bytes(b"garbage")
    report = _mine(CountingEngine(engine), dataset)
    assert list(report.failed) == [pages[1].page_id] and "corrupt" in report.failed[pages[1].page_id]
    assert set(report.scores) == {pages[0].page_id, pages[2].page_id}


# ----- splits ---------------------------------------------------------------------------------
def test_split_assignment_is_deterministic_and_follows_ratios():
    ratios = {"train": 0.8, "val": 0.1, "test": 0.1}
    assignments = [assign_split(f"page:{i}", ratios) for i in range(4000)]
    assert assignments == [assign_split(f"page:{i}", ratios) for i in range(4000)]
    for name, ratio in ratios.items():
        assert abs(assignments.count(name) / 4000 - ratio) < 0.03
    assert assign_split("page:1", ratios, salt="other") in ratios
    with pytest.raises(ValueError, match="sum to 1"):
        validate_ratios({"train": 0.8, "val": 0.1})
    with pytest.raises(ValueError, match=">= 0"):
        validate_ratios({"train": 1.2, "val": -0.2})


def test_splits_never_move_a_page_and_keep_documents_together(tmp_path):
    dataset = generate_dataset(tmp_path / "pages", 30, seed=0)
    first = make_splits(dataset, {"train": 0.6, "val": 0.2, "test": 0.2}, out_dir=tmp_path / "splits")
    assert sum(first.counts().values()) == 30 and len(first.new_pages) == 30
    first_assignments = first.assignments
    for name, subset in first.datasets.items():
        assert sorted(p.page_id for p in subset.pages()) == first.pages_of(name)
    # Curation state stored on a split's pages (C(x) from mining the train split) survives a re-split.
    train = first.datasets["train"]
    mined = [replace(p, meta={**p.meta, "consistency": 0.5}) for p in train.pages()]
    train.write(mined)
    make_splits(dataset, {"train": 0.6, "val": 0.2, "test": 0.2}, out_dir=tmp_path / "splits")
    assert all(p.meta["consistency"] == 0.5 for p in PageDataset(tmp_path / "splits" / "train").pages())

    # Add pages, two of them from one document, and change the ratios: old pages stay put.
    extra = [generate_page(1000 + i)[0] for i in range(12)]
    for i, page in enumerate(extra):
        page.image = dataset.save_image(page.page_id, generate_page(1000 + i)[1])
        if i < 2:
            page.meta["document_id"] = "report-7"
    dataset.upsert(extra)
    second = make_splits(dataset, {"train": 0.1, "val": 0.1, "test": 0.8})
    assert {pid: second.assignments[pid] for pid in first_assignments} == first_assignments
    assert sorted(second.new_pages) == sorted(p.page_id for p in extra)
    assert second.assignments[extra[0].page_id] == second.assignments[extra[1].page_id]
    assert {p.page_id: p.meta["split"] for p in dataset.pages()} == second.assignments  # recorded on each page
    assert json.loads((dataset.root / SPLITS_FILE).read_text())["ratios"] == {"train": 0.1, "val": 0.1, "test": 0.8}

    with pytest.raises(ValueError, match="reassign=True"):
        make_splits(dataset, {"train": 0.5, "holdout": 0.5})
    rebuilt = make_splits(dataset, {"train": 0.5, "holdout": 0.5}, reassign=True)
    assert set(rebuilt.assignments.values()) <= {"train", "holdout"}


def test_a_hard_element_is_marked_on_its_label_studio_region():
    from components.curation.labelstudio.interface import LAYOUT_FIELD
    from components.curation.labelstudio.predictions import PagePrediction, block_regions
    from components.data.pages import LayoutElement, Page

    page = Page("p", "p.png", 100, 200)
    elements = (LayoutElement("text", (0, 0, 50, 20), "a"), LayoutElement("table", (0, 40, 100, 120), "<table></table>"))
    regions = block_regions(PagePrediction("p", "a", 0.4, elements, (None, 0.42)), page)
    rectangles = [r for r in regions if r["from_name"] == LAYOUT_FIELD]
    assert "meta" not in rectangles[0] and "score" not in rectangles[0]
    assert rectangles[1]["score"] == 0.42 and rectangles[1]["meta"]["text"] == ["hard element: consistency 0.42"]
    assert rectangles[1]["value"]["y"] == 20.0 and rectangles[1]["value"]["height"] == 40.0


def test_a_model_consistent_on_every_page_leaves_no_hard_store_and_nothing_to_queue(tmp_path):
    """No page below tau: no hard store is written, and collecting the hard examples says so instead
    of failing (the copy-prior reader is consistent on every page of the real demo)."""
    from components.pipeline import load_pipeline_config
    from lifecycle.curation import collect_hard_examples

    cfg = load_pipeline_config("configs/pipeline/demo.yaml", {"repo_root": str(tmp_path), "data_dir": "data"})
    generate_dataset(cfg.split_dir("train"), 2, seed=5)  # never mined: no page is hard
    summary, predictions = collect_hard_examples(cfg, "models/pretrained/docmarkup-base", [])
    assert predictions == [] and summary["hard"] == 0
    assert not PageDataset(cfg.hard_dir).exists()
