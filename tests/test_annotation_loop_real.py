"""The real-document annotation loop (benchmarks/annotation_loop/real.py): held-out documents stay
out of the pool, the metric is the body's edit distance, and one small loop runs every policy
through pre-annotation, picking, retraining and scoring with the shipped reader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.annotation_loop import real
from components.curation.storage import write_subset
from components.data.page_store import PageDataset
from components.data.pages import LayoutElement, Page
from components.evaluation.element_reading import ElementReading

FIXTURE = Path(__file__).parent / "fixtures" / "corpus_pages"


def _page(package: str, document: str, number: int) -> Page:
    return Page(page_id=f"{document}-{number}", image="x.png", width=10, height=10,
                elements=[LayoutElement("text", (0, 0, 5, 5), "x")],
                meta={"package": package, "document_id": document, "pdf": f"{document}.pdf"})


def test_documents_are_held_out_whole_and_every_family_keeps_one():
    pages = [_page(package, f"{package}-doc{d}", n) for package in ("a-doc", "b-doc") for d in range(3)
             for n in range(4)]
    pages.append(_page("c-doc", "c-doc-only", 0))  # a family of one document cannot give one away
    pool, held_out = real.split_by_document(pages)
    held_documents = {p.meta["document_id"] for p in held_out}
    assert not held_documents & {p.meta["document_id"] for p in pool}
    assert {p.meta["package"] for p in held_out} == {"a-doc", "b-doc"}
    assert len(held_documents) == 2 and len(pool) + len(held_out) == len(pages)
    # which documents are held out depends on the documents, not on the order pages come in
    assert {p.page_id for p in real.split_by_document(list(reversed(pages)))[1]} == {p.page_id for p in held_out}


def test_pool_and_held_out_pages_from_several_corpus_splits_land_in_one_store(tmp_path):
    """A family's documents fall in the corpus's train, val or test split; the pool takes pages of all."""
    source = PageDataset(FIXTURE)
    pages = list(source.iter_pages())
    first, second = (write_subset(source, pages[:3], tmp_path / "train"), write_subset(source, pages[3:5], tmp_path / "val"))
    chosen = [*first.iter_pages(), *second.iter_pages()]
    where = {p.page_id: first for p in first.iter_pages()} | {p.page_id: second for p in second.iter_pages()}
    target = PageDataset(tmp_path / "pool")
    real.write_pages(target, chosen, where)
    assert sorted(target.ids()) == sorted(p.page_id for p in pages[:5])
    assert all(target.load_image(p).size == (p.width, p.height) for p in target.iter_pages())


def test_families_the_reader_trained_on_or_that_are_held_out_elsewhere_are_refused():
    real.check_families(real.FAMILIES)
    for family in ("r-doc-pdf", "freefem-doc", "gnuplot-doc"):
        with pytest.raises(ValueError, match="never saw"):
            real.check_families((*real.FAMILIES, family))


def _reading(page_id: str, content: str, truth: str) -> ElementReading:
    return ElementReading(page_id, "text", truth, content, 0, len(truth), True, None, 1, 1, 1.0, content)


def test_body_edit_is_per_page_over_the_joined_body_with_whitespace_collapsed():
    readings = [_reading("p", "Hello  world", "Hello world"), _reading("p", "abc", "abd"),
                _reading("q", "same", "same")]
    # page p: "Hello world abc" vs "Hello world abd" is 1 edit over 15; page q: 0
    assert real.body_text_edit(readings) == pytest.approx((1 / 15 + 0) / 2)


def test_a_small_real_loop_runs_every_policy_and_writes_the_issue_shape(tmp_path):
    """Pool: four pages of two documents, held out: two pages of a third, replay: two of a fourth."""
    source = PageDataset(FIXTURE)
    by_pdf = {}
    for page in source.iter_pages():
        by_pdf.setdefault(page.meta["pdf"], []).append(page)
    out = tmp_path / "loop"
    write_subset(source, by_pdf["freefem.pdf"] + by_pdf["manual.pdf"], out / "pool")
    write_subset(source, by_pdf["shared-mime-info-spec.pdf"], out / "heldout")
    write_subset(source, by_pdf["R-intro.pdf"], out / "replay" / "train")
    result = tmp_path / "result.json"
    assert real.main(["--real", "--out", str(out), "--result", str(result), "--rounds", "2", "--budget", "2",
                      "--check-share", "0.5", "--seeds", "0", "--steps-per-page", "1", "--batch", "4",
                      "--no-mlflow"]) == 0

    report = json.loads(result.read_text())
    assert report["metric"] == "body_text_edit" and report["budget"] == 2
    assert set(report["policies"]) == {"mined", "confidence", "random"}
    for rounds in report["policies"].values():
        assert len(rounds) == 3 and all(len(seeds) == 1 for seeds in rounds)
        assert rounds[0][0] == report["start"]["body_text_edit"]
        assert all(0.0 <= value <= 1.0 for seeds in rounds for value in seeds)
    assert report["documents"]["held_out"] == ["shared-mime-info-spec.pdf"]
    pool_ids = set(PageDataset(out / "pool").ids())
    for policy in ("mined", "confidence", "random"):
        rounds = out / "runs" / f"{policy}-seed0"
        trained, checked = PageDataset(rounds / "round2" / "annotated"), PageDataset(rounds / "round2" / "check")
        # each round: one corrected page to train on, one kept for the stage check; no page twice
        assert len(trained) == 2 and len(checked) == 2 and set(trained.ids()) | set(checked.ids()) == pool_ids
        for r in report["by_round"][policy]["0"][1:]:
            assert r["kept_output"] == float(r["check_output"] <= r["check_input"])
    # mined sends the two least consistent pages of the start model's samples to the annotators first
    journal = out / "pool" / "mined-seed0-round1.journal.jsonl"
    scores = {r["page_id"]: r["consistency"] for r in map(json.loads, journal.read_text().splitlines())}
    first = {*PageDataset(out / "runs" / "mined-seed0" / "round1" / "annotated").ids(),
             *PageDataset(out / "runs" / "mined-seed0" / "round1" / "check").ids()}
    assert first == set(sorted(scores, key=lambda pid: (scores[pid], pid))[:2])
    shutil.rmtree(out / "runs")
