"""The real-document corpus: text-layer lines become elements, documents split as a whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.data.corpus import HELD_OUT_PACKAGES, document_split, page_elements
from components.data.text_layer import TextLine


def _line(text: str, y: float, x: float = 100.0, size: float = 10.0, mono: bool = False, width: float = 400.0) -> TextLine:
    return TextLine(text, (x, y, x + width, y + 20.0), size, mono)


def test_lines_group_into_titles_paragraphs_and_indented_code():
    body = [
        _line("2.1 Installing", 100, size=14.4, width=200),
        _line("The package installs with one", 140), _line("command and no options.", 162),
        _line("install(pkg,", 200, mono=True, width=120), _line("repos = NULL)", 222, x=130, mono=True, width=130),
        _line("After a gap, a new paragraph.", 300),
    ]
    furniture = [_line("Chapter 2: Setup", 20), _line("17", 1500, width=20)]
    elements, lines = page_elements(body, furniture, height=1600)
    assert [len(group) for group in lines] == [1, 1, 2, 2, 1, 1]  # each element's line boxes
    assert [e.category for e in elements] == ["header", "title", "text", "code", "text", "footer"]
    assert elements[2].content == "The package installs with one command and no options."
    assert elements[3].content == "install(pkg,\n   repos = NULL)"  # 30 px at 10 px per character
    assert elements[1].bbox == (100.0, 100.0, 300.0, 120.0)


def test_a_column_change_starts_a_new_block_and_detected_tables_are_not_text():
    from components.parsing.layout.region import LayoutRegion

    body = [_line("left column line one", 100), _line("left column line two", 122),
            _line("right column line one", 100, x=700), _line("a table cell 12", 400, x=100)]
    table = LayoutRegion("table", (90.0, 390.0, 600.0, 430.0), 0.9)
    elements, lines = page_elements(body, [], height=1600, regions=[table])
    assert lines[-1] == []  # a figure has no text lines
    assert [(e.category, e.content) for e in elements] == [
        ("text", "left column line one left column line two"), ("text", "right column line one"), ("figure", "")]


def test_documents_split_whole_and_held_out_ones_are_test():
    assert all(document_split(package, Path("manual.pdf"), f"pdf:{package}") == "test" for package in HELD_OUT_PACKAGES)
    assert document_split("r-doc-pdf", Path("R-intro.pdf"), "pdf:abc") == "test"  # a benchmark document
    splits = [document_split("r-doc-pdf", Path(f"doc{i}.pdf"), f"pdf:{i:04d}") for i in range(400)]
    assert set(splits) == {"train", "val"} and 0.02 < splits.count("val") / 400 < 0.09
    assert document_split("r-doc-pdf", Path("x.pdf"), "pdf:0007") == splits[7]  # a function of the document only


def test_text_layer_reads_size_and_monospace_from_a_real_pdf(tmp_path):
    """A PDF written by matplotlib (DejaVu Sans and DejaVu Sans Mono, embedded with their text)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pypdfium2 as pdfium

    from components.data.text_layer import text_layer_lines

    figure = plt.figure(figsize=(6, 4))
    figure.text(0.1, 0.8, "A Heading", fontsize=18, family="DejaVu Sans")
    figure.text(0.1, 0.6, "body text in a proportional font", fontsize=10, family="DejaVu Sans")
    figure.text(0.1, 0.4, "x = f(y) # code", fontsize=10, family="DejaVu Sans Mono")
    figure.savefig(tmp_path / "page.pdf")
    plt.close(figure)
    lines = text_layer_lines(pdfium.PdfDocument(str(tmp_path / "page.pdf"))[0], dpi=144)
    by_text = {line.text: line for line in lines}
    assert set(by_text) == {"A Heading", "body text in a proportional font", "x = f(y) # code"}
    assert by_text["A Heading"].size == pytest.approx(18, rel=0.05) and not by_text["A Heading"].mono
    assert by_text["x = f(y) # code"].mono and not by_text["body text in a proportional font"].mono
    heading = by_text["A Heading"].box
    assert heading[0] == pytest.approx(0.1 * 6 * 144, abs=6)  # image pixels at 144 dpi


def test_synthetic_table_and_formula_pages_join_train_and_val(tmp_path):
    import json

    from components.data.corpus import build_corpus
    from components.data.page_store import PageDataset

    report = build_corpus([], tmp_path / "corpus", cache=tmp_path / "cache", synthetic_pages=20, progress=lambda _: None)
    train, val = PageDataset(tmp_path / "corpus" / "train"), PageDataset(tmp_path / "corpus" / "val")
    assert (len(train), len(val)) == (19, 1) and report.pages == {"train": 19, "val": 1}
    page = train.pages()[0]
    assert (page.width, page.height) == (768, 1024) and train.load_image(page).size == (768, 1024)
    assert report.elements["table"] > 0 and report.elements["formula"] > 0
    recorded = json.loads((tmp_path / "corpus" / "corpus.json").read_text())
    assert recorded["synthetic_pages"] == 20 and recorded["pages"] == {"train": 19, "val": 1}


