"""Bring your own pages: render PDFs (pypdfium2) or take page images into a :class:`PageDataset`.

Imported pages carry no ground truth (``elements=[]``); they are what pre-annotation, curation
and evaluation runs start from. Imports are idempotent: a page's id is derived from the
content hash of its file (plus the page number for PDFs), so re-running an import skips pages
already in the dataset whatever the file is called now. The manifest is written once, at the
end; a failure leaves it untouched and removes the images the failed part had written.

Render settings are not part of a page id: importing the same PDF again at another DPI keeps
the pages already imported (their ``meta.render_dpi`` says how they were rendered).

CLI: ``python -m components.data.pdf SOURCE DATASET [--dpi 144] [--max-side N] [--skip-bad]``
where SOURCE is a PDF, an image, or a folder of them.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_raw
from PIL import Image, ImageOps

from components.data.page_store import PageDataset
from components.data.pages import InvalidPageError, Page, load_image, validate_image

PDF_SUFFIXES = (".pdf",)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
DEFAULT_DPI = 144  # 2x PDF points: ~1190x1684 px for A4, in the range page parsers are trained on
MAX_RENDER_PIXELS = 40_000_000  # a poster-sized page is scaled down to this rather than exhausting memory
OnError = Literal["raise", "skip"]

class PdfImportError(InvalidPageError):
    """A PDF that cannot be imported: missing, empty, corrupt, encrypted, or a page that fails to render."""


@dataclass
class ImportReport:
    """What one import did. ``failed`` holds (file, reason) for inputs that were left out."""

    added: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        lines = [f"added {len(self.added)} pages, skipped {len(self.skipped)} already present, {len(self.failed)} failed"]
        lines += [f"  failed: {name}: {reason}" for name, reason in self.failed]
        return "\n".join(lines)


@dataclass
class RenderedPage:
    number: int  # 1-based
    image: Image.Image
    dpi: float  # effective render resolution (lower than asked for when the page was scaled down)
    size_pt: tuple[float, float]


# ----- files ----------------------------------------------------------------------------------
def collect_files(source: str | Path, suffixes: Iterable[str]) -> list[Path]:
    """The files with one of ``suffixes``: ``source`` itself, or those directly inside the folder, sorted."""
    source = Path(source)
    suffixes = tuple(s.lower() for s in suffixes)
    if source.is_file():
        return [source] if source.suffix.lower() in suffixes else []
    if not source.is_dir():
        raise FileNotFoundError(f"{source} does not exist")
    return sorted(p for p in source.iterdir() if p.is_file() and p.suffix.lower() in suffixes)


def file_sha256(path: Path) -> str:
    """Content hash of a file; an unreadable file is an :class:`InvalidPageError` naming it."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        raise InvalidPageError(f"{str(path)!r} cannot be read: {exc}") from exc
    return digest.hexdigest()


def pdf_page_id(pdf_sha256: str, page_number: int) -> str:
    return f"pdf-{pdf_sha256[:16]}-p{page_number:04d}"


def image_page_id(image_sha256: str) -> str:
    return f"img-{image_sha256[:16]}"


