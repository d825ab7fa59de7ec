"""Pre-annotation with a checkpoint through the shared decoding engine (no server, no paddlepaddle).

Two backends share this code path: ``model`` (any supported folder: our DocVLM, a trained stage,
a Hugging Face doc VLM) and ``paddleocr_vl_transformers`` (a PaddleOCR-VL folder, loaded natively by
transformers, prompted with its ``OCR:`` task prompt). ``model_version`` is the family and a content
hash of the weights, recorded on every pre-annotation.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from components.curation.preannotate.base import PreAnnotation, strip_image_tokens


@dataclass
class ModelAnnotatorConfig:
    model_dir: str | None = None
    decoder: str = "ar"
    max_new_tokens: int = 1024
    device: str = "cpu"
    model_version: str | None = None
    prompt: str | None = None  # a chat model's page instruction (None: the adapter's default)


@dataclass
class PaddleOCRVLTransformersConfig(ModelAnnotatorConfig):
    prompt: str | None = "OCR:"  # PaddleOCR-VL's text-recognition task prompt
    family: str = "paddleocr_vl"  # the folder must be of this family


class ModelAnnotator:
    """Greedy decode with one of our checkpoints; confidence = mean token probability."""

    name = "model"

    def __init__(self, engine, *, model_version: str = "model", decoder: str = "ar", max_new_tokens: int = 1024):
        from components.decoding.types import DecodeParams

        self.engine = engine  # a DecodingEngine (or anything with its generate())
        self._model_version = model_version
        self.params = DecodeParams(decoder=decoder, max_new_tokens=max_new_tokens)

    @classmethod
    def from_config(cls, settings: ModelAnnotatorConfig) -> ModelAnnotator:
        """Load ``settings.model_dir`` (checking its family when the backend names one) into the engine."""
        from components.decoding.engine import DecodingEngine
        from models.loading import model_family, model_fingerprint

        if not settings.model_dir:
            raise ValueError("this pre-annotation backend needs `model_dir` (a model folder with config.json)")
        family = model_family(settings.model_dir)
        wanted = getattr(settings, "family", None)
        if wanted and family != wanted:
            raise ValueError(f"{settings.model_dir} holds a {family!r} model; this backend needs a {wanted!r} folder")
        engine = DecodingEngine.from_pretrained(settings.model_dir, device=settings.device, prompt=settings.prompt)
        # a content hash, not the folder name: every trained folder is called "model"
        version = settings.model_version or f"{family}:{model_fingerprint(settings.model_dir)}"
        return cls(engine, model_version=version, decoder=settings.decoder, max_new_tokens=settings.max_new_tokens)

    @property
    def model_version(self) -> str:
        return self._model_version

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        [result] = self.engine.generate([image], self.params)
        stats = result.stats
        return PreAnnotation(
            strip_image_tokens(result.text), stats.mean_confidence, self.model_version, [],
            {"new_tokens": stats.new_tokens, "forward_passes": stats.forward_passes, "seconds": round(stats.seconds, 4),
             "truncated": result.truncated, "decoder": self.params.decoder, "confidence_source": "token_probability"},
        )
