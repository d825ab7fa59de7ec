"""Bring-your-own PDFs through curation: every page of one PDF in one split, each page trained and
scored against its best truth, unusable pages dropped with a count (never a training crash)."""

from __future__ import annotations

from collections import Counter

import pytest

from components.curation.labelstudio.predictions import PagePrediction
from components.curation.preannotate import PreAnnotation
from components.curation.splits import make_splits
from components.curation.targets import TargetReport, page_with_target
from components.data.page_store import PageDataset
from components.data.pages import LayoutElement, Page
from components.data.pdf import import_pdfs
from lifecycle.curation import choose_for_queue
from tests.test_pdf_loader import synthetic_pages, write_pdf


def _preannotated(page: Page, markup: str, elements: list[LayoutElement] | None = None, confidence: float = 0.97) -> Page:
    record = PreAnnotation(markup, confidence, "rapidocr-test", elements or []).to_json()
    return Page(page.page_id, page.image, page.width, page.height, [], page.source, {**page.meta, "preannotation": record})


def test_pages_of_one_pdf_share_a_document_id_and_a_split(tmp_path):
    (tmp_path / "pdfs").mkdir()
    for index in range(8):  # eight documents of three pages each
        write_pdf(tmp_path / "pdfs" / f"doc-{index}.pdf", synthetic_pages(range(3 * index, 3 * index + 3)))
    import_pdfs(tmp_path / "pdfs", tmp_path / "pages", dpi=36)
    store = PageDataset(tmp_path / "pages")
    documents = Counter(page.meta["document_id"] for page in store.pages())
    assert len(documents) == 8 and set(documents.values()) == {3}
    make_splits(store, {"train": 0.5, "val": 0.25, "test": 0.25})
    splits_of = {}
    for page in store.pages():
        splits_of.setdefault(page.meta["document_id"], set()).add(page.meta["split"])
    assert all(len(splits) == 1 for splits in splits_of.values())  # no document leaks across splits
    assert len({split for splits in splits_of.values() for split in splits}) > 1


def test_each_page_gets_its_best_truth_and_unusable_pages_are_counted():
    blank = Page("p", "img.png", 100, 100, source="pdf:doc.pdf#1")
    corrected = Page("c", "img.png", 100, 100, source="pdf:doc.pdf#2", markup_override="Corrected text.",
                     meta={"correction": {"annotator": 1}})
    synthetic = Page("s", "img.png", 100, 100, [LayoutElement("text", (0, 0, 10, 10), "Synthetic text.")])
    silver = _preannotated(Page("a", "img.png", 100, 100), "Pre-annotated text.", [LayoutElement("text", (0, 0, 9, 9), "x")])
    furniture = _preannotated(Page("f", "img.png", 100, 100), "", [LayoutElement("header", (0, 0, 9, 9), "Chapter 3")])
    empty = _preannotated(Page("e", "img.png", 100, 100), "  ")
    report = TargetReport()
    kept = {page.page_id: page_with_target(page, report) for page in (blank, corrected, synthetic, silver, furniture, empty)}
    assert kept["p"] is None and kept["f"] is None and kept["e"] is None
    assert kept["c"].markup == "Corrected text." and kept["s"].markup == "Synthetic text."
    assert kept["a"].markup == "Pre-annotated text." and kept["a"].meta["truth"] == "preannotation:rapidocr-test"
    assert report.summary() == {
        "kept": {"correction": 1, "synthetic": 1, "preannotation": 1},
        "dropped": {"not pre-annotated": 1, "only page furniture": 1, "empty pre-annotation": 1},
    }


def test_split_stores_hold_only_pages_with_a_target(tmp_path):
    write_pdf(tmp_path / "doc.pdf", synthetic_pages(range(4)))
    import_pdfs(tmp_path / "doc.pdf", tmp_path / "pages", dpi=36)
    store = PageDataset(tmp_path / "pages")
    pages = store.pages()
    store.upsert([_preannotated(pages[0], "Read text."), _preannotated(pages[1], "")])
    report = TargetReport()
    result = make_splits(store, {"train": 1.0}, out_dir=tmp_path / "splits",
                         target=lambda page: page_with_target(page, report))
    assert result.counts() == {"train": 4}  # every page keeps its split assignment
    assert [page.markup for page in result.datasets["train"].pages()] == ["Read text."]
    assert report.dropped == Counter({"not pre-annotated": 2, "empty pre-annotation": 1})


def test_queue_policies_threshold_and_budget():
    candidates = [PagePrediction(f"p{i}", "text", confidence) for i, confidence in enumerate((0.999, 0.97, 0.995, 0.98))]
    threshold = choose_for_queue(candidates, policy="threshold", below=0.9, max_tasks=10)
    assert threshold == []  # a confident pre-annotator queues nothing under a threshold...
    budget = choose_for_queue(candidates, policy="budget", below=0.9, max_tasks=3, already_queued=1)
    assert [p.page_id for p in budget] == ["p1", "p3"]  # ...a budget takes the least confident, across sources
    raised = choose_for_queue(candidates, policy="threshold", below=0.99, max_tasks=10)
    assert [p.page_id for p in raised] == ["p1", "p3"]


