"""A real-document corpus: pages of Debian's PDF manuals with exact text, as page stores per split.

    python -m recipes.build_corpus build --packages P1,P2,... --out DIR [--max-pages N]
        [--pages-per-document 24] [--dpi 144] [--layout rapid-layout|none] [--cache var/debian]
        [--synthetic-pages N] [--dvc]
    python -m recipes.build_corpus sample --from DIR/test --out DIR [--pages 12] [--per-document 2]

Each package is fetched with ``apt-get download`` and unpacked (:mod:`components.data.debian_docs`);
every PDF it ships is a document. Pages are rendered at ``--dpi`` and read from their text layer
(:mod:`components.data.text_layer`): lines with boxes, font size and monospace flag, and the
running heads and folios (furniture). Lines become elements:

- ``header`` / ``footer``: each furniture line (top / bottom half of the page), layout-only;
- ``code``: consecutive monospace lines, indentation rebuilt from their x offsets;
- ``title``: a short block (≤ 3 lines) set at least 1.2× the page's body size;
- ``text``: the rest, lines joined by spaces, split into blocks at vertical gaps, column changes
  and changes of size or font;
- ``figure`` (layout-only): a table, figure or formula region found by rapid-layout (the text
  layer cannot give their markup); its lines are not used as text.

Tables and formulas with exact markup come from the synthetic generator instead
(``--synthetic-pages N``: its ``standard`` preset, 768x1024 with real fonts) into train and val.

With ``--layout rapid-layout`` a block is also split where its lines fall in different detected
regions, so blocks follow the detector where the two agree. Pages whose text layer is unusable
(no body lines, unmapped glyphs) are skipped and counted.

Splits are by document, never by page: every page of the held-out packages and benchmark
documents (:data:`HELD_OUT_PACKAGES`, :data:`HELD_OUT_DOCUMENTS`) is ``test``; of the other
documents a hash of the document picks ``val`` (5 %) or ``train``. The stores are
``DIR/train``, ``DIR/val``, ``DIR/test``; ``DIR/corpus.json`` reports documents, pages, elements
and characters per split, what was skipped and why, and the build time. Each page's
``meta.element_lines`` holds every element's line boxes, for readers that encode lines. ``--dvc`` versions
``DIR`` with DVC (it must be inside the repository). Pages are written a document at a time, and a
build run again skips the pages already stored, so an interrupted build resumes.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pypdfium2 as pdfium
from PIL import Image

from components.data.debian_docs import PackageFetchError, package_pdfs
from components.data.page_store import PageDataset
from components.data.pages import LayoutElement, Page
from components.data.pdf import file_sha256, pdf_document_id, pdf_page_id
from components.data.synthetic import SyntheticConfig, generate_page
from components.data.text_layer import TextLine, page_truth, text_layer_lines

DEFAULT_DPI = 144
HELD_OUT_PACKAGES = ("freefem-doc", "why3-doc-pdf", "python-reportlab-doc", "shared-mime-info")
# The real-page pre-annotation benchmark's documents (package, file name): held out too.
HELD_OUT_DOCUMENTS = (("texlive-publishers-doc", "sample-sigconf.pdf"), ("texlive-latex-base-doc", "amsldoc.pdf"),
                      ("texlive-latex-recommended-doc", "listings.pdf"), ("r-doc-pdf", "R-intro.pdf"),
                      ("gnuplot-doc", "gnuplot.pdf"))
VAL_FRACTION = 0.05
SYNTHETIC_SEED = 60_000_000  # synthetic table and formula pages: seeds outside every other use
TITLE_SIZE_RATIO = 1.2
MAX_TITLE_LINES = 3
MIN_BODY_LINES = 3
MAX_UNMAPPED_FRACTION = 0.02  # replacement or private-use characters: glyphs without Unicode
# A detector's regions whose text the text layer cannot turn into markup.
NON_TEXT_REGIONS = ("table", "figure", "formula")

# (image) -> detected regions, each with .category and .box (x0, y0, x1, y1) in image pixels
RegionFinder = Callable[[Image.Image], list]


@dataclass
class CorpusReport:
    documents: Counter = field(default_factory=Counter)  # per split
    pages: Counter = field(default_factory=Counter)
    elements: Counter = field(default_factory=Counter)  # per category
    characters: Counter = field(default_factory=Counter)  # per split, of element content
    skipped: Counter = field(default_factory=Counter)  # reason -> pages (or documents)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"documents": dict(self.documents), "pages": dict(self.pages), "elements": dict(self.elements),
                "characters": dict(self.characters), "skipped": dict(self.skipped), "build_seconds": round(self.seconds, 1)}


def document_split(package: str, pdf: Path, document_id: str) -> str:
    """``test`` for held-out documents, else ``val`` or ``train`` by a hash of the document."""
    if package in HELD_OUT_PACKAGES or (package, pdf.name) in HELD_OUT_DOCUMENTS:
        return "test"
    fraction = int(hashlib.sha256(document_id.encode()).hexdigest()[:8], 16) / 16**8
    return "val" if fraction < VAL_FRACTION else "train"


def text_layer_problem(lines: list[TextLine]) -> str | None:
    """Why a page's text layer cannot be its truth (no text, unmapped glyphs), or None."""
    text = "".join(line.text for line in lines)
    if not text:
        return "no text layer"
    unmapped = sum(1 for c in text if c == "\ufffd" or 0xE000 <= ord(c) <= 0xF8FF)
    return "unmapped glyphs" if unmapped > MAX_UNMAPPED_FRACTION * len(text) else None


