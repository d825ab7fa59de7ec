"""Pre-annotation on real pages: documentation PDFs that Debian ships, every backend that runs here.

    python -m benchmarks.preannotation [--backends auto,pdf-text,auto_scan,rapidocr,reader,rapidocr_heuristic,...]
                                       [--pages NAME,...] [--repeats 1] [--model DIR] [--paddle-model DIR]
                                       [--reader-model DIR]
                                       [--out var/bench/preannotation]

The pages (``PAGES``) come from five Debian packages fetched with ``apt-get download`` and
unpacked with ``dpkg-deb -x`` (cached under ``var/bench/preannotation/debian``; nothing is
installed): the ACM ``sigconf`` sample (two columns, booktabs tables with their LaTeX source,
display math), the amsmath user guide (math, verbatim code), the ``listings`` manual (code
listings, line-numbered ones included), *An Introduction to R* (code, prose) and the gnuplot
manual. Pages are rendered at 150 dpi with pdfium.

Ground truth: the PDF text layer (character boxes in content order, which for these
LaTeX/Texinfo documents is reading order, column by column); its page furniture (running heads
and folios: a line in the top or bottom 15 % of the page that is a page number or recurs on a
neighbouring page, or the top or bottom line standing apart) is found from the text layer too, never from the annotators. Tables: the header row and body of each ruled table, copied from the
LaTeX source shipped in the same package. Code: one distinctive line of each listing.

``auto`` (the pre-annotation default) and ``pdf-text`` read a page's own text layer (the page
record names its PDF, as ``ingest.pdf_dir`` imports do); ``auto_scan`` is ``auto`` given the page
as a bare image (no PDF behind it, as a scan): it falls back to OCR and should score as ``rapidocr``.

Per page and as means it prints: body text edit (OmniDocBench's text normalisation: NFKC,
only word characters kept, Levenshtein / longer length), furniture removed (furniture lines
whose box no markup element overlaps), tables found (a predicted ``<table>`` whose first row
is the source's header row) and their TEDS, code listings emitted as tables, and seconds per
page (backends interleaved page by page; ``--repeats`` times each, median) and each backend's
time per page relative to the first one. It is a benchmark, not a test: ``tests/test_preannotation_real_pages.py`` keeps a few of
its pages (committed as images with their ground truth) as regression tests.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import statistics
import subprocess
import sys
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pypdfium2 as pdfium
from lxml import html as lxml_html
from PIL import Image

from components.curation.preannotate import PageAnnotationError, PreAnnotation, make_preannotator
from components.data.debian_docs import PackageFetchError, package_file
from components.data.markup import parse_markup
from components.data.pages import Page
from components.data.scans import PROFILES, device_for, scan_page
from components.data.text_layer import PageTruth, TextLine
from components.data.text_layer import page_truth as layer_truth
from components.evaluation.confidence import least_confident_share, rank_correlation
from components.metrics.table import teds
from components.metrics.text import clean_text, latex_to_unicode, normalized_edit_distance
from components.services.process import VAR_DIR

DPI = 150
TEXLIVE = "usr/share/doc/texlive-doc/latex"


@dataclass(frozen=True)
class Document:
    package: str
    path: str  # inside the unpacked package


DOCUMENTS = {
    "sigconf": Document("texlive-publishers-doc", f"{TEXLIVE}/acmart/samples/sample-sigconf.pdf"),
    "amsldoc": Document("texlive-latex-base-doc", f"{TEXLIVE}/amsmath/amsldoc.pdf"),
    "listings": Document("texlive-latex-recommended-doc", f"{TEXLIVE}/listings/listings.pdf"),
    "rintro": Document("r-doc-pdf", "usr/share/R/doc/manual/R-intro.pdf"),
    "gnuplot": Document("gnuplot-doc", "usr/share/doc/gnuplot/gnuplot.pdf"),
}

# Tables of sample-sigconf.tex (lines 513-522 and 537-545), cells as typeset.
_SIGCONF_TABLE_1 = [["Non-English or Math", "Frequency", "Comments"], ["Ø", "1 in 1,000", "For Swedish names"],
                    ["π", "1 in 5", "Common in math"], ["$", "4 in 5", "Used in business"],
                    ["Ψ21", "1 in 40,000", "Unexplained usage"]]
_SIGCONF_TABLE_2 = [["Command", "A Number", "Comments"], ["\\author", "100", "Author"],
                    ["\\table", "300", "For tables"], ["\\table*", "400", "For wider tables"]]


@dataclass(frozen=True)
class BenchPage:
    name: str
    document: str
    index: int  # 0-based page index in the PDF
    tables: tuple = ()  # each a list of rows of cell texts, header row first
    code: tuple[str, ...] = ()  # one distinctive line of each code listing on the page
    two_column: bool = False


PAGES = (
    BenchPage("sigconf-1", "sigconf", 1, two_column=True),
    BenchPage("sigconf-2", "sigconf", 2, tables=(_SIGCONF_TABLE_1,), two_column=True),
    BenchPage("sigconf-3", "sigconf", 3, tables=(_SIGCONF_TABLE_2,), two_column=True),
    BenchPage("amsldoc-4", "amsldoc", 4),
    BenchPage("amsldoc-10", "amsldoc", 10),
    BenchPage("amsldoc-20", "amsldoc", 20),
    BenchPage("listings-5", "listings", 5, code=("end;",)),
    BenchPage("listings-20", "listings", 20, code=("j:=square(root(i));",)),
    BenchPage("rintro-10", "rintro", 10),
    BenchPage("rintro-30", "rintro", 30),
    BenchPage("gnuplot-30", "gnuplot", 30),
    BenchPage("gnuplot-60", "gnuplot", 60),
)


# ---------------------------------------------------------------------------------------------
# documents and ground truth


def fetch_documents(cache: Path, names: set[str]) -> dict[str, Path]:
    """The PDFs of ``names``, downloading and unpacking their Debian packages once."""
    try:
        return {name: package_file(cache, DOCUMENTS[name].package, DOCUMENTS[name].path) for name in sorted(names)}
    except PackageFetchError as exc:
        raise SystemExit(str(exc)) from exc


def page_truth(pdf, index: int) -> PageTruth:
    return layer_truth(pdf, index, DPI)


# ---------------------------------------------------------------------------------------------
# scoring


def normalized(text: str) -> str:
    return clean_text(unicodedata.normalize("NFKC", text))


def markup_body_text(markup: str) -> str:
    """Reading text of a markup: titles, paragraphs, code, table cells, formulas as Unicode."""

    parts = []
    for block in parse_markup(markup):
        if block.category == "table":
            parts.append(" ".join(lxml_html.fromstring(block.content).itertext()))
        elif block.category == "formula":
            try:
                parts.append(latex_to_unicode(block.content))
            except Exception:  # pylatexenc raises many types on malformed LaTeX; keep it raw
                parts.append(block.content)
        else:
            parts.append(block.content)
    return " ".join(parts)


def _covered(line: tuple, boxes: list[tuple]) -> bool:
    """Whether the ``boxes`` together cover at least half of ``line`` (a furniture line may be
    read as several boxes: a running head's left and right halves)."""
    area = (line[2] - line[0]) * (line[3] - line[1])
    inside = 0.0
    for box in boxes:
        width = min(box[2], line[2]) - max(box[0], line[0])
        height = min(box[3], line[3]) - max(box[1], line[1])
        inside += max(0.0, width) * max(0.0, height)
    return inside >= 0.5 * area


def table_rows(table_html: str) -> list[list[str]]:
    root = lxml_html.fromstring(table_html)
    return [[" ".join("".join(cell.itertext()).split()) for cell in row.xpath("./td|./th")] for row in root.iter("tr")]


def rows_to_html(rows: list[list[str]]) -> str:
    return "<table>" + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                               for row in rows) + "</table>"