# ----- rendering ------------------------------------------------------------------------------
def open_pdf(path: str | Path, password: str | None = None) -> pdfium.PdfDocument:
    """Open a PDF with an error that names the file and says what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise PdfImportError(f"PDF {str(path)!r} does not exist")
    if path.stat().st_size == 0:
        raise PdfImportError(f"PDF {str(path)!r} is an empty file")
    try:
        document = pdfium.PdfDocument(str(path), password=password)
    except OSError as exc:
        raise PdfImportError(f"PDF {str(path)!r} cannot be read: {exc}") from exc
    except pdfium.PdfiumError as exc:
        raise PdfImportError(f"PDF {str(path)!r} {_load_failure_reason(path, exc.err_code, password)}") from exc
    if len(document) == 0:
        document.close()
        raise PdfImportError(f"PDF {str(path)!r} has no pages")
    return document


def _load_failure_reason(path: Path, err_code: int | None, password: str | None) -> str:
    """Why PDFium refused a file.

    PDFium's last-error code is process-wide and not reset on success, and some failures (a
    document with no pages) never set it, so a code can be left over from an earlier file: the
    security codes are trusted only when the file really has an ``/Encrypt`` entry.
    """
    encrypted = b"/Encrypt" in path.read_bytes()
    if encrypted and err_code == pdfium_raw.FPDF_ERR_PASSWORD:
        return "is encrypted and the password is wrong" if password is not None else "is encrypted: pass the password"
    if encrypted and err_code == pdfium_raw.FPDF_ERR_SECURITY:
        return "uses an unsupported security handler"
    return "is corrupt, not a PDF, or has no pages"


def render_scale(size_pt: tuple[float, float], dpi: float, max_side: int | None) -> float:
    """Pixels per PDF point: ``dpi``/72, reduced to fit ``max_side`` and :data:`MAX_RENDER_PIXELS`."""
    width, height = size_pt
    scale = dpi / 72.0
    if max_side is not None:
        scale = min(scale, max_side / max(width, height))
    return min(scale, math.sqrt(MAX_RENDER_PIXELS / max(width * height, 1.0)))


def render_pdf(
    path: str | Path, dpi: float = DEFAULT_DPI, max_side: int | None = None, password: str | None = None
) -> Iterator[RenderedPage]:
    """Render every page of a PDF to an RGB image, one at a time."""
    document = open_pdf(path, password)
    try:
        yield from render_pages(document, Path(path), range(1, len(document) + 1), dpi, max_side)
    finally:
        document.close()


def render_pages(
    document: pdfium.PdfDocument, path: Path, numbers: Iterable[int], dpi: float = DEFAULT_DPI, max_side: int | None = None
) -> Iterator[RenderedPage]:
    """Render the given pages (1-based) of an open document; ``path`` only names it in errors."""
    if dpi <= 0 or (max_side is not None and max_side < 8):
        raise ValueError("dpi must be positive and max_side at least 8 pixels")
    for number in numbers:
        try:
            page = document[number - 1]
            try:
                size_pt = tuple(page.get_size())
                scale = render_scale(size_pt, dpi, max_side)
                image = page.render(scale=scale).to_pil().convert("RGB")
            finally:
                page.close()
        except (pdfium.PdfiumError, IndexError, ValueError) as exc:
            raise PdfImportError(f"PDF {str(path)!r}: page {number} cannot be rendered: {exc}") from exc
        try:
            validate_image(image, what=f"page {number} of PDF {str(path)!r}")
        except InvalidPageError as exc:
            raise PdfImportError(str(exc)) from exc
        yield RenderedPage(number=number, image=image, dpi=round(scale * 72.0, 3), size_pt=size_pt)


# ----- writing into a dataset -------------------------------------------------------------------
class _PendingImport:
    """Pages written as images but not yet in the manifest; committed once, or rolled back."""

    def __init__(self, dataset: PageDataset):
        self.dataset = dataset
        self.pages: list[Page] = []
        self.created: set[str] = set()  # image files this import wrote (content-addressed: others may be shared)
        self.report = ImportReport()

    def has(self, page_id: str) -> bool:
        if any(p.page_id == page_id for p in self.pages):
            return True
        present = self.dataset.get(page_id) if self.dataset.exists() else None
        return present is not None and self.dataset.image_path(present).exists()

    def add(self, page_id: str, image: Image.Image, source: str, meta: dict) -> Page:
        relative, created = self.dataset.store_image(image)
        if created:
            self.created.add(relative)
        page = Page(page_id=page_id, image=relative, width=image.width, height=image.height, elements=[], source=source, meta=meta)
        self.pages.append(page)
        return page

    def discard(self, pages: list[Page]) -> None:
        """Remove the image files this import created for ``pages`` (shared or older files stay)."""
        for page in pages:
            if page.image in self.created:
                self.dataset.image_path(page).unlink(missing_ok=True)
                self.created.discard(page.image)
        kept = {id(p) for p in pages}
        self.pages = [p for p in self.pages if id(p) not in kept]

    def commit(self) -> ImportReport:
        if self.pages:
            self.dataset.upsert(self.pages)
        self.report.added = [p.page_id for p in self.pages]
        return self.report


def _check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def pdf_document_id(digest: str) -> str:
    """The document a PDF's pages belong to (its content hash): splits keep a document's pages together."""
    return f"pdf:{digest}"


def import_pdfs(
    source: str | Path, dataset_root: str | Path, dpi: float = DEFAULT_DPI, max_side: int | None = None,
    password: str | None = None, on_error: OnError = "raise",
) -> ImportReport:
    """Render every page of a PDF (or of every PDF in a folder) into the dataset at ``dataset_root``.

    ``on_error="raise"``: the first bad PDF raises :class:`PdfImportError` and nothing of this call
    is kept. ``"skip"``: bad PDFs are left out whole (listed in ``report.failed``), the rest imported.
    """
    _check_on_error(on_error)
    if dpi <= 0 or (max_side is not None and max_side < 8):
        raise ValueError("dpi must be positive and max_side at least 8 pixels")
    pending = _PendingImport(PageDataset(dataset_root))
    try:
        for path in collect_files(source, PDF_SUFFIXES):
            written: list[Page] = []
            try:
                _import_pdf(pending, path, dpi, max_side, password, written)
            except InvalidPageError as exc:  # PdfImportError, or an unreadable file
                pending.discard(written)
                if on_error == "raise":
                    raise
                pending.report.failed.append((str(path), str(exc)))
    except BaseException:
        pending.discard(list(pending.pages))
        raise
    return pending.commit()


def _import_pdf(
    pending: _PendingImport, path: Path, dpi: float, max_side: int | None, password: str | None, written: list[Page]
) -> None:
    digest = file_sha256(path)
    document = open_pdf(path, password)
    try:
        page_count = len(document)
        ids = {number: pdf_page_id(digest, number) for number in range(1, page_count + 1)}
        todo = [number for number, page_id in ids.items() if not pending.has(page_id)]
        pending.report.skipped += [page_id for number, page_id in ids.items() if number not in todo]
        for rendered in render_pages(document, path, todo, dpi, max_side):
            meta = {
                "pdf_path": str(path.resolve()), "pdf_sha256": digest, "document_id": pdf_document_id(digest),
                "page_number": rendered.number,
                "page_count": page_count, "render_dpi": rendered.dpi, "page_size_pt": list(rendered.size_pt),
            }
            source = f"pdf:{path.name}#{rendered.number}"
            written.append(pending.add(ids[rendered.number], rendered.image, source, meta))
    finally:
        document.close()


def import_images(source: str | Path, dataset_root: str | Path, on_error: OnError = "skip") -> ImportReport:
    """Take page images (PNG/JPEG; a file or a folder) into the dataset, stored as PNG.

    Corrupt or unreadable images are listed in ``report.failed`` and the good ones kept
    (``on_error="raise"`` instead raises :class:`InvalidPageError` and keeps nothing).
    Camera photos are turned upright by their EXIF orientation.
    """
    _check_on_error(on_error)
    files = collect_files(source, IMAGE_SUFFIXES)
    pending = _PendingImport(PageDataset(dataset_root))
    try:
        for path in files:
            try:
                digest = file_sha256(path)
                page_id = image_page_id(digest)
                if pending.has(page_id):
                    pending.report.skipped.append(page_id)
                    continue
                image = load_image(path)
                image = validate_image(ImageOps.exif_transpose(image), what=f"page image {str(path)!r}")
            except InvalidPageError as exc:
                if on_error == "raise":
                    raise
                pending.report.failed.append((str(path), str(exc)))
                continue
            meta = {"image_path": str(path.resolve()), "sha256": digest, "document_id": f"image:{digest}"}
            pending.add(page_id, image, f"image:{path.name}", meta)
    except BaseException:
        pending.discard(list(pending.pages))
        raise
    return pending.commit()


# ----- CLI --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Import PDFs and page images into a page dataset.")
    parser.add_argument("source", type=Path, help="a PDF, an image, or a folder of them")
    parser.add_argument("dataset", type=Path, help="dataset folder (created if missing)")
    parser.add_argument("--dpi", type=float, default=DEFAULT_DPI)
    parser.add_argument("--max-side", type=int, default=None, help="cap the longer side of rendered pages (pixels)")
    parser.add_argument("--password", default=None, help="password of encrypted PDFs")
    parser.add_argument("--skip-bad", action="store_true", help="leave out bad PDFs instead of stopping")
    args = parser.parse_args(argv)
    try:
        pdfs = import_pdfs(
            args.source, args.dataset, args.dpi, args.max_side, args.password, "skip" if args.skip_bad else "raise"
        )
        images = import_images(args.source, args.dataset)
    except (InvalidPageError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not (pdfs.added or pdfs.skipped or pdfs.failed or images.added or images.skipped or images.failed):
        print(f"error: no PDFs or page images ({', '.join(PDF_SUFFIXES + IMAGE_SUFFIXES)}) in {args.source}", file=sys.stderr)
        return 1
    print("PDFs:", pdfs.summary())
    print("images:", images.summary())
    return 0 if pdfs.ok and images.ok else 2


if __name__ == "__main__":
    raise SystemExit(main())