def _centre(box) -> tuple[float, float]:
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def _region_of(line: TextLine, regions: list) -> int | None:
    x, y = _centre(line.box)
    for index, region in enumerate(regions):
        x0, y0, x1, y1 = region.box
        if x0 <= x <= x1 and y0 <= y <= y1:
            return index
    return None


def _starts_new_block(previous: TextLine, line: TextLine, block_x: tuple[float, float], same_region: bool) -> bool:
    height = max(1.0, previous.box[3] - previous.box[1])
    gap = line.box[1] - previous.box[3]
    overlaps = line.box[0] < block_x[1] and line.box[2] > block_x[0]
    size_change = abs(line.size - previous.size) > 0.15 * max(previous.size, 1e-6)
    return (not same_region or line.mono != previous.mono or size_change or gap > 0.9 * height or gap < -0.5 * height
            or not overlaps)


def _code_content(lines: list[TextLine]) -> str:
    left = min(line.box[0] for line in lines)
    widths = [(line.box[2] - line.box[0]) / max(1, len(line.text)) for line in lines if line.text.strip()]
    char_width = statistics.median(widths) if widths else 1.0
    return "\n".join(" " * max(0, round((line.box[0] - left) / max(char_width, 1e-6))) + line.text for line in lines)


def _block_element(lines: list[TextLine], body_size: float) -> LayoutElement:
    box = (min(b.box[0] for b in lines), min(b.box[1] for b in lines), max(b.box[2] for b in lines),
           max(b.box[3] for b in lines))
    if all(line.mono for line in lines):
        return LayoutElement("code", box, _code_content(lines))
    text = re.sub(r"\s+", " ", " ".join(line.text for line in lines)).strip()
    size = statistics.median(line.size for line in lines)
    if len(lines) <= MAX_TITLE_LINES and body_size > 0 and size >= TITLE_SIZE_RATIO * body_size:
        return LayoutElement("title", box, text)
    return LayoutElement("text", box, text)


Box = tuple[float, float, float, float]