def score_page(bench: BenchPage, truth: PageTruth, annotation, seconds: float) -> dict:
    """One page's numbers for one backend (``annotation``: a :class:`PreAnnotation`)."""
    markup = annotation.markup
    body_edit = normalized_edit_distance(normalized(markup_body_text(markup)), normalized(truth.body_text()))
    kept = [e for e in annotation.elements if e.category not in ("header", "footer", "figure")]
    has_boxes = bool(annotation.elements)
    removed = 0
    for line in truth.furniture:
        if has_boxes:
            removed += not _covered(line.box, [e.bbox for e in kept])
        else:  # a markup-only backend: the furniture's text must not be in the markup
            removed += normalized(line.text) not in normalized(markup_body_text(markup))
    predicted_tables = [b.content for b in parse_markup(markup) if b.category == "table"]
    found, table_teds = 0, []
    for rows in bench.tables:
        header = normalized(" ".join(rows[0]))
        scores = [teds(html, rows_to_html(rows)) for html in predicted_tables]
        heads = [normalized(" ".join(table_rows(html)[0])) if table_rows(html) else "" for html in predicted_tables]
        matched = [s for s, head in zip(scores, heads, strict=True) if normalized_edit_distance(head, header) <= 0.2]
        found += bool(matched)
        table_teds.append(max(matched, default=0.0))
    code_as_table = sum(any(normalized(line) in normalized(html) for html in predicted_tables) for line in bench.code)
    return {
        "page": bench.name, "body_text_edit": round(body_edit, 4),
        "source": annotation.extra.get("source"), "refused": annotation.extra.get("refused"),
        "table_makers": annotation.extra.get("tables"),
        "furniture": len(truth.furniture), "furniture_removed": removed,
        "tables": len(bench.tables), "tables_found": found,
        "table_teds": round(statistics.mean(table_teds), 4) if table_teds else None,
        "code_listings": len(bench.code), "code_as_table": code_as_table, "seconds": round(seconds, 3),
        "confidence": round(float(annotation.confidence), 6),
        # a page with text read as (nearly) nothing: the front end missed what a person reads
        "empty_with_ink": bool(truth.body_text().strip()) and len(normalized(markup_body_text(markup))) < 0.1 * max(
            1, len(normalized(truth.body_text()))),
        "flag": annotation.extra.get("empty_page_reason"),
    }


