"""Split a predicted page's Markdown into scored elements, as OmniDocBench v1.5 reads model output.

This follows ``md_tex_filter`` (official ``utils/extract.py``) step by step, because which
string becomes a table, a formula or a text block decides every score after it:

1. images ``![..](..)`` and ```` ```markdown/html/latex ```` fences are removed, runs of more than
   four ``_`` or spaces shortened to four, ``<html>``/``<body>`` tags dropped;
2. LaTeX tables (``\\begin{table}…``, then nested ``tabular``) and HTML tables (nested
   ``<table>`` counted) are cut out — each cut is blanked with spaces so offsets stay valid;
3. formulas: ``$$…$$`` and ``\\[…\\]`` are display formulas (cut out); ``$…$`` and ``\\(…\\)``
   are also taken as formulas (``equation_inline``) but stay in the text;
4. if at least two ``|…|`` lines remain, Markdown pipe tables are converted to HTML tables
   with the official converter (every pipe line is its own one-row table; consecutive ones are
   merged; lines holding ``:`` or ``---`` are dropped) and cut out;
5. ```` ```lang …``` ```` code blocks become text, ``\\title{}``/``\\text{}``/``\\section{}`` are
   unwrapped, and the rest is split on blank lines (on single newlines if there is no blank
   line) into text blocks; a block that is a whole ``<table>`` is a table, one wrapped in ``$``
   a formula.

Positions order the elements. As in the official code, a text block's position is the sum of
the lengths of the blocks before it (separators not counted), while tables and formulas carry
their true offsets; this ordering feeds the matching, so it is reproduced as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TEXT = "text_all"
DISPLAY_FORMULA = "equation_isolated"
INLINE_FORMULA = "equation_inline"
HTML_TABLE = "html_table"
LATEX_TABLE = "latex_table"
TABLE_KINDS = (HTML_TABLE, LATEX_TABLE)


@dataclass(frozen=True)
class PredictedElement:
    """One element of a predicted page: its kind, finer kind, offset in the page and content."""

    category: str
    content: str
    position: int
    fine_category: str = ""

    @property
    def kind(self) -> str:
        """The finer kind when there is one (``equation_inline``, ``code``, ...), else the category."""
        return self.fine_category or self.category


_IMAGE_RE = re.compile(r"!\[.*?\]\(.*?\)")
_FENCE_RES = (
    re.compile(r"^```markdown\n?", re.MULTILINE),
    re.compile(r"^```html\n?", re.MULTILINE),
    re.compile(r"^```latex\n?", re.MULTILINE),
    re.compile(r"```\n?$", re.MULTILINE),
)
_FORMULA_RE = re.compile(r"\$\$(.*?)\$\$|\\\[(.*?)\\\]|\$(.*?)\$|\\\((.*?)\\\)", re.DOTALL)
_DOLLAR_OR_PAREN_RE = re.compile(r"\$\$(.*?)\$\$|\$(.*?)\$|\\\((.*?)\\\)", re.DOTALL)
_PIPE_LINE_RE = re.compile(r"\|\s*.*?\s*\|\n", re.DOTALL)
_HTML_TABLE_RE = re.compile(r"(<table.*?</table>)", re.DOTALL)
_CODE_BLOCK_RE = re.compile(r"```(\w+)\n(.*?)```", re.DOTALL)
_LATEX_TABLE_ENV_RE = re.compile(r"\\begin{table}(.*?)\\end{table}", re.DOTALL)
_LATEX_STYLE_RES = (
    (re.compile(r"\\title\{(.*?)\}"), r"\1"),
    (re.compile(r"\\title\s*\{\s*(.*?)\s*\}", re.DOTALL), r"\1"),
    (re.compile(r"\\text\s*\{\s*(.*?)\s*\}", re.DOTALL), r"\1"),
    (re.compile(r"\\section\*?\{(.*?)\}"), r"\1"),
    (re.compile(r"\\section\*?\{\s*(.*?)\s*\}", re.DOTALL), r"\1"),
)


def _blank(content: str, start: int, end: int) -> str:
    return content[:start] + " " * (end - start) + content[end:]


def _nested_spans(text: str, begin: str, end: str) -> list[tuple[int, int]]:
    """Outermost ``begin…end`` spans, counting nesting; an unclosed begin restarts the scan after it.

    The scan advances by ``len(end)`` past a begin, as the official scanner does.
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    open_starts: list[int] = []
    begin_re, end_re = re.compile(begin), re.compile(end)
    while cursor < len(text):
        begin_match = begin_re.search(text, cursor)
        end_match = end_re.search(text, cursor)
        if not begin_match and not end_match:
            break
        if begin_match and (not end_match or begin_match.start() < end_match.start()):
            open_starts.append(begin_match.start())
            cursor = begin_match.start() + len(end)
        else:
            assert end_match is not None
            if open_starts:
                start = open_starts.pop()
                if not open_starts:
                    spans.append((start, end_match.start() + len(end)))
            cursor = end_match.start() + len(end)
    if open_starts:
        restart = open_starts[0] + len(begin)
        spans.extend((start + restart, stop + restart) for start, stop in _nested_spans(text[restart:], begin, end))
    return spans