def page_elements(body: list[TextLine], furniture: list[TextLine], height: float,
                  regions: list | None = None) -> tuple[list[LayoutElement], list[list[Box]]]:
    """The page's elements in reading order (headers, body blocks in text-layer order, figures,
    footers) and each element's line boxes (a line-level reader encodes them one by one)."""
    regions = regions or []
    blocked = [r for r in regions if r.category in NON_TEXT_REGIONS]
    textual = [r for r in regions if r.category not in NON_TEXT_REGIONS]
    kept = [line for line in body if _region_of(line, blocked) is None]
    body_size = statistics.median(line.size for line in kept) if kept else 0.0
    blocks: list[list[TextLine]] = []
    region_of: list[int | None] = []
    for line in kept:
        region = _region_of(line, textual) if textual else None
        if blocks:
            block = blocks[-1]
            extent = (min(b.box[0] for b in block), max(b.box[2] for b in block))
            if not _starts_new_block(block[-1], line, extent, region == region_of[-1]):
                block.append(line)
                continue
        blocks.append([line])
        region_of.append(region)
    head = [[line] for line in furniture if _centre(line.box)[1] < height / 2]
    foot = [[line] for line in furniture if _centre(line.box)[1] >= height / 2]
    elements = ([LayoutElement("header", line.box, line.text) for [line] in head]
                + [_block_element(block, body_size) for block in blocks]
                + [LayoutElement("figure", tuple(float(v) for v in r.box)) for r in blocked]
                + [LayoutElement("footer", line.box, line.text) for [line] in foot])
    lines = [[tuple(round(v, 1) for v in line.box) for line in group] for group in head + blocks] + [[] for _ in blocked] \
        + [[tuple(round(v, 1) for v in line.box) for line in group] for group in foot]
    return elements, lines


def _sample_indices(count: int, limit: int) -> list[int]:
    """Up to ``limit`` page indices spread evenly over a document (its first pages included)."""
    if count <= limit:
        return list(range(count))
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)}) if limit > 1 else [0]


def build_corpus(packages: list[str], out: Path, *, cache: Path, dpi: float = DEFAULT_DPI, max_pages: int | None = None,
                 pages_per_document: int = 24, regions: RegionFinder | None = None, synthetic_pages: int = 0,
                 progress: Callable[[str], None] = lambda line: print(line, flush=True)) -> CorpusReport:
    """Write the corpus of ``packages`` into ``out/<split>`` page stores; see the module docstring."""

    started = time.perf_counter()
    report = CorpusReport()
    stores = {split: PageDataset(out / split) for split in ("train", "val", "test")}
    stored = {page_id for store in stores.values() if store.exists() for page_id in store.ids()}  # a resumed build
    pending: dict[str, list[Page]] = {split: [] for split in stores}
    total = len(stored)

    def flush(split: str) -> None:
        if pending[split]:
            stores[split].upsert(pending[split])
            pending[split] = []

    for package in packages:
        try:
            pdfs = package_pdfs(cache, package)
        except PackageFetchError as exc:
            report.skipped[f"package not fetched: {package}"] += 1
            progress(f"[corpus] {exc}")
            continue
        for path in pdfs:
            if max_pages is not None and total >= max_pages:
                break
            digest = file_sha256(path)
            document_id = pdf_document_id(digest)
            split = document_split(package, path, document_id)
            try:
                pdf = pdfium.PdfDocument(str(path))
            except pdfium.PdfiumError:
                report.skipped["document does not open"] += 1
                continue
            kept_pages = 0
            extracted: dict[int, list[TextLine]] = {}

            def lines_of(number: int, pdf=pdf, extracted=extracted) -> list[TextLine]:
                if number not in extracted:
                    extracted[number] = text_layer_lines(pdf[number], dpi)
                return extracted[number]

            for index in _sample_indices(len(pdf), pages_per_document):
                if max_pages is not None and total >= max_pages:
                    break
                if pdf_page_id(digest, index + 1) in stored:
                    kept_pages += 1
                    continue
                try:
                    lines = lines_of(index)
                    problem = text_layer_problem(lines)
                    if problem:
                        report.skipped[problem] += 1
                        continue
                    truth = page_truth(pdf, index, dpi, lines, lines_of)
                    if len(truth.body) < MIN_BODY_LINES:
                        report.skipped["fewer than 3 body lines"] += 1
                        continue
                    image = pdf[index].render(scale=dpi / 72).to_pil().convert("RGB")
                except (pdfium.PdfiumError, ValueError, OSError) as exc:
                    report.skipped[f"page does not render: {type(exc).__name__}"] += 1
                    continue
                elements, line_boxes = page_elements(truth.body, truth.furniture, image.height,
                                                     regions(image) if regions else None)
                page_id = pdf_page_id(digest, index + 1)
                store = stores[split]
                page = Page(page_id=page_id, image=store.save_image(page_id, image), width=image.width,
                            height=image.height, elements=elements, source=f"debian:{package}",
                            meta={"document_id": document_id, "package": package, "pdf": path.name,
                                  "page_number": index + 1, "render_dpi": dpi, "split": split,
                                  "element_lines": line_boxes})
                pending[split].append(page)
                kept_pages += 1
                total += 1
            pdf.close()
            flush(split)  # a document at a time: an interrupted build resumes after the last one
            progress(f"[corpus] {package}/{path.name}: {kept_pages} pages ({split}); {total} in all, "
                     f"{time.perf_counter() - started:.0f} s")
    for split in stores:
        flush(split)
    if synthetic_pages:
        add_synthetic_pages(out, synthetic_pages)
    report = count_corpus(out, report.skipped)
    report.seconds = time.perf_counter() - started
    (out / "corpus.json").write_text(json.dumps({"packages": packages, "dpi": dpi, "synthetic_pages": synthetic_pages,
                                                 **report.as_dict()}, indent=2))
    return report