def summarize(rows: list[dict]) -> dict:
    furniture = sum(r["furniture"] for r in rows)
    tables = sum(r["tables"] for r in rows)
    teds_values = [r["table_teds"] for r in rows if r["table_teds"] is not None]
    seconds = [r["seconds"] for r in rows]
    return {
        "pages": len(rows),
        "body_text_edit": round(statistics.mean(r["body_text_edit"] for r in rows), 4),
        "empty_with_ink": sum(r["empty_with_ink"] for r in rows),
        "empty_flagged": sum(bool(r["empty_with_ink"] and r["flag"]) for r in rows),
        "furniture_removed": round(sum(r["furniture_removed"] for r in rows) / furniture, 4) if furniture else None,
        "tables_found": f"{sum(r['tables_found'] for r in rows)}/{tables}",
        "table_teds": round(statistics.mean(teds_values), 4) if teds_values else None,
        "code_as_table": sum(r["code_as_table"] for r in rows),
        "seconds_per_page": round(statistics.median(seconds), 3),
        "seconds_spread": [round(min(seconds), 3), round(max(seconds), 3)],
        # How well the page confidence ranks pages for the annotator queue (lowest first): the
        # rank correlation with the body text edit distance (-1 = perfect ranking, 0 = none).
        "spearman_confidence_vs_edit": confidence_ranking(rows),
        # Of the pages read badly (body text edit > 0.05), how many are among that many least
        # confident pages: what a budget queue of that size would catch.
        "bad_pages_in_least_confident": bad_pages_caught(rows),
        # The share of all errors (body text edit summed over pages) on the 10 % least confident pages.
        "errors_in_least_confident_tenth": least_confident_errors(rows),
    }


def bad_pages_caught(rows: list[dict], bad_edit: float = 0.05) -> str | None:
    bad = {r["page"] for r in rows if r["body_text_edit"] > bad_edit}
    if not bad or any(r.get("confidence") is None for r in rows):
        return None
    least = sorted(rows, key=lambda r: r["confidence"])[: len(bad)]
    return f"{sum(r['page'] in bad for r in least)}/{len(bad)}"


def confidence_ranking(rows: list[dict]) -> float | None:
    """Spearman's rho between page confidence and body text edit distance (None when undefined)."""
    rated = [r for r in rows if r.get("confidence") is not None]
    return rank_correlation([r["confidence"] for r in rated], [r["body_text_edit"] for r in rated])


def least_confident_errors(rows: list[dict]) -> float | None:
    """The share of all body text edit held by the 10 % least confident pages (at least one)."""
    if any(r.get("confidence") is None for r in rows):
        return None
    return least_confident_share([r["confidence"] for r in rows], [r["body_text_edit"] for r in rows])


# ---------------------------------------------------------------------------------------------
# backends and the run


READER_DIR = "models/pretrained/docmarkup-reader"


