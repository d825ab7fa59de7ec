"""A PDF page's text layer as lines with boxes, font size and monospace flag, and its furniture.

Born-digital PDFs (LaTeX, Texinfo, DocBook manuals) carry every character with its box; that is
exact ground truth for the text of a page rendered from them. Lines come in content order, which
for such documents is reading order, column by column. Used by the real-document corpus
(:mod:`components.data.corpus`) and the real-page pre-annotation benchmark.
"""

from __future__ import annotations

import ctypes
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import pypdfium2.raw as pdfium_raw

FURNITURE_BAND = 0.15  # top and bottom fraction of the page where running heads and folios may sit
FIXED_PITCH = 0x1  # PDF font descriptor flag
CELL_GAP_EM = 0.9  # a gap between characters wider than this many ems splits a line into runs (cells)


@dataclass
class TextLine:
    text: str
    box: tuple[float, float, float, float]  # image pixels at the given dpi: x0, y0, x1, y1
    size: float = 0.0  # median font size of its characters, in points
    mono: bool = False  # most of its characters are in a fixed-pitch font
    # runs of the line split where characters stand apart (a gap wider than the font's height):
    # a table row's cells, each with its box (image pixels)
    segments: list[tuple[str, tuple[float, float, float, float]]] = field(default_factory=list)


@dataclass
class PageTruth:
    body: list[TextLine] = field(default_factory=list)
    furniture: list[TextLine] = field(default_factory=list)

    def body_text(self) -> str:
        return " ".join(line.text for line in self.body)


# Fixed-pitch fonts by name: LaTeX's (CMTT, LMMono, txtt, ...) rarely set the descriptor's flag.
_MONO_NAME = re.compile(r"(^|[+_-])(cmtt|lmmono|lmtt|txtt|pcrr|courier|beramono|inconsolata)|mono|typewriter|consol",
                        re.IGNORECASE)


def _monospace(textpage, index: int, cache: dict[str, bool]) -> bool:
    flags = ctypes.c_int(0)
    length = pdfium_raw.FPDFText_GetFontInfo(textpage.raw, index, None, 0, ctypes.byref(flags))
    buffer = ctypes.create_string_buffer(max(1, length))
    pdfium_raw.FPDFText_GetFontInfo(textpage.raw, index, buffer, length, ctypes.byref(flags))
    name = buffer.value.decode("latin-1", "replace")
    if name not in cache:
        cache[name] = bool(flags.value & FIXED_PITCH) or _MONO_NAME.search(name) is not None
    return cache[name]


def _same_visual_line(boxes: list[tuple[float, float, float, float]], box: tuple[float, float, float, float]) -> bool:
    """Whether a character box (PDF points, y up) belongs to the line so far: it overlaps the line
    vertically by at least a third of the smaller height (a superscript stays on its line, the next
    line does not), or it is a low sliver at the line's foot that goes on rightwards (a typewriter
    underscore hangs under the baseline of a line without descenders: "let atom_A" is one line)."""
    bottom, top = min(b[1] for b in boxes), max(b[3] for b in boxes)
    overlap = min(top, box[3]) - max(bottom, box[1])
    if overlap >= min(top - bottom, box[3] - box[1]) / 3:
        return True
    line_height = top - bottom
    sliver = box[3] - box[1] <= 0.35 * line_height
    at_foot = bottom - 0.5 * line_height <= box[1] and box[3] <= bottom + 0.35 * line_height
    return sliver and at_foot and box[0] >= boxes[-1][0]


