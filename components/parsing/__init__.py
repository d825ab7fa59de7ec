"""Two-stage document parsing (MinerU2.5, PaddleOCR-VL): layout first, then each element's
native-resolution crop recognised with its task prompt, all elements of a page as one batch.

One concept per module: ``layout`` (pluggable backends), ``crops``, ``prompts`` (per family),
``reading_order`` (shared with pre-annotation), ``assembly`` (element outputs -> page markup)
and ``parse`` (the whole step). The ``PARSE_MODES`` are how every consumer of a model (evaluation,
benchmarks, pre-annotation, Triton) chooses between whole pages and elements.
"""

from components.parsing.crops import CropSettings
from components.parsing.layout import LAYOUTS, Layout, LayoutRegion, make_layout
from components.parsing.parse import (
    PARSE_MODES,
    PageParse,
    ParsedElement,
    ParseSettings,
    parse,
    parse_pages,
    parse_result,
    read_pages,
    resolve_parse,
    trained_parse_mode,
)

__all__ = ["LAYOUTS", "PARSE_MODES", "CropSettings", "Layout", "LayoutRegion", "PageParse", "ParseSettings",
           "ParsedElement", "make_layout", "parse", "parse_pages", "parse_result", "read_pages",
           "resolve_parse", "trained_parse_mode"]