def make_backends(names: list[str], model_dir: str | None, paddle_dir: str | None,
                  reader_dir: str | None = None) -> dict:
    """The named backends that can run here (a backend whose weights are absent is skipped, said why)."""

    configs = {
        "auto": {"backend": "auto"},
        "auto_scan": {"backend": "auto"},  # given no page record: OCR, as for a scanned PDF
        "pdf-text": {"backend": "pdf-text"},
        "rapidocr": {"backend": "rapidocr"},
        "rapidocr_lines_tables": {"backend": "rapidocr", "table_structure": "lines"},  # tables by line positions
        "rapidocr_heuristic": {"backend": "rapidocr", "layout_model": None},
        # the settings before the layout model: full-resolution detection, heuristics only
        "rapidocr_fullres_heuristic": {"backend": "rapidocr", "layout_model": None, "det_max_side": None},
        "model": {"backend": "model", "model_dir": model_dir or "models/pretrained/docmarkup-base"},
        "paddleocr_vl": {"backend": "paddleocr_vl_transformers", "model_dir": paddle_dir},
        # the real-document reader: rapid-layout, then every element crop read by the reader
        "reader": {"backend": "model", "model_dir": reader_dir or READER_DIR, "parse": "elements"},
    }
    backends = {}
    for name in names:
        if name.startswith("reader:"):  # another reader folder beside the shipped one: reader:DIR
            configs[name] = {**configs["reader"], "model_dir": name.split(":", 1)[1]}
        if name not in configs:
            raise SystemExit(f"unknown backend {name!r}; choose from {sorted(configs)}")
        if name == "paddleocr_vl" and not paddle_dir:
            print("[bench] paddleocr_vl skipped: pass --paddle-model DIR (a PaddleOCR-VL checkpoint folder)",
                  file=sys.stderr)
            continue
        if name == "reader" and not (Path(configs[name]["model_dir"]) / "config.json").is_file():
            print(f"[bench] reader skipped: no model at {configs[name]['model_dir']} (./run pretrain --reader makes it)",
                  file=sys.stderr)
            continue
        backends[name] = make_preannotator(configs[name])
    return backends


def page_record(bench: BenchPage, pdf_path: Path, image: Image.Image):
    """The page as ``ingest.pdf_dir`` stores it: its PDF, page number and rendering dpi."""

    return Page(bench.name, "", image.width, image.height, source=f"pdf:{pdf_path.name}#{bench.index + 1}",
                meta={"pdf_path": str(pdf_path), "page_number": bench.index + 1, "render_dpi": DPI})


def annotate(name: str, annotator, bench: BenchPage, image: Image.Image, record):
    """One backend on one page: backends that read a PDF's text layer get the page record. A page
    the backend refuses (``pdf-text`` without a usable layer) scores as an empty page, reason kept."""

    try:
        if name != "auto_scan" and record is not None and hasattr(annotator, "annotate_page"):
            return annotator.annotate_page(record, image)
        return annotator.annotate(image, bench.name)
    except PageAnnotationError as exc:
        return PreAnnotation("", 0.0, annotator.model_version, [], {"refused": str(exc)})


def render_page(pdf, index: int) -> Image.Image:
    return pdf[index].render(scale=DPI / 72, grayscale=False).to_pil().convert("RGB")


def folder_pages(folder: Path) -> list[BenchPage]:
    """Every page of every PDF in ``folder`` (named ``<file stem>-<page>``; no table or code truth)."""

    pages = []
    for path in sorted(folder.glob("*.pdf")):
        count = len(pdfium.PdfDocument(str(path)))
        pages += [BenchPage(f"{path.stem}-{index + 1}", str(path.resolve()), index) for index in range(count)]
    if not pages:
        raise SystemExit(f"no PDF pages in {folder}")
    return pages


def pdftotext_truth(pdf_path: Path, index: int, layer: PageTruth) -> PageTruth:
    """Poppler's reading of the page (``pdftotext``, reading order) as the body, an extractor
    independent of pdfium's; lines that are the text layer's furniture are taken out, so that the
    body compares with the body. Furniture stays pdfium's."""

    text = subprocess.run(["pdftotext", "-f", str(index + 1), "-l", str(index + 1), str(pdf_path), "-"],
                          capture_output=True, text=True, check=True).stdout
    furniture = {normalized(line.text) for line in layer.furniture}
    body = [line for line in text.splitlines() if line.strip() and normalized(line) not in furniture]
    return PageTruth([TextLine(" ".join(body), (0.0, 0.0, 0.0, 0.0))], layer.furniture)


