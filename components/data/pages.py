"""Page records (image, ground-truth markup, layout, curation state) and safe image loading.

Where pages are kept is :mod:`components.data.page_store`.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from components.data.markup import ALL_CATEGORIES, BLOCK_CATEGORIES, MarkupBlock, render_markup

LEGACY_MANIFEST = "pages.jsonl"  # the store before the sharded one (see page_store.migrate_jsonl)
IMAGES_DIR = "images"


class InvalidPageError(ValueError):
    """A page image or record that cannot be used (corrupt, empty, zero-size, malformed)."""


@dataclass
class LayoutElement:
    """One laid-out element: category, pixel box (x0, y0, x1, y1) and its markup content."""

    category: str
    bbox: tuple[float, float, float, float]
    content: str = ""

    def __post_init__(self) -> None:
        if self.category not in ALL_CATEGORIES:
            raise InvalidPageError(f"unknown element category {self.category!r}; expected {ALL_CATEGORIES}")
        self.bbox = tuple(float(v) for v in self.bbox)  # type: ignore[assignment]
        x0, y0, x1, y1 = self.bbox
        if x1 < x0 or y1 < y0:
            raise InvalidPageError(f"element box {self.bbox} has negative size")


@dataclass
class Page:
    """A page image with its ground truth (or predicted) markup and layout.

    ``elements`` are in reading order. ``meta`` carries provenance and curation state
    (pre-annotation confidence, consistency score C(x), annotator corrections, ...).
    """

    page_id: str
    image: str  # path relative to the dataset folder
    width: int
    height: int
    elements: list[LayoutElement] = field(default_factory=list)
    source: str = "synthetic"
    meta: dict = field(default_factory=dict)
    markup_override: str | None = None  # set when markup came from a person or model, not elements

    @property
    def markup(self) -> str:
        """The page's target markup: body elements in reading order (headers/footers excluded)."""
        if self.markup_override is not None:
            return self.markup_override
        return render_markup(
            [MarkupBlock(e.category, e.content) for e in self.elements if e.category in BLOCK_CATEGORIES]
        )

    def to_json(self) -> dict:
        record = asdict(self)
        record["markup"] = self.markup
        return record

    @classmethod
    def from_json(cls, record: dict) -> Page:
        try:
            elements = [LayoutElement(e["category"], tuple(e["bbox"]), e.get("content", "")) for e in record.get("elements", [])]
            page = cls(
                page_id=str(record["page_id"]),
                image=str(record["image"]),
                width=int(record["width"]),
                height=int(record["height"]),
                elements=elements,
                source=record.get("source", "unknown"),
                meta=dict(record.get("meta", {})),
                markup_override=record.get("markup_override"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidPageError(f"malformed page record {record.get('page_id', '?')!r}: {exc}") from exc
        return page


MIN_IMAGE_SIDE = 8  # pixels: a smaller image (a lone bullet's crop) is nothing a model reads


def validate_image(image: Image.Image, *, what: str = "page image") -> Image.Image:
    """Reject images no model can read: zero-size or blank-to-the-pixel pages."""
    if image.width == 0 or image.height == 0:
        raise InvalidPageError(f"{what} has zero size ({image.width}x{image.height})")
    if image.width < MIN_IMAGE_SIDE or image.height < MIN_IMAGE_SIDE:
        raise InvalidPageError(f"{what} is too small to read ({image.width}x{image.height}); "
                               f"need at least {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE}")
    return image


# A 600-dpi A3 scan is ~70M pixels; anything larger is refused before it is decoded, so a
# decompression bomb (a tiny PNG declaring 20000x20000) costs nothing but an error.
MAX_IMAGE_PIXELS = 80_000_000


_OBJECT_ADDRESS = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")  # Python object reprs in library messages


def load_image(source: str | os.PathLike | bytes, what: str | None = None) -> Image.Image:
    """Open an image from a path or bytes and fully decode it, with a clear error if it is corrupt
    or larger than :data:`MAX_IMAGE_PIXELS` (checked on the header, before decoding)."""
    if what is None:  # how errors name the input
        what = f"page image ({len(source):,} bytes)" if isinstance(source, bytes) else f"page image {os.fspath(source)!r}"
    limit = f"{MAX_IMAGE_PIXELS / 1e6:.0f}M-pixel limit"
    try:
        handle = io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")  # noqa: SIM115
        with handle, Image.open(handle) as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise InvalidPageError(
                    f"{what} is {image.width}x{image.height} = {image.width * image.height / 1e6:.0f}M pixels, "
                    f"over the {limit}; downscale it first")
            image.load()
            decoded = image.convert("RGB")
    except FileNotFoundError as exc:
        raise InvalidPageError(f"{what} does not exist") from exc
    except Image.DecompressionBombError as exc:
        # Pillow's own message quotes its own limit; ours is the one that applies.
        declared = re.search(r"\((\d+) pixels\)", str(exc))
        size = f" declares {int(declared.group(1)) / 1e6:.0f}M pixels, which" if declared else ""
        raise InvalidPageError(f"{what}{size} is over the {limit} (refused before decoding); downscale it first") from exc
    except UnidentifiedImageError as exc:
        raise InvalidPageError(f"{what} is not a readable image (not PNG, JPEG, TIFF, WebP, ..., or corrupt)") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidPageError(f"{what} is not a readable image (corrupt: {_OBJECT_ADDRESS.sub('', str(exc))})") from exc
    return validate_image(decoded, what=what)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file so readers see either the old or the new content, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