def text_layer_lines(page, dpi: float) -> list[TextLine]:
    """The page's text layer as lines (content order), boxes in image pixels at ``dpi``."""
    textpage = page.get_textpage()
    _, height = page.get_size()
    scale = dpi / 72
    lines: list[TextLine] = []
    chars: list[str] = []
    char_boxes: list[tuple[float, float, float, float] | None] = []  # one per char (None: spaces)
    boxes: list[tuple[float, float, float, float]] = []
    sizes: list[float] = []
    mono: list[bool] = []
    fonts: dict[str, bool] = {}

    def to_pixels(b: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
        return b[0] * scale, (height - b[3]) * scale, b[2] * scale, (height - b[1]) * scale

    def split_runs() -> list[tuple[str, tuple[float, float, float, float]]]:
        runs: list[tuple[list[str], list]] = []
        previous = None
        em = statistics.median(sizes) if sizes else 0.0  # the line's font size, points
        for char, box in zip(chars, char_boxes, strict=True):
            if box is None:  # a space: kept inside a run
                if runs:
                    runs[-1][0].append(char)
                continue
            gap_limit = max(CELL_GAP_EM * em, box[3] - box[1], 1.0)  # word spaces are ~0.25-0.5 em
            if previous is None or box[0] - previous[2] > gap_limit:
                runs.append(([], []))
            runs[-1][0].append(char)
            runs[-1][1].append(box)
            previous = box
        out = []
        for run_chars, run_boxes in runs:
            text = "".join(run_chars).replace("\ufffe", "").replace("\x02", "").strip()
            if text and run_boxes:
                out.append((text, to_pixels((min(b[0] for b in run_boxes), min(b[1] for b in run_boxes),
                                             max(b[2] for b in run_boxes), max(b[3] for b in run_boxes)))))
        return out

    def flush() -> None:
        text = "".join(chars).replace("\ufffe", "").replace("\x02", "").strip()
        if text and boxes:
            x0, y0 = min(b[0] for b in boxes), min(b[1] for b in boxes)
            x1, y1 = max(b[2] for b in boxes), max(b[3] for b in boxes)
            lines.append(TextLine(text, to_pixels((x0, y0, x1, y1)),
                                  statistics.median(sizes) if sizes else 0.0, sum(mono) > len(mono) / 2,
                                  split_runs()))
        chars.clear()
        char_boxes.clear()
        boxes.clear()
        sizes.clear()
        mono.clear()

    for i in range(textpage.count_chars()):
        char = textpage.get_text_range(i, 1)
        if char in ("\r", "\n"):
            if char == "\n" or not chars or chars[-1] not in ("\ufffe", "\x02"):
                flush()
            continue
        box = textpage.get_charbox(i) if not char.isspace() else None
        if box is not None and boxes and not _same_visual_line(boxes, box):
            flush()  # some producers write no line break between visual lines
        chars.append(char)
        char_boxes.append(box)
        if box is not None:
            boxes.append(box)
            sizes.append(float(pdfium_raw.FPDFText_GetFontSize(textpage.raw, i)))
            mono.append(_monospace(textpage, i, fonts))
    flush()
    return lines


def _masked(text: str) -> str:
    return re.sub(r"\d+", "#", " ".join(text.split()))


def _edge_lines(lines: list[TextLine], page_height: float) -> list[TextLine]:
    """Lines in the top or bottom :data:`FURNITURE_BAND` of the page."""
    band = FURNITURE_BAND * page_height
    return [line for line in lines if line.box[3] <= band or line.box[1] >= page_height - band]


def page_truth(pdf, index: int, dpi: float, lines: list[TextLine] | None = None,
               lines_of: Callable[[int], list[TextLine]] | None = None) -> PageTruth:
    """Body and furniture lines of one PDF page.

    Furniture is a line near the top or bottom edge whose text, digits masked, recurs near an
    edge of a neighbouring page (a running head: letters, not just a number), or the page's
    topmost or bottommost line when it is a bare page number or stands apart (gap over 1.5 line
    heights); everything else, in text-layer order, is body (footnotes included). ``lines_of``
    (page index -> lines) lets a caller reading many pages of one document extract each page once.
    """
    lines_of = lines_of or (lambda number: text_layer_lines(pdf[number], dpi))
    height = pdf[index].get_size()[1] * dpi / 72
    neighbours = set()
    for other in (index - 2, index - 1, index + 1, index + 2):
        if 0 <= other < len(pdf):
            neighbours |= {_masked(line.text) for line in _edge_lines(lines_of(other), height)}
    lines = lines_of(index) if lines is None else lines
    edge = {id(line) for line in _edge_lines(lines, height)}
    by_top = sorted(lines, key=lambda line: line.box[1])
    extremes = {}
    if len(by_top) >= 2:
        top, second = by_top[0], by_top[1]
        extremes[id(top)] = second.box[1] - top.box[3]
        by_bottom = sorted(lines, key=lambda line: -line.box[3])
        bottom, second = by_bottom[0], by_bottom[1]
        extremes[id(bottom)] = bottom.box[1] - second.box[3]
    truth = PageTruth()
    for line in lines:
        line_height = line.box[3] - line.box[1]
        folio = re.fullmatch(r"[0-9]+|[ivxlc]+", line.text.strip(), re.IGNORECASE) is not None
        apart = id(line) in extremes and (folio or extremes[id(line)] > 1.5 * line_height)
        running = re.search(r"[^\W\d]{2}", line.text) is not None and _masked(line.text) in neighbours
        furniture = id(line) in edge and (apart or running)
        (truth.furniture if furniture else truth.body).append(line)
    return truth