def load_bench_pages(cache: Path, selected: list[BenchPage],
                     truth: str = "pdfium") -> list[tuple[BenchPage, Image.Image, PageTruth, Path]]:
    """Rendered images, ground truth and PDF of ``selected`` (images cached as PNG). ``truth``:
    ``pdfium`` (the text layer as our code reads it) or ``pdftotext`` (poppler's, independent)."""

    pdfs = fetch_documents(cache, {p.document for p in selected} & DOCUMENTS.keys())
    pdfs |= {p.document: Path(p.document) for p in selected if p.document not in DOCUMENTS}  # --pdf-dir files
    out = []
    for bench in selected:
        pdf = pdfium.PdfDocument(str(pdfs[bench.document]))
        image_path = cache / "pages" / f"{bench.name}.png"
        if image_path.exists():
            image = Image.open(image_path).convert("RGB")
        else:
            image_path.parent.mkdir(parents=True, exist_ok=True)
            image = render_page(pdf, bench.index)
            image.save(image_path)
        page = page_truth(pdf, bench.index)
        if truth == "pdftotext":
            page = pdftotext_truth(pdfs[bench.document], bench.index, page)
        out.append((bench, image, page, pdfs[bench.document].resolve()))
    return out


def write_fixture(bench: BenchPage, image: Image.Image, truth: PageTruth, folder: Path) -> None:
    """A page as a regression-test fixture: a 16-grey PNG plus its ground truth as JSON."""
    folder.mkdir(parents=True, exist_ok=True)
    # 16 grey levels keep the anti-aliased glyph edges OCR reads and make the PNG about half the size
    image.convert("L").quantize(16, dither=Image.Dither.NONE).save(folder / f"{bench.name}.png", optimize=True, bits=4)
    record = {"page": {"name": bench.name, "document": bench.document, "index": bench.index,
                       "tables": [list(map(list, t)) for t in bench.tables], "code": list(bench.code),
                       "two_column": bench.two_column, "package": DOCUMENTS[bench.document].package},
              "body": [{"text": line.text, "box": line.box} for line in truth.body],
              "furniture": [{"text": line.text, "box": line.box} for line in truth.furniture]}
    (folder / f"{bench.name}.json").write_text(json.dumps(record, ensure_ascii=False, indent=1))


def read_fixture(path: Path) -> tuple[BenchPage, Image.Image, PageTruth]:
    """A fixture written by :func:`write_fixture`."""
    record = json.loads(path.read_text())
    page = record["page"]
    bench = BenchPage(page["name"], page["document"], page["index"], tuple(page["tables"]), tuple(page["code"]),
                      page["two_column"])
    truth = PageTruth([TextLine(x["text"], tuple(x["box"])) for x in record["body"]],
                      [TextLine(x["text"], tuple(x["box"])) for x in record["furniture"]])
    return bench, Image.open(path.with_suffix(".png")).convert("RGB"), truth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="rapidocr,reader,rapidocr_heuristic,rapidocr_fullres_heuristic,model")
    parser.add_argument("--pages", default=None, help="comma-separated page names (default: all)")
    parser.add_argument("--model", default=None, help="model folder for the `model` backend (default: shipped base)")
    parser.add_argument("--paddle-model", default=None, help="PaddleOCR-VL folder for the paddleocr_vl backend")
    parser.add_argument("--reader-model", default=None, help=f"model folder for the `reader` backend (default {READER_DIR})")
    parser.add_argument("--write-fixtures", default=None, metavar="DIR",
                        help="write the selected pages as regression-test fixtures into DIR and stop")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per page and backend (median kept)")
    parser.add_argument("--pdf-dir", default=None, metavar="DIR",
                        help="every page of the PDFs in DIR instead of the fixed pages (truth: their text layer)")
    parser.add_argument("--truth", choices=["pdfium", "pdftotext"], default="pdfium",
                        help="body truth: the text layer read by pdfium (default) or by poppler's pdftotext "
                             "(an independent extractor: Debian's poppler-utils)")
    parser.add_argument("--scan", default=None, metavar="PROFILE[,PROFILE...]",
                        help=f"read the pages as scans: each document through its own device of the profile "
                             f"({', '.join(PROFILES)}; components/data/scans.py), as bare images (no text layer)")
    parser.add_argument("--out", default=str(VAR_DIR / "bench" / "preannotation"))
    args = parser.parse_args(argv)

    out = Path(args.out)
    wanted = set(args.pages.split(",")) if args.pages else None
    candidates = folder_pages(Path(args.pdf_dir)) if args.pdf_dir else PAGES
    selected = [p for p in candidates if wanted is None or p.name in wanted]
    if wanted and len(selected) != len(wanted):
        raise SystemExit(f"unknown page(s) {sorted(wanted - {p.name for p in candidates})}")
    pages = load_bench_pages(out / "debian", selected, args.truth)
    if args.write_fixtures:
        for bench, image, truth, _ in pages:
            write_fixture(bench, image, truth, Path(args.write_fixtures))
        print(f"wrote {len(pages)} fixture(s) to {args.write_fixtures}")
        return 0
    backends = make_backends(args.backends.split(","), args.model, args.paddle_model, args.reader_model)

    for annotator in backends.values():  # load weights outside the timed pages
        with contextlib.suppress(PageAnnotationError):  # pdf-text refuses a bare image
            annotator.annotate(pages[0][1], "warmup")
    if args.scan:
        results = {}
        for profile in args.scan.split(","):
            scanned = [(bench, scan_page(image, DPI, device_for(profile, bench.document), seed=bench.index), truth, None)
                       for bench, image, truth, _ in pages]
            print(f"\n######## scans: profile {profile} "
                  f"({', '.join(sorted({device_for(profile, b.document).name for b, *_ in scanned}))})")
            results[profile] = read_and_report(backends, scanned, args.repeats, out / f"scan-{profile}")
        print("\nbody text edit per profile (mean over pages; worst page ratio to the first backend):")
        first = next(iter(backends))
        for profile, by_backend in results.items():
            line = [f"{profile:<8}"]
            for name, result in by_backend.items():
                line.append(f"{name} {result['summary']['body_text_edit']:.4f}")
                if name != first:
                    ratios = [r["body_text_edit"] / max(f["body_text_edit"], 0.005) for r, f in
                              zip(result["pages"], by_backend[first]["pages"], strict=True)]
                    mean_ratio = result["summary"]["body_text_edit"] / max(by_backend[first]["summary"]["body_text_edit"], 1e-4)
                    line.append(f"({mean_ratio:.2f}x {first}, worst page {max(ratios):.2f}x)")
                line.append(f"empty-with-ink {result['summary']['empty_with_ink']}")
            print("  ".join(line))
        out.mkdir(parents=True, exist_ok=True)
        (out / "scans.json").write_text(json.dumps(results, indent=1))
        print(f"\nwrote {out / 'scans.json'}")
        return 0
    results = read_and_report(backends, pages, args.repeats, out)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out / 'results.json'}")
    return 0


