"""No silent minutes: progress lines with ETA, and pre-annotation lines a person can place."""

from __future__ import annotations

from components.curation.preannotate import PreAnnotation
from components.data.pages import Page
from components.progress import Progress, duration, waiting_line
from lifecycle.curation import _preannotation_progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_reports_first_then_every_interval_and_last_with_an_eta():
    clock, lines = Clock(), []
    progress = Progress("mine C(x), T=4", 10, every_s=10.0, clock=clock, out=lines.append)
    clock.now = 6.0
    assert progress.update("p1") == "[mine C(x), T=4] 1/10 pages, 6s, ETA 54s: p1"
    clock.now = 12.0
    assert progress.update("p2") is None  # 6 s since the last line: not due
    clock.now = 17.0
    assert progress.update("p3").endswith("3/10 pages, 17s, ETA 40s: p3")
    clock.now = 60.0
    progress.update("p10", count=7)
    assert lines[-1] == "[mine C(x), T=4] 10/10 pages, 1m00s, done: p10" and len(lines) == 3
    quiet = Progress("evaluate ar", 2, quiet_s=10.0, clock=clock, out=lines.append)
    clock.now = 61.0
    assert quiet.update() is None and quiet.update() is None  # a step of a second says nothing
    assert duration(3725) == "1h02m" and waiting_line("labelstudio", 20, 120) == "[labelstudio] starting: 20s (gives up at 2m00s)"


def test_preannotation_lines_name_the_pdf_page_and_where_its_text_came_from(capsys):
    report = _preannotation_progress("shard-0", 2, "auto(pdf-text|rapidocr)")
    pdf_page = Page("pdf-abc-p0003", "images/x.png", 10, 10, [], source="pdf:manual.pdf#3",
                    meta={"pdf_path": "/data/in/manual.pdf", "page_number": 3})
    report(pdf_page, PreAnnotation("words", 1.0, "pdf-text", extra={"source": "text-layer"}))
    scan = Page("pdf-def-p0001", "images/y.png", 10, 10, [], source="pdf:scan.pdf#1",
                meta={"pdf_path": "/data/in/scan.pdf", "page_number": 1})
    report(scan, PreAnnotation("words", 0.91, "rapidocr-3.4", extra={
        "source": "ocr:rapidocr-3.4", "fallback_reason": "no text layer"}))
    first, second = capsys.readouterr().out.splitlines()
    assert first.endswith("1/2 pages, 0s, ETA 0s: manual.pdf p3: text layer, confidence 1.000")
    assert second.endswith(": scan.pdf p1: OCR (no text layer), confidence 0.910")
    assert "pdf-abc" not in first  # not the content hash