def test_a_handful_of_pdfs_still_gives_every_split_a_document(tmp_path):
    (tmp_path / "pdfs").mkdir()
    for index in range(4):
        write_pdf(tmp_path / "pdfs" / f"manual-{index}.pdf", synthetic_pages(range(2 * index, 2 * index + 2)))
    import_pdfs(tmp_path / "pdfs", tmp_path / "pages", dpi=36)
    store = PageDataset(tmp_path / "pages")
    result = make_splits(store, {"train": 0.9, "val": 0.05, "test": 0.05})
    assert all(count >= 2 for count in result.counts().values()), result.counts()  # whole documents in each
    before = {page.page_id: page.meta["split"] for page in store.pages()}
    write_pdf(tmp_path / "pdfs" / "manual-4.pdf", synthetic_pages(range(40, 42)))
    import_pdfs(tmp_path / "pdfs", tmp_path / "pages", dpi=36)
    make_splits(store, {"train": 0.9, "val": 0.05, "test": 0.05})
    assert all(store.get(page_id).meta["split"] == split for page_id, split in before.items())  # nothing moves


def test_every_preannotated_uncorrected_page_is_a_queue_candidate_on_every_run(tmp_path):
    """Raising the threshold later must reach pages pre-annotated by earlier runs."""
    from lifecycle.curation import preannotated_candidates

    write_pdf(tmp_path / "doc.pdf", synthetic_pages(range(3)))
    import_pdfs(tmp_path / "doc.pdf", tmp_path / "pages", dpi=36)
    store = PageDataset(tmp_path / "pages")
    first, second, third = store.pages()
    corrected = _preannotated(third, "Text.")
    corrected.meta["correction"] = {"annotator": 1}
    store.upsert([_preannotated(first, "Earlier run."), corrected])
    assert [p.page_id for p in preannotated_candidates(store)] == [first.page_id]
    store.upsert([_preannotated(second, "This run.")])
    candidates = preannotated_candidates(store)
    assert sorted(p.page_id for p in candidates) == sorted([first.page_id, second.page_id])
    assert {p.markup for p in candidates} == {"Earlier run.", "This run."} and {p.confidence for p in candidates} == {0.97}


@pytest.mark.services
def test_raising_the_threshold_later_queues_pages_pre_annotated_by_earlier_runs(label_studio, tmp_path):
    """The real Label Studio: a confident pre-annotator queues nothing at 0.9; raising the threshold
    (or switching to a budget) on a later run queues the pages annotated back then, least confident first."""
    import uuid

    from components.curation.labelstudio.api import connect, queued_page_ids
    from components.pipeline import load_pipeline_config
    from lifecycle.curation import label_studio as project_of
    from lifecycle.curation import preannotated_candidates, queue_for_annotation

    write_pdf(tmp_path / "doc.pdf", synthetic_pages(range(4)))
    import_pdfs(tmp_path / "doc.pdf", tmp_path / "pages", dpi=36)
    store = PageDataset(tmp_path / "pages")
    confidences = (0.999, 0.97, 0.995, 0.98)
    store.upsert([_preannotated(page, f"Text of page {i}.", confidence=c)
                  for i, (page, c) in enumerate(zip(store.pages(), confidences, strict=True))])
    section = {"curation.label_studio.url": label_studio.url, "curation.label_studio.api_key": label_studio.api_key,
               "curation.label_studio.project": f"requeue-{uuid.uuid4().hex[:8]}", "curation.label_studio.view": "page"}
    cfg = load_pipeline_config("configs/pipeline/demo.yaml", {**section, "curation.label_studio.queue_below_confidence": 0.9})
    client = connect(label_studio.url, label_studio.api_key)
    try:
        assert queue_for_annotation(cfg, store, preannotated_candidates(store), "rapidocr-test")["queued"] == 0
        raised = load_pipeline_config("configs/pipeline/demo.yaml", {**section, "curation.label_studio.queue_below_confidence": 0.99})
        assert queue_for_annotation(raised, store, preannotated_candidates(store), "rapidocr-test")["queued"] == 2
        budget = load_pipeline_config("configs/pipeline/demo.yaml", {**section, "curation.label_studio.queue_policy": "budget",
                                                                      "curation.label_studio.max_tasks": 3})
        result = queue_for_annotation(budget, store, preannotated_candidates(store), "rapidocr-test")
        assert result["queued"] == 1 and result["already_queued"] == 2  # the budget counts tasks already there
        queued = queued_page_ids(client, project_of(cfg).project_id)
        pages = store.pages()
        assert set(queued) == {pages[1].page_id, pages[3].page_id, pages[2].page_id}
    finally:
        client.projects.delete(id=project_of(cfg).project_id)