def read_and_report(backends: dict, pages: list, repeats: int, out: Path) -> dict:
    """Every backend on every page, interleaved page by page (so load drifts hit all alike); per-page
    rows and a summary per backend, printed. A page without its PDF (``pdf_path`` None: a scan) is
    given to every backend as a bare image."""
    rows: dict[str, list[dict]] = {name: [] for name in backends}
    for bench, image, truth, pdf_path in pages:
        record = page_record(bench, pdf_path, image) if pdf_path is not None else None
        for name, annotator in backends.items():
            seconds = []
            for _ in range(repeats):
                started = time.perf_counter()
                annotation = annotate(name, annotator, bench, image, record)
                seconds.append(time.perf_counter() - started)
            rows[name].append(score_page(bench, truth, annotation, statistics.median(seconds)))
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / f"{bench.name}.md").write_text(annotation.markup)
    results = {name: {"pages": page_rows, "summary": summarize(page_rows)} for name, page_rows in rows.items()}
    for name, result in results.items():
        print(f"\n== {name}")
        print(f"{'page':<14}{'text edit':>10}{'furniture':>11}{'tables':>8}{'TEDS':>7}{'code→table':>11}{'s/page':>8}")
        for r in result["pages"]:
            teds_text = f"{r['table_teds']:.3f}" if r["table_teds"] is not None else "-"
            print(f"{r['page']:<14}{r['body_text_edit']:>10.4f}{r['furniture_removed']:>6}/{r['furniture']:<4}"
                  f"{r['tables_found']:>5}/{r['tables']:<2}{teds_text:>7}{r['code_as_table']:>11}{r['seconds']:>8.2f}")
        print(json.dumps(result["summary"]))
    if len(results) > 1:
        first = next(iter(results))
        for name in list(results)[1:]:
            ratios = [a["seconds"] / b["seconds"] for a, b in zip(results[name]["pages"], results[first]["pages"], strict=True)]
            print(f"time {name} / {first}: median {statistics.median(ratios):.2f}x "
                  f"(pages {min(ratios):.2f}x..{max(ratios):.2f}x)")
    return results


if __name__ == "__main__":
    sys.exit(main())

