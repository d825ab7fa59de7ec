"""Bring-your-own pages: real PDFs rendered with pypdfium2, and folders of page images."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from components.data.page_store import PageDataset
from components.data.pages import InvalidPageError, load_image
from components.data.pdf import PdfImportError, import_images, import_pdfs, main, pdf_page_id, render_pdf
from components.data.synthetic import generate_page

PAGE_SIZE = (320, 416)  # synthetic pages, pixels; saved at 72 dpi they are 320x416 pt


def synthetic_pages(seeds) -> list[Image.Image]:
    return [generate_page(seed)[1] for seed in seeds]


def write_pdf(path: Path, images: list[Image.Image]) -> Path:
    """A real multi-page PDF (Pillow's PDF writer), one image per page, 1 px = 1 pt.

    Copies, because Pillow 13 leaves ``append_images`` on the appended images and reuses it
    when one of them is saved later.
    """
    copies = [image.copy() for image in images]
    copies[0].save(path, "PDF", save_all=True, append_images=copies[1:], resolution=72)
    return path


def write_pdf_objects(path: Path, objects: list[bytes], trailer: bytes = b"") -> Path:
    """A hand-made PDF with a correct cross-reference table (for cases no library here writes)."""
    body = b"%PDF-1.4\n"
    offsets = []
    for number, obj in enumerate(objects, 1):
        offsets.append(len(body))
        body += b"%d 0 obj %s endobj\n" % (number, obj)
    xref = len(body)
    body += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    body += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    body += b"trailer << /Size %d /Root 1 0 R %s>>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, trailer, xref)
    path.write_bytes(body)
    return path


def write_empty_pdf(path: Path) -> Path:
    return write_pdf_objects(path, [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [] /Count 0 >>"])


def write_locked_pdf(path: Path) -> Path:
    """Standard security handler whose /U entry does not validate the empty user password."""
    return write_pdf_objects(
        path,
        [
            b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 200] >>",
            b"<< /Filter /Standard /V 1 /R 2 /Length 40 /P -4 /O <" + b"11" * 32 + b"> /U <" + b"22" * 32 + b"> >>",
        ],
        trailer=b"/Encrypt 4 0 R /ID [<" + b"33" * 16 + b"> <" + b"33" * 16 + b">] ",
    )


@pytest.fixture(scope="module")
def pages() -> list[Image.Image]:
    return synthetic_pages(range(3))


@pytest.fixture
def pdf(tmp_path, pages) -> Path:
    return write_pdf(tmp_path / "report.pdf", pages)


def dataset_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}


# ----- PDFs ------------------------------------------------------------------------------------
def test_pdf_pages_render_at_the_chosen_dpi_into_a_dataset(tmp_path, pdf, pages):
    report = import_pdfs(pdf, tmp_path / "ds", dpi=144)
    dataset = PageDataset(tmp_path / "ds")
    imported = dataset.pages()
    assert len(report.added) == len(imported) == 3 and report.ok and not report.skipped
    for number, page in enumerate(imported, 1):
        assert (page.width, page.height) == (2 * PAGE_SIZE[0], 2 * PAGE_SIZE[1])
        assert dataset.load_image(page).size == (page.width, page.height)
        assert page.elements == [] and page.markup == ""
        assert page.source == f"pdf:report.pdf#{number}"
        assert page.meta["page_number"] == number and page.meta["page_count"] == 3
        assert page.meta["render_dpi"] == 144 and page.meta["pdf_path"] == str(pdf.resolve())
        assert re.fullmatch(rf"pdf-[0-9a-f]{{16}}-p{number:04d}", page.page_id)


def test_rendered_pdf_page_shows_the_page_that_was_saved(pdf, pages):
    rendered = list(render_pdf(pdf, dpi=72))
    assert [r.number for r in rendered] == [1, 2, 3]
    for original, page in zip(pages, rendered, strict=True):
        assert page.image.size == PAGE_SIZE
        difference = np.abs(np.asarray(page.image, dtype=float) - np.asarray(original.convert("RGB"), dtype=float))
        assert difference.mean() < 3.0  # same page, up to resampling
    other = np.asarray(rendered[1].image, dtype=float)
    assert np.abs(np.asarray(rendered[0].image, dtype=float) - other).mean() > 5.0  # and not any page


def test_max_side_caps_the_rendered_size(tmp_path, pdf):
    import_pdfs(pdf, tmp_path / "ds", dpi=300, max_side=300)
    for page in PageDataset(tmp_path / "ds").pages():
        assert max(page.width, page.height) in (299, 300)
        assert page.meta["render_dpi"] == pytest.approx(72 * 300 / PAGE_SIZE[1], abs=0.01)


def test_reimport_is_idempotent_and_keys_on_content_not_name(tmp_path, pdf):
    root = tmp_path / "ds"
    import_pdfs(pdf, root)
    before = dataset_files(root)
    again = import_pdfs(pdf, root)
    assert again.added == [] and len(again.skipped) == 3
    renamed = shutil.copy(pdf, tmp_path / "same-report-new-name.pdf")
    assert import_pdfs(renamed, root).added == []
    assert dataset_files(root) == before  # manifest and images byte-identical


def test_import_adds_to_an_existing_dataset_without_touching_its_pages(tmp_path, pdf):
    root = tmp_path / "ds"
    dataset = PageDataset(root)
    page, image = generate_page(42)
    page.image = dataset.save_image(page.page_id, image)
    dataset.write([page])
    import_pdfs(pdf, root)
    pages = dataset.pages()
    assert len(pages) == 4 and pages[0].page_id == page.page_id and pages[0].markup == page.markup


def test_a_page_whose_image_went_missing_is_rendered_again(tmp_path, pdf):
    root = tmp_path / "ds"
    import_pdfs(pdf, root)
    dataset = PageDataset(root)
    lost = dataset.pages()[1]
    dataset.image_path(lost).unlink()
    report = import_pdfs(pdf, root)
    assert report.added == [lost.page_id] and len(report.skipped) == 2
    assert dataset.load_image(lost).size == (lost.width, lost.height)
    assert len(dataset.pages()) == 3


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda path: path.write_bytes(b"%PDF-1.4\nthis is not really a pdf"), "corrupt, not a PDF"),
        (lambda path: path.write_bytes(b""), "empty file"),
        (write_empty_pdf, "has no pages"),
        (write_locked_pdf, "encrypted"),
    ],
    ids=["corrupt", "zero-bytes", "no-pages", "encrypted"],
)
def test_bad_pdf_gets_a_clear_error_naming_the_file_and_writes_nothing(tmp_path, make, message):
    bad = tmp_path / "broken-scan.pdf"
    make(bad)
    root = tmp_path / "ds"
    with pytest.raises(PdfImportError, match=message) as caught:
        import_pdfs(bad, root)
    assert "broken-scan.pdf" in str(caught.value)
    assert isinstance(caught.value, InvalidPageError)
    assert dataset_files(root) == {}


def test_wrong_password_is_reported_and_not_blamed_on_the_next_file(tmp_path):
    with pytest.raises(PdfImportError, match="password is wrong"):
        import_pdfs(write_locked_pdf(tmp_path / "locked.pdf"), tmp_path / "ds", password="guess")
    # PDFium keeps its last error code across files; an empty PDF loaded next must not read as "encrypted".
    with pytest.raises(PdfImportError, match="has no pages"):
        import_pdfs(write_empty_pdf(tmp_path / "empty.pdf"), tmp_path / "ds")


def test_folder_with_a_bad_pdf_keeps_nothing_or_only_the_good_ones(tmp_path, pages):
    folder = tmp_path / "inbox"
    folder.mkdir()
    write_pdf(folder / "a-good.pdf", pages[:2])
    (folder / "b-bad.pdf").write_bytes(b"%PDF-1.7 truncated garbage")
    write_pdf(folder / "c-good.pdf", pages[2:])
    (folder / "notes.txt").write_text("not a page")
    root = tmp_path / "ds"

    with pytest.raises(PdfImportError, match=r"b-bad\.pdf"):
        import_pdfs(folder, root)
    assert dataset_files(root) == {}  # a-good.pdf's rendered pages were removed again: no partial import

    report = import_pdfs(folder, root, on_error="skip")
    assert len(report.added) == 3 and [name for name, _ in report.failed] == [str(folder / "b-bad.pdf")]
    assert {p.source for p in PageDataset(root).pages()} == {"pdf:a-good.pdf#1", "pdf:a-good.pdf#2", "pdf:c-good.pdf#1"}
    assert len([p for p in (root / "images").rglob("*") if p.is_file()]) == 3


def test_pdf_failing_after_its_first_page_leaves_no_images_behind(tmp_path, pages):
    folder = tmp_path / "inbox"
    folder.mkdir()
    write_pdf(folder / "a-mixed.pdf", [pages[0], Image.new("RGB", (2, 2), "white")])  # page 2: 2x2 pt, unreadable
    write_pdf(folder / "b-good.pdf", pages[1:2])
    root = tmp_path / "ds"
    report = import_pdfs(folder, root, on_error="skip")
    [(name, reason)] = report.failed
    assert name.endswith("a-mixed.pdf") and "page 2" in reason and "too small" in reason
    assert [p.source for p in PageDataset(root).pages()] == ["pdf:b-good.pdf#1"]
    assert len([p for p in (root / "images").rglob("*") if p.is_file()]) == 1  # page 1 of the failed PDF was removed again


def test_bad_arguments_are_refused_before_any_work(tmp_path, pdf):
    with pytest.raises(ValueError, match="dpi"):
        import_pdfs(pdf, tmp_path / "ds", dpi=0)
    with pytest.raises(ValueError, match="on_error"):
        import_pdfs(pdf, tmp_path / "ds", on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        import_pdfs(tmp_path / "nowhere", tmp_path / "ds")
    assert pdf_page_id("ab" * 32, 7) == "pdf-abababababababab-p0007"


# ----- page images ------------------------------------------------------------------------------
def test_image_folder_import_reports_the_corrupt_image_and_keeps_the_good_ones(tmp_path, pages):
    folder = tmp_path / "photos"
    folder.mkdir()
    pages[0].save(folder / "p1.png")
    pages[1].convert("RGB").save(folder / "p2.JPG", quality=95)
    (folder / "p3.png").write_bytes(pages[2].tobytes()[:500])  # raw bytes with a .png name: corrupt
    shutil.copy(folder / "p1.png", folder / "z-copy-of-p1.png")  # same content: one page
    root = tmp_path / "ds"

    report = import_images(folder, root)
    assert len(report.added) == 2 and len(report.skipped) == 1
    [(name, reason)] = report.failed
    assert name.endswith("p3.png") and "p3.png" in reason and "corrupt" in reason
    dataset = PageDataset(root)
    stored = {p.source: p for p in dataset.pages()}
    assert set(stored) == {"image:p1.png", "image:p2.JPG"}
    page = stored["image:p1.png"]
    assert (page.width, page.height) == PAGE_SIZE and page.elements == []
    assert np.array_equal(np.asarray(dataset.load_image(page)), np.asarray(pages[0].convert("RGB")))  # lossless

    before = dataset_files(root)
    assert import_images(folder, root).added == []
    assert dataset_files(root) == before

    with pytest.raises(InvalidPageError, match=r"p3\.png"):
        import_images(folder, tmp_path / "strict", on_error="raise")
    assert dataset_files(tmp_path / "strict") == {}


def bomb_png(side: int = 20000) -> bytes:
    """A PNG declaring side x side pixels in a few kilobytes (a decompression bomb)."""
    import io
    import struct
    import zlib

    buffer = io.BytesIO()
    Image.new("1", (8, 8)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    ihdr = bytearray(data[12:29])  # chunk type + 13 bytes of IHDR data
    ihdr[4:12] = struct.pack(">II", side, side)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def test_a_decompression_bomb_is_reported_by_name_and_the_rest_imported(tmp_path, pages):
    folder = tmp_path / "scans"
    folder.mkdir()
    (folder / "bomb.png").write_bytes(bomb_png())
    pages[0].save(folder / "good.png")
    report = import_images(folder, tmp_path / "ds")
    [(name, reason)] = report.failed
    assert name.endswith("bomb.png") and "bomb.png" in reason and "80M-pixel limit" in reason
    assert [p.source for p in PageDataset(tmp_path / "ds").pages()] == ["image:good.png"]


def test_an_image_over_the_pixel_cap_is_refused_before_decoding(tmp_path):
    (tmp_path / "big.png").write_bytes(bomb_png(10000))  # 100M pixels: under PIL's own bomb limit
    with pytest.raises(InvalidPageError, match=r"big\.png.*10000x10000 = 100M pixels, over the 80M-pixel limit"):
        load_image(tmp_path / "big.png")


def test_camera_photo_is_stored_upright(tmp_path):
    photo = Image.new("RGB", (60, 30), "white")
    exif = photo.getexif()
    exif[0x0112] = 6  # EXIF orientation: rotate 90° clockwise to view
    photo.save(tmp_path / "phone.jpg", exif=exif.tobytes())
    import_images(tmp_path / "phone.jpg", tmp_path / "ds")
    [page] = PageDataset(tmp_path / "ds").pages()
    assert (page.width, page.height) == (30, 60)


def test_cli_imports_a_mixed_folder(tmp_path, pages, capsys):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_pdf(folder / "doc.pdf", pages[:2])
    pages[2].save(folder / "scan.png")
    assert main([str(folder), str(tmp_path / "ds"), "--dpi", "72"]) == 0
    assert "added 2 pages" in capsys.readouterr().out
    assert sorted(p.source for p in PageDataset(tmp_path / "ds").pages()) == ["image:scan.png", "pdf:doc.pdf#1", "pdf:doc.pdf#2"]
    assert main([str(tmp_path / "mixed" / "doc.pdf"), str(tmp_path / "ds")]) == 0  # idempotent
    assert main([str(tmp_path / "empty-folder-missing"), str(tmp_path / "ds")]) == 1