def _latex_table_spans(content: str) -> list[tuple[int, int]]:
    spans = [(m.start(), m.end()) for m in _LATEX_TABLE_ENV_RE.finditer(content)]
    for start, end in spans:
        content = _blank(content, start, end)
    spans += _nested_spans(content, r"\\begin{tabular}", r"\\end{tabular}")
    return sorted(spans, key=lambda span: span[0])


def _pipe_row_to_html(row_block: str) -> str:
    """One pipe-table match as the official converter renders it: first line header, lines 3+ body."""
    rows = [row.strip() for row in row_block.strip().split("\n")]
    parts = ["<table>\n  <thead>\n    <tr>\n"]
    parts += [f"      <th>{cell.strip()}</th>\n" for cell in rows[0].split("|")[1:-1]]
    parts.append("    </tr>\n  </thead>\n  <tbody>\n")
    for row in rows[2:]:
        parts.append("    <tr>\n")
        parts += [f"      <td>{cell.strip()}</td>\n" for cell in row.split("|")[1:-1]]
        parts.append("    </tr>\n")
    parts.append("  </tbody>\n</table>\n")
    return "".join(parts)


_ALIGNMENT_ROW_RE = re.compile(r"-*?:|---|:-*?")
_TABLE_SKELETON_RE = re.compile(r"</?t(able|head|body)>")


def _merge_html_rows(block: str) -> str:
    """All ``<table>`` blocks of a run merged into one table without thead/tbody lines."""
    block = re.sub(r"<!--[\s\S]*?-->", "", block)
    rows: list[str] = []
    for table in re.findall(r"<table>[\s\S]*?</table>", block):
        lines = [line.replace("<th>", "<td>").replace("</th>", "</td>") if "<th>" in line else line
                 for line in table.split("\n")]
        kept = [line for line in lines if not _TABLE_SKELETON_RE.search(line)]
        if len(kept) > 2:
            rows.extend(kept)
    return "\n\n<table>\n{}\n</table>\n\n".format("\n".join(rows))


def _merge_table_runs(text: str) -> str:
    """The official line scanner that gathers runs of converted rows and merges each run.

    It works one line behind: the line before a ``<table>`` joins the run (and is lost unless it
    is table markup), and lines with ``:`` or ``---`` inside a run are dropped.
    """
    output: list[str] = []
    in_table, run, previous = False, "", ""
    for line in text.split("\n"):
        if "<table>" in line:
            in_table = True
            run += previous
        elif in_table:
            if not _ALIGNMENT_ROW_RE.search(previous) and "</thead>" not in previous:
                run += "\n" + previous
            if "</table>" in previous and "<table>" not in line:
                in_table = False
                output.append(_merge_html_rows(run))
                run = ""
        else:
            output.append(previous)
        previous = line
    if previous:
        if in_table or "</table>" in previous:
            output.append(_merge_html_rows(run + "\n" + previous))
        else:
            output.append(previous)
    return "\n".join(output)


