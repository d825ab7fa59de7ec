"""Pre-annotation with one of our own checkpoints through the shared decoding engine."""

from __future__ import annotations

import os
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


class ModelAnnotator:
    """Greedy decode with one of our checkpoints; confidence = mean token probability."""

    name = "model"

    def __init__(self, engine, *, model_version: str = "model", decoder: str = "ar", max_new_tokens: int = 1024):
        from components.decoding.types import DecodeParams

        self.engine = engine  # a DecodingEngine (or anything with its generate())
        self._model_version = model_version
        self.params = DecodeParams(decoder=decoder, max_new_tokens=max_new_tokens)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, *, device: str = "cpu", model_version: str | None = None,
                        decoder: str = "ar", max_new_tokens: int = 1024) -> ModelAnnotator:
        from components.decoding.engine import DecodingEngine
        from models.loading import model_fingerprint

        engine = DecodingEngine.from_pretrained(model_dir, device=device)
        # a content hash, not the folder name: every trained folder is called "model"
        return cls(engine, model_version=model_version or f"model:{model_fingerprint(model_dir)}",
                   decoder=decoder, max_new_tokens=max_new_tokens)

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