def test_the_cli_versions_the_corpus_with_dvc(tmp_path, monkeypatch):
    import subprocess

    from recipes.build_corpus import main

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.chdir(tmp_path)
    assert main(["build", "--synthetic-pages", "2", "--out", "corpus", "--layout", "none", "--dvc"]) == 0
    tracked = (tmp_path / "corpus.dvc").read_text()
    assert "path: corpus" in tracked and "md5:" in tracked
    assert (tmp_path / "corpus" / "train").is_dir()


def _three_page_pdf(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_pdf import PdfPages

    with PdfPages(path) as pdf:
        for number in range(1, 4):
            figure = plt.figure(figsize=(6, 8))
            figure.text(0.1, 0.8, f"Section {number}", fontsize=16)  # below the running-head band
            for line in range(5):
                figure.text(0.1, 0.75 - 0.03 * line, f"body line {line} of page {number} with several words", fontsize=10)
            figure.text(0.1, 0.5, "run(x, y) # code", fontsize=10, family="DejaVu Sans Mono")
            pdf.savefig(figure)
            plt.close(figure)
    return path


def test_a_pdf_package_becomes_pages_with_elements_and_a_rerun_resumes(tmp_path, monkeypatch):
    import components.data.corpus as corpus
    from components.data.page_store import PageDataset

    pdf = _three_page_pdf(tmp_path / "manual.pdf")
    monkeypatch.setattr(corpus, "package_pdfs", lambda cache, package: [pdf])
    report = corpus.build_corpus(["local-doc"], tmp_path / "out", cache=tmp_path / "cache", progress=lambda _: None)
    split = corpus.document_split("local-doc", pdf, corpus.pdf_document_id(corpus.file_sha256(pdf)))
    store = PageDataset(tmp_path / "out" / split)
    pages = sorted(store.pages(), key=lambda p: p.meta["page_number"])
    assert report.pages == {split: 3} and report.documents == {split: 1}
    first = pages[0]
    assert [e.category for e in first.elements] == ["title", "text", "code"]
    assert first.elements[0].content == "Section 1" and first.elements[2].content == "run(x, y) # code"
    assert first.elements[1].content.startswith("body line 0 of page 1") and len(first.meta["element_lines"][1]) == 5
    assert (first.width, first.height) == (6 * 144, 8 * 144)

    rendered = []
    monkeypatch.setattr(corpus, "page_elements", lambda *a, **k: rendered.append(1) or ([], []))
    again = corpus.build_corpus(["local-doc"], tmp_path / "out", cache=tmp_path / "cache", progress=lambda _: None)
    assert rendered == [] and again.pages == report.pages  # every page was stored already


def test_a_sample_store_splits_by_document_and_a_pipeline_ingests_it_once(tmp_path):
    """The real pages ``./run demo --real`` ships: every split holds whole documents, and the
    ingest step copies the store (records and images) without duplicating it on a rerun."""
    from collections import defaultdict

    from PIL import Image

    from components.data.corpus import sample_store
    from components.data.page_store import PageDataset
    from lifecycle.curation import copy_pages

    fixture = Path(__file__).parent / "fixtures" / "corpus_pages"
    assert sample_store(fixture, tmp_path / "sample", pages=6, per_document=1) == 5  # five documents
    sample = PageDataset(tmp_path / "sample")
    splits = defaultdict(set)
    for page in sample.iter_pages():
        splits[page.meta["split"]].add(page.meta["document_id"])
        with Image.open(sample.image_path(page)) as stored:
            assert stored.mode == "L"  # grayscale PNG: a third of the RGB bytes
    assert {k: len(v) for k, v in splits.items()} == {"train": 3, "val": 1, "test": 1}
    target = PageDataset(tmp_path / "pages")
    assert copy_pages(sample, target) == 5
    assert copy_pages(sample, target) == 0
    assert [p.elements for p in target.iter_pages()] == [p.elements for p in sample.iter_pages()]


def test_an_underscore_under_the_baseline_stays_on_its_line(tmp_path):
    """A typewriter underscore hangs below the baseline of a line without descenders; the line
    must not break there ("let atom" / "_" / "A = 1" became three elements of the real corpus, whose
    boxes then overlapped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pypdfium2 as pdfium

    from components.data.text_layer import text_layer_lines

    figure = plt.figure(figsize=(6, 4))
    figure.text(0.1, 0.6, "let atom_A = mk_atom one", fontsize=10, family="DejaVu Sans Mono")
    figure.text(0.1, 0.4, "next line", fontsize=10, family="DejaVu Sans Mono")
    figure.savefig(tmp_path / "page.pdf")
    plt.close(figure)
    lines = text_layer_lines(pdfium.PdfDocument(str(tmp_path / "page.pdf"))[0], dpi=144)
    assert [line.text for line in lines] == ["let atom_A = mk_atom one", "next line"]
