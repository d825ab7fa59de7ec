"""Pre-annotation with a checkpoint through the shared decoding engine (no server, no paddlepaddle).

Two backends share this code path: ``model`` (any supported folder: our DocVLM, a trained stage,
a Hugging Face doc VLM) and ``paddleocr_vl_transformers`` (a PaddleOCR-VL folder, loaded natively by
transformers). ``parse`` says how pages are read: ``page`` (one decode per page), ``elements``
(layout, then every element's crop with its task prompt, as PaddleOCR-VL and MinerU2.5 were
trained: the default for PaddleOCR-VL) or ``auto`` (as the folder was trained). In element mode the
pre-annotation carries the element boxes, so annotators get them pre-drawn. ``model_version`` is
the family and a content hash of the weights, recorded on every pre-annotation.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from components.curation.preannotate.base import PreAnnotation, strip_image_tokens
from components.data.markup import ALL_CATEGORIES
from components.data.pages import LayoutElement
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.parsing import ParseSettings, make_layout, read_pages, resolve_parse
from components.parsing.assembly import element_content
from models.loading import model_family, model_fingerprint


@dataclass
class ModelAnnotatorConfig:
    model_dir: str | None = None
    decoder: str = "ar"
    max_new_tokens: int = 1024
    device: str = "cpu"
    model_version: str | None = None
    prompt: str | None = None  # a chat model's page instruction (None: the adapter's default)
    parse: str = "auto"  # page | elements | auto (as the folder was trained)
    layout: str = "rapid-layout"  # element mode's layout (components.parsing.layout)


@dataclass
class PaddleOCRVLTransformersConfig(ModelAnnotatorConfig):
    prompt: str | None = "OCR:"  # page mode's prompt: PaddleOCR-VL's text-recognition task prompt
    parse: str = "elements"  # what the model was trained for: element crops with their task prompts
    family: str = "paddleocr_vl"  # the folder must be of this family


class ModelAnnotator:
    """Greedy decode with one of our checkpoints; confidence = mean token probability."""

    name = "model"

    def __init__(self, engine, *, model_version: str = "model", decoder: str = "ar", max_new_tokens: int = 1024,
                 parsing: ParseSettings | None = None):
        self.engine = engine  # a DecodingEngine (or anything with its generate())
        self._model_version = model_version
        self.params = DecodeParams(decoder=decoder, max_new_tokens=max_new_tokens)
        self.parsing = parsing or ParseSettings()
        self._layout = make_layout(self.parsing.layout) if self.parsing.elements else None

    @classmethod
    def from_config(cls, settings: ModelAnnotatorConfig) -> ModelAnnotator:
        """Load ``settings.model_dir`` (checking its family when the backend names one) into the engine."""

        if not settings.model_dir:
            raise ValueError("this pre-annotation backend needs `model_dir` (a model folder with config.json)")
        family = model_family(settings.model_dir)
        wanted = getattr(settings, "family", None)
        if wanted and family != wanted:
            raise ValueError(f"{settings.model_dir} holds a {family!r} model; this backend needs a {wanted!r} folder")
        engine = DecodingEngine.from_pretrained(settings.model_dir, device=settings.device, prompt=settings.prompt)
        # a content hash, not the folder name: every trained folder is called "model"
        version = settings.model_version or f"{family}:{model_fingerprint(settings.model_dir)}"
        parsing = ParseSettings(resolve_parse(settings.parse, settings.model_dir), settings.layout)
        return cls(engine, model_version=version, decoder=settings.decoder, max_new_tokens=settings.max_new_tokens,
                   parsing=parsing)

    @property
    def model_version(self) -> str:
        return self._model_version

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        [result] = read_pages(self.engine, [image], self.params, self.parsing, layout=self._layout)
        stats = result.stats
        extra = {"new_tokens": stats.new_tokens, "forward_passes": stats.forward_passes, "seconds": round(stats.seconds, 4),
                 "truncated": result.truncated, "decoder": self.params.decoder, "confidence_source": "token_probability",
                 "parse": self.parsing.mode}
        elements = []
        if result.parse is not None:
            elements = [LayoutElement(_our_category(e.category), e.box, element_content(e.markup)) for e in result.parse.elements]
            failed = [e.error for e in result.parse.elements if e.error]
            extra |= {"layout": self.parsing.layout, "reason": result.parse.reason, "failed_elements": len(failed)}
            if result.parse.empty_page_reason:
                extra["empty_page_reason"] = result.parse.empty_page_reason
        confidence = result.parse.confidence if result.parse is not None else stats.mean_confidence
        return PreAnnotation(strip_image_tokens(result.text), confidence, self.model_version, elements, extra)


def _our_category(category: str) -> str:
    """A layout category in our vocabulary (a detector's caption or chart is text)."""
    return category if category in ALL_CATEGORIES else "text"