def pipe_tables_to_html(content: str) -> str:
    """Convert Markdown pipe tables in a page to HTML tables the way OmniDocBench does."""
    content = content.replace("\r", "") + "\n"
    for row_block in _PIPE_LINE_RE.findall(content):
        content = content.replace(row_block, _pipe_row_to_html(row_block), 1)
    merged = _merge_table_runs(content)
    return merged.replace("<table>", '<table border="1" >').replace("<td>", '<td colspan="1" rowspan="1">')


def _cut(content: str, spans: list[tuple[int, int]], category: str, elements: list[PredictedElement]) -> str:
    for start, end in spans:
        elements.append(PredictedElement(category, content[start:end], start))
        content = _blank(content, start, end)
    return content


def extract_elements(markdown: str) -> list[PredictedElement]:
    """Elements of a predicted page in the order the official evaluation sorts them (by position)."""
    content = _IMAGE_RE.sub("", markdown)
    for fence in _FENCE_RES:
        content = fence.sub("", content)
    content = re.sub(r"_{4,}", "____", content)
    content = re.sub(r" {4,}", "    ", content)
    for tag in ("<html>", "</html>", "<body>", "</body>"):
        content = content.replace(tag, "")

    elements: list[PredictedElement] = []
    content = _cut(content, _latex_table_spans(content), LATEX_TABLE, elements)
    content = _cut(content, _nested_spans(content, r"<table(?:[^>]*)>", r"</table>"), HTML_TABLE, elements)

    for match in _FORMULA_RE.finditer(content):
        one_line = " ".join(match.group(0).strip().split("\n"))
        delimited = _DOLLAR_OR_PAREN_RE.search(one_line)
        if delimited is None:  # \[ … \]
            elements.append(PredictedElement(DISPLAY_FORMULA, one_line, match.start()))
            content = _blank(content, match.start(), match.end())
        elif delimited.group(1):  # $$ … $$
            elements.append(PredictedElement(DISPLAY_FORMULA, _DOLLAR_OR_PAREN_RE.sub(r"\\[\1\\]", one_line),
                                             match.start()))
            content = _blank(content, match.start(), match.end())
        else:  # $ … $ or \( … \): a formula element, and the text keeps it too
            elements.append(PredictedElement(DISPLAY_FORMULA, _DOLLAR_OR_PAREN_RE.sub(r"\\[\2\3\\]", one_line),
                                             match.start(), INLINE_FORMULA))

    if len(_PIPE_LINE_RE.findall(content + "\n")) >= 2:
        content = pipe_tables_to_html(content)
        for match in _HTML_TABLE_RE.finditer(content):
            elements.append(PredictedElement(HTML_TABLE, match.group(0).strip(), match.start(), "md2html_table"))
            content = _blank(content, match.start(), match.end())

    for match in _CODE_BLOCK_RE.finditer(content):
        elements.append(PredictedElement(TEXT, match.group(2).strip(), match.start(), "code"))
        content = _blank(content, match.start(), match.end())

    for pattern, replacement in _LATEX_STYLE_RES:
        content = pattern.sub(replacement, content)

    chunks = content.split("\n\n")
    if len(chunks) == 1:
        chunks = content.split("\n")
    position = 0
    for chunk in chunks:
        chunk_position = position
        position += len(chunk)  # separators are not counted, as in the official code
        text = "\n".join(line.strip() for line in chunk.strip().strip("\n").split("\n") if line.strip())
        if not text:
            continue
        if text.startswith("<table") and text.endswith("</table>"):
            elements.append(PredictedElement(HTML_TABLE, text, chunk_position))
        elif text.startswith("$") and text.endswith("$"):
            if text.replace("$", "").strip():
                elements.append(PredictedElement(DISPLAY_FORMULA, text.strip(), chunk_position))
        else:
            elements.append(PredictedElement(TEXT, text.strip(), chunk_position, "text_block"))
    return sorted(elements, key=lambda element: element.position)
