"""Deterministic synthetic document pages with exact ground-truth markup and layout boxes.

No data set can be downloaded here, so every stage (training, curation, evaluation, serving)
runs on pages drawn by this module: paragraphs, titles, HTML tables, LaTeX formulas (rendered
by matplotlib mathtext) and layout-only headers/footers. The same seed always gives the same
page, pixel for pixel.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import matplotlib
from PIL import Image, ImageDraw, ImageFont

from components.data.page_store import PageDataset
from components.data.pages import LayoutElement, Page

matplotlib.use("Agg")
from matplotlib import mathtext  # (after use(): the backend must be chosen first)

_FONT_DIR = Path(matplotlib.get_data_path()) / "fonts" / "ttf"

LEXICON = (
    "the of and to in is for on with as by this that from are be at an or which model data page "
    "table text figure result method value layer input output image document learning training "
    "analysis system network time rate error loss score test set case first second new large small "
    "high low each all more than we can show use two three four section report study paper work "
    "based using these other such when where only also between number results methods values models "
    "given sample samples linear mean total average range group level field source order block "
    "token tokens vision language parallel decoding diffusion annotation dataset version metric "
    "accuracy speed memory batch window prefix stage weight weights ratio step steps final early"
).split()

_GREEK = [r"\alpha", r"\beta", r"\gamma", r"\lambda", r"\mu", r"\sigma", r"\theta", r"\pi"]
_VARS = list("abcnxyzkt")


@dataclass(frozen=True)
class SyntheticConfig:
    """How pages look. ``tiny`` fits a CPU-trained toy model; ``standard`` looks like real pages."""

    width: int = 320
    height: int = 416
    margin: int = 12
    font_size: int = 17  # large enough for the CPU-sized model to start reading within minutes
    title_font_size: int = 22
    small_font_size: int = 10
    lexicon_size: int = 48
    max_body_elements: int = 4
    paragraph_words: tuple[int, int] = (4, 14)
    table_rows: tuple[int, int] = (2, 3)
    table_cols: tuple[int, int] = (2, 3)
    formula_terms: tuple[int, int] = (1, 2)
    p_header: float = 0.5
    p_footer: float = 0.5
    category_weights: tuple[tuple[str, float], ...] = (("text", 0.45), ("title", 0.15), ("table", 0.2), ("formula", 0.2))

    @classmethod
    def preset(cls, name: str) -> SyntheticConfig:
        presets = {
            "tiny": cls(),
            # A reading curriculum for training from scratch: one or two short blocks per page, so
            # a fresh model finds which image cells hold the next word long before it could on
            # full pages. Never an evaluation preset.
            "lines": cls(max_body_elements=2, paragraph_words=(1, 8), table_rows=(2, 2), table_cols=(2, 2),
                         formula_terms=(1, 1), p_header=0.2, p_footer=0.2),
            "standard": cls(
                width=768, height=1024, margin=48, font_size=18, title_font_size=28, small_font_size=13,
                lexicon_size=len(LEXICON), max_body_elements=10, paragraph_words=(12, 60),
                table_rows=(2, 6), table_cols=(2, 5), formula_terms=(1, 4),
            ),
        }
        if name not in presets:
            raise ValueError(f"unknown synthetic preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]


@lru_cache(maxsize=16)
def _font(size: int, bold: bool = False) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(_FONT_DIR / ("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf")), size)


def _words(rng: random.Random, cfg: SyntheticConfig, low: int, high: int) -> list[str]:
    vocab = LEXICON[: max(4, min(cfg.lexicon_size, len(LEXICON)))]
    return [rng.choice(vocab) for _ in range(rng.randint(low, high))]


def random_formula(rng: random.Random, terms: tuple[int, int] = (1, 2)) -> str:
    """A LaTeX formula that matplotlib mathtext can render (so images always match the markup)."""

    def atom() -> str:
        kind = rng.randrange(6)
        base = rng.choice(_VARS + _GREEK)
        if kind == 0:
            return f"{base}^{{{rng.randint(2, 9)}}}"
        if kind == 1:
            return f"{base}_{{{rng.choice([*_VARS[:4], '0', '1', 'i'])}}}"
        if kind == 2:
            return rf"\frac{{{rng.choice(_VARS)}}}{{{rng.choice([*_VARS, '2', '3'])}}}"
        if kind == 3:
            return rf"\sqrt{{{base}}}"
        if kind == 4:
            return rf"\sum_{{i=1}}^{{{rng.choice(['n', 'k', 'N'])}}} {rng.choice(_VARS)}_{{i}}"
        return base

    parts = [atom() for _ in range(rng.randint(*terms) + 1)]
    expr = parts[0]
    for part in parts[1:]:
        expr += f" {rng.choice(['+', '-', '='])} {part}"
    return expr


@lru_cache(maxsize=4096)
def render_formula(latex: str, font_size: int) -> Image.Image:
    """Render LaTeX with matplotlib mathtext into a tightly cropped grayscale image."""
    buffer = io.BytesIO()
    mathtext.math_to_image(f"${latex}$", buffer, dpi=72, format="png", prop=matplotlib.font_manager.FontProperties(size=font_size))
    buffer.seek(0)
    image = Image.open(buffer).convert("L")
    bbox = Image.eval(image, lambda v: 255 - v).getbbox()
    return image.crop(bbox) if bbox else image


def _wrap(draw: ImageDraw.ImageDraw, words: list[str], font: ImageFont.FreeTypeFont, width: int) -> list[str]:
    lines, current = [], ""
    for word in words:
        candidate = f"{current} {word}".strip()
        if current and draw.textlength(candidate, font=font) > width:
            lines.append(current)
            current = word
        else:
            current = candidate
    if current:
        lines.append(current)
    return lines


class _PageCanvas:
    """Draws elements top-down and records their boxes; refuses elements that do not fit."""

    def __init__(self, cfg: SyntheticConfig):
        self.cfg = cfg
        self.image = Image.new("L", (cfg.width, cfg.height), 255)
        self.draw = ImageDraw.Draw(self.image)
        self.top = cfg.margin
        self.bottom = cfg.height - cfg.margin
        self.elements: list[LayoutElement] = []
        self.words: list[tuple[str, tuple[float, float, float, float]]] = []  # every drawn word and its box

    @property
    def content_width(self) -> int:
        return self.cfg.width - 2 * self.cfg.margin

    def _fits(self, height: int) -> bool:
        return self.top + height <= self.bottom

    def add_lines(self, category: str, words: list[str], font: ImageFont.FreeTypeFont, *, at_bottom: bool = False) -> bool:
        lines = _wrap(self.draw, words, font, self.content_width)
        line_height = font.size + 4
        height = line_height * len(lines)
        if not self._fits(height):
            return False
        x0 = self.cfg.margin
        y0 = self.bottom - height if at_bottom else self.top
        for i, line in enumerate(lines):
            top = y0 + i * line_height
            self.draw.text((x0, top), line, fill=0, font=font)
            x = float(x0)
            for word in line.split(" "):
                self.words.append((word, (x, top, x + self.draw.textlength(word, font=font), top + line_height)))
                x += self.draw.textlength(word + " ", font=font)
        right = max(self.draw.textlength(line, font=font) for line in lines)
        self.elements.append(LayoutElement(category, (x0, y0, x0 + right, y0 + height), " ".join(words)))
        if at_bottom:
            self.bottom = y0 - 4
        else:
            self.top = y0 + height + self.cfg.font_size // 2
        return True

    def add_table(self, rows: list[list[str]], font: ImageFont.FreeTypeFont) -> bool:
        n_cols = len(rows[0])
        pad = 4
        col_width = [max(self.draw.textlength(r[c], font=font) for r in rows) + 2 * pad for c in range(n_cols)]
        row_height = font.size + 2 * pad
        width, height = sum(col_width), row_height * len(rows)
        if width > self.content_width or not self._fits(height):
            return False
        x0, y0 = self.cfg.margin, self.top
        for r, row in enumerate(rows):
            x = x0
            for c, cell in enumerate(row):
                self.draw.rectangle((x, y0 + r * row_height, x + col_width[c], y0 + (r + 1) * row_height), outline=0)
                self.draw.text((x + pad, y0 + r * row_height + pad), cell, fill=0, font=font)
                self.words.append((cell, (x + pad, y0 + r * row_height, x + pad + self.draw.textlength(cell, font=font),
                                          y0 + (r + 1) * row_height)))
                x += col_width[c]
        html = "<table>" + "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows) + "</table>"
        self.elements.append(LayoutElement("table", (x0, y0, x0 + width, y0 + height), html))
        self.top = y0 + height + self.cfg.font_size // 2
        return True

    def add_formula(self, latex: str) -> bool:
        rendered = render_formula(latex, self.cfg.font_size)
        if rendered.width > self.content_width or not self._fits(rendered.height):
            return False
        x0 = self.cfg.margin + (self.content_width - rendered.width) // 2
        self.image.paste(rendered, (x0, self.top))
        self.elements.append(LayoutElement("formula", (x0, self.top, x0 + rendered.width, self.top + rendered.height), latex))
        self.top += rendered.height + self.cfg.font_size // 2
        return True


@dataclass(frozen=True)
class RenderedPage:
    page: Page  # image path not yet stored
    image: Image.Image
    # every word drawn (body, tables, headers and footers; not formulas) with its box in page pixels:
    # dense supervision for reading probes, not part of the page record
    words: list[tuple[str, tuple[float, float, float, float]]]


def generate_page(seed: int, cfg: SyntheticConfig | None = None, page_id: str | None = None) -> tuple[Page, Image.Image]:
    """Draw one page. Returns the page record (image path not yet stored) and its image."""
    rendered = render_page(seed, cfg, page_id)
    return rendered.page, rendered.image


def render_page(seed: int, cfg: SyntheticConfig | None = None, page_id: str | None = None) -> RenderedPage:
    """:func:`generate_page` plus the box of every word drawn."""
    cfg = cfg or SyntheticConfig()
    rng = random.Random(seed)
    canvas = _PageCanvas(cfg)
    body_font, small_font = _font(cfg.font_size), _font(cfg.small_font_size)
    if rng.random() < cfg.p_header:
        canvas.add_lines("header", _words(rng, cfg, 2, 4), small_font)
    if rng.random() < cfg.p_footer:
        canvas.add_lines("footer", [str(rng.randint(1, 300))], small_font, at_bottom=True)
    categories, weights = zip(*cfg.category_weights, strict=True)
    body = 0
    for _ in range(cfg.max_body_elements * 3):
        if body >= cfg.max_body_elements:
            break
        category = rng.choices(categories, weights)[0]
        if category == "text":
            placed = canvas.add_lines("text", _words(rng, cfg, *cfg.paragraph_words), body_font)
        elif category == "title":
            placed = canvas.add_lines("title", _words(rng, cfg, 1, 4), _font(cfg.title_font_size, bold=True))
        elif category == "table":
            n_rows, n_cols = rng.randint(*cfg.table_rows), rng.randint(*cfg.table_cols)
            cells = [[rng.choice([*_words(rng, cfg, 1, 1), str(rng.randint(0, 999))]) for _ in range(n_cols)] for _ in range(n_rows)]
            placed = canvas.add_table(cells, body_font)
        else:
            placed = canvas.add_formula(random_formula(rng, cfg.formula_terms))
        body += placed
    page = Page(
        page_id=page_id or f"syn-{seed:08d}",
        image="",
        width=cfg.width,
        height=cfg.height,
        elements=canvas.elements,
        source="synthetic",
        meta={"seed": seed},
    )
    return RenderedPage(page, canvas.image.convert("RGB"), canvas.words)


def generate_dataset(root: str | Path, n_pages: int, seed: int = 0, cfg: SyntheticConfig | None = None) -> PageDataset:
    """Write ``n_pages`` synthetic pages (seeds ``seed .. seed+n-1``) as a dataset folder."""
    dataset = PageDataset(root)
    pages = []
    for offset in range(n_pages):
        page, image = generate_page(seed + offset, cfg)
        page = replace(page, image=dataset.save_image(page.page_id, image))
        pages.append(page)
    dataset.write(pages)
    return dataset
