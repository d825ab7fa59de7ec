"""Pick and build a pre-annotation backend from config."""

from __future__ import annotations

from dataclasses import fields

from components.curation.preannotate.base import PreAnnotator
from components.curation.preannotate.model import (
    ModelAnnotator,
    ModelAnnotatorConfig,
    PaddleOCRVLTransformersConfig,
)
from components.curation.preannotate.paddle_pipeline import (
    PaddleOCRVLPipelineAnnotator,
    PaddleOCRVLPipelineConfig,
)
from components.curation.preannotate.paddle_server import PaddleOCRVLServerAnnotator, PaddleOCRVLServerConfig
from components.curation.preannotate.pdf_text import AutoAnnotator, PdfTextAnnotator, PdfTextConfig
from components.curation.preannotate.rapidocr import RapidOCRAnnotator, RapidOCRConfig

# ---------------------------------------------------------------------------------------------
# factory

BACKENDS: dict[str, tuple[type, type]] = {
    "rapidocr": (RapidOCRAnnotator, RapidOCRConfig),
    "pdf-text": (PdfTextAnnotator, PdfTextConfig),
    "auto": (AutoAnnotator, PdfTextConfig),
    "model": (ModelAnnotator, ModelAnnotatorConfig),
    "paddleocr_vl_transformers": (ModelAnnotator, PaddleOCRVLTransformersConfig),
    "paddleocr_vl_server": (PaddleOCRVLServerAnnotator, PaddleOCRVLServerConfig),
    "paddleocr_vl_pipeline": (PaddleOCRVLPipelineAnnotator, PaddleOCRVLPipelineConfig),
}
DEFAULT_BACKEND = "rapidocr"


def make_preannotator(config: dict | None = None) -> PreAnnotator:
    """Build a backend from config, e.g. ``{"backend": "paddleocr_vl_server", "url": "http://127.0.0.1:8118"}``.

    Unknown backends and unknown keys are rejected with the accepted ones listed.
    """
    config = dict(config or {})
    backend = config.pop("backend", DEFAULT_BACKEND)
    if backend not in BACKENDS:
        raise ValueError(f"unknown pre-annotation backend {backend!r}; choose one of {sorted(BACKENDS)}")
    annotator_cls, config_cls = BACKENDS[backend]
    accepted = [f.name for f in fields(config_cls)]
    unknown = sorted(set(config) - set(accepted))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for pre-annotation backend {backend!r}; accepted: {accepted}")
    settings = config_cls(**config)
    if annotator_cls is ModelAnnotator:  # the engine-backed backends
        return ModelAnnotator.from_config(settings)
    if annotator_cls is AutoAnnotator:  # the text layer, else this OCR backend
        fallback = dict(settings.fallback or {"backend": DEFAULT_BACKEND})
        if fallback.get("backend") in ("auto", "pdf-text"):
            raise ValueError("the auto backend's fallback must read pixels (rapidocr, model, ...), not the text layer")
        return AutoAnnotator(settings, make_preannotator(fallback))
    return annotator_cls(settings)