def count_corpus(out: Path, skipped: Counter | None = None) -> CorpusReport:
    """Documents, pages, elements and characters of the corpus as stored (a resumed build included)."""
    report = CorpusReport(skipped=skipped or Counter())
    for split in ("train", "val", "test"):
        store = PageDataset(out / split)
        if not store.exists():
            continue
        documents = set()
        for page in store.iter_pages():
            documents.add(page.meta.get("document_id"))
            report.pages[split] += 1
            report.elements.update(e.category for e in page.elements)
            report.characters[split] += sum(len(e.content) for e in page.elements)
        report.documents[split] = len(documents)
    return report


def add_synthetic_pages(out: Path, count: int, seed: int = SYNTHETIC_SEED) -> None:
    """``count`` synthetic pages of the ``standard`` preset (768x1024, tables and formulas with
    exact markup, drawn with real fonts) into the train split, and every twentieth into val."""

    config = SyntheticConfig.preset("standard")
    pending: dict[str, list[Page]] = {"train": [], "val": []}
    for offset in range(count):
        page, image = generate_page(seed + offset, config)
        split = "val" if offset % 20 == 19 else "train"
        store = PageDataset(out / split)
        page.image = store.save_image(page.page_id, image)
        page.meta |= {"split": split, "document_id": f"synthetic:{(seed + offset) // 100}"}
        pending[split].append(page)
    for split, pages in pending.items():
        if pages:
            PageDataset(out / split).upsert(pages)


def sample_store(source: Path, out: Path, pages: int, per_document: int = 2, min_text_elements: int = 5) -> int:
    """A small page store of ``source``'s pages (at most ``per_document`` of each document, each with
    at least ``min_text_elements`` text elements), images kept as grayscale PNG: the real pages
    ``./run demo --real`` ships. Its own splits go by document (the last fifth of the documents
    ``test``, the fifth before ``val``, at least one each), recorded in ``meta["split"]`` as a
    pipeline's split step keeps them; the corpus's split moves to ``meta["corpus_split"]``."""
    store, target = PageDataset(source), PageDataset(out)
    taken: Counter = Counter()
    chosen = []
    for page in store.iter_pages():
        document = page.meta.get("document_id")
        if taken[document] >= per_document or sum(e.category == "text" for e in page.elements) < min_text_elements:
            continue
        taken[document] += 1
        page.image = target.save_image(page.page_id, store.load_image(page).convert("L"))
        chosen.append(page)
        if len(chosen) == pages:
            break
    documents = list(dict.fromkeys(page.meta.get("document_id") for page in chosen))
    held = max(1, round(len(documents) / 5))
    split_of = {d: "test" if i >= len(documents) - held else "val" if i >= len(documents) - 2 * held else "train"
                for i, d in enumerate(documents)}
    for page in chosen:
        page.meta["corpus_split"] = page.meta.get("split")
        page.meta["split"] = split_of[page.meta.get("document_id")]
    target.upsert(chosen)
    return len(chosen)
