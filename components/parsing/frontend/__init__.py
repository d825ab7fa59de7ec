"""The one page front end for real documents, shared by pre-annotation, the reader, evaluation
and Triton: layout regions (rapid-layout), text lines (PP-OCR's detector, anywhere on the page)
read by a pluggable line source (PP-OCR's recogniser, or a model of ours through the decoding
engine), blocks (title, text, list, code, table with SLANet's structure, formula, furniture,
figure), reading order (columns). One concept per module."""

from components.parsing.frontend.blocks import Block, Blocks, FrontEndConfig
from components.parsing.frontend.detector import TextLineDetector
from components.parsing.frontend.formulas import unicode_math_to_latex
from components.parsing.frontend.lines import LineBox, merge_lines
from components.parsing.frontend.page import FrontEndPage, PageFrontEnd, shared_front_end
from components.parsing.frontend.sources import LineSource, ModelLines, RecogniserLines

__all__ = ["Block", "Blocks", "FrontEndConfig", "FrontEndPage", "LineBox", "LineSource", "ModelLines",
           "PageFrontEnd", "RecogniserLines", "TextLineDetector", "merge_lines", "shared_front_end", "unicode_math_to_latex"]
