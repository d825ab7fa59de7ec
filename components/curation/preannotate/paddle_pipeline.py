"""The official ``paddleocr`` PaddleOCR-VL pipeline, when that optional package is installed."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from components.curation.preannotate.base import (
    BackendNotInstalledError,
    PageAnnotationError,
    PreAnnotation,
    strip_image_tokens,
)
from components.data.pages import LayoutElement, validate_image


@dataclass
class PaddleOCRVLPipelineConfig:
    server_url: str | None = None  # an OpenAI-compatible PaddleOCR-VL server; None = run the VLM in-process
    vl_rec_backend: str | None = None  # default: "vllm-server" with server_url, else "native"
    use_layout_detection: bool = False  # the layout model is downloaded on first use (fails offline)
    pipeline_kwargs: dict = field(default_factory=dict)  # passed to PaddleOCRVL(...) as is
    model_version: str | None = None


_PADDLE_CATEGORY = {"doc_title": "title", "paragraph_title": "title", "title": "title", "table": "table",
                    "display_formula": "formula", "formula": "formula", "header": "header", "footer": "footer",
                    "number": "footer"}
_PADDLE_PICTURES = {"image", "figure", "chart", "seal", "header_image", "footer_image"}


def paddle_result_to_annotation(result_json: dict, markdown: str, model_version: str, width: int, height: int) -> PreAnnotation:
    """Convert one PaddleOCRVL page result (``res.json["res"]``, ``res.markdown["markdown_texts"]``)."""
    elements, scores = [], []
    for block in result_json.get("parsing_res_list") or []:
        label = str(block.get("block_label", "text")).lower()
        if label in _PADDLE_PICTURES:
            continue
        bbox = block.get("block_bbox") or [0, 0, width, height]
        if isinstance(bbox, str):
            bbox = [float(v) for v in bbox.strip("[]").split(",")]
        content = strip_image_tokens(str(block.get("block_content", "")))
        elements.append(LayoutElement(_PADDLE_CATEGORY.get(label, "text"), tuple(bbox[:4]), content))
    for box in (result_json.get("layout_det_res") or {}).get("boxes") or []:
        if isinstance(box, dict) and "score" in box:
            scores.append(float(box["score"]))
    confidence, source = (sum(scores) / len(scores), "layout_score") if scores else (0.0, "none")
    return PreAnnotation(strip_image_tokens(markdown), confidence, model_version, elements, {"confidence_source": source})


class PaddleOCRVLPipelineAnnotator:
    """The official ``paddleocr.PaddleOCRVL`` pipeline (install the ``paddle`` extra separately)."""

    name = "paddleocr_vl_pipeline"
    INSTALL_HINT = (
        "the paddleocr_vl_pipeline backend needs the official PaddleOCR package, which is not installed here. "
        "Install it in its own environment (paddlex pins its own OpenCV, which clashes with the main one): "
        "`python -m venv .venv-paddle && .venv-paddle/bin/pip install paddlepaddle 'paddleocr[doc-parser]'` "
        "(or `pip install -e '.[paddle]'`), or use the `paddleocr_vl_server` backend against a running "
        "PaddleOCR-VL OpenAI-compatible server instead"
    )

    def __init__(self, config: PaddleOCRVLPipelineConfig | None = None):
        self.config = config or PaddleOCRVLPipelineConfig()
        self._pipeline = None

    @property
    def model_version(self) -> str:
        return self.config.model_version or "paddleocr-vl-pipeline"

    def _load(self):
        if self._pipeline is None:
            try:
                from paddleocr import PaddleOCRVL  # deferred: optional extra (pip install .[paddle])
            except ImportError as exc:
                raise BackendNotInstalledError(f"{self.INSTALL_HINT} (import error: {exc})") from exc
            cfg = self.config
            kwargs = {"use_layout_detection": cfg.use_layout_detection, **cfg.pipeline_kwargs}
            if cfg.server_url:
                kwargs.setdefault("vl_rec_backend", cfg.vl_rec_backend or "vllm-server")
                kwargs.setdefault("vl_rec_server_url", cfg.server_url)
            elif cfg.vl_rec_backend:
                kwargs.setdefault("vl_rec_backend", cfg.vl_rec_backend)
            self._pipeline = PaddleOCRVL(**kwargs)
        return self._pipeline

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        validate_image(image)
        pipeline = self._load()
        bgr = np.ascontiguousarray(np.asarray(image.convert("RGB"))[:, :, ::-1])  # PaddleX reads arrays as BGR
        results = list(pipeline.predict(bgr))
        if not results:
            raise PageAnnotationError(f"PaddleOCRVL returned no result for page {page_id}")
        markups, elements, confidences, sources = [], [], [], []
        for res in results:
            annotation = paddle_result_to_annotation(res.json.get("res", {}), res.markdown.get("markdown_texts", ""),
                                                     self.model_version, image.width, image.height)
            markups.append(annotation.markup)
            elements.extend(annotation.elements)
            confidences.append(annotation.confidence)
            sources.append(annotation.extra["confidence_source"])
        return PreAnnotation("\n\n".join(m for m in markups if m), min(confidences), self.model_version, elements,
                             {"confidence_source": sources[0]})
