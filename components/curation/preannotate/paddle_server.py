"""PaddleOCR-VL behind any OpenAI-compatible server (vLLM, SGLang, ``paddleocr genai_server``, ours)."""

from __future__ import annotations

import base64
import io
import math
import os
import time
from dataclasses import dataclass

import requests
from PIL import Image

from components.curation.preannotate.base import (
    AnnotatorUnavailableError,
    PageAnnotationError,
    PreAnnotation,
    strip_image_tokens,
)
from components.data.pages import validate_image


@dataclass
class PaddleOCRVLServerConfig:
    url: str | None = None  # server root, e.g. http://127.0.0.1:8118 (a trailing /v1 is fine too)
    model: str | None = None  # served model name; None = the first one /v1/models lists
    prompt: str = "OCR:"  # PaddleOCR-VL's task prompt for text recognition
    max_tokens: int = 4096
    timeout_s: float = 120.0
    retries: int = 2  # extra attempts on connection errors, timeouts and 5xx
    backoff_s: float = 1.0
    api_key_env: str | None = None  # name of an environment variable holding a bearer token
    model_version: str | None = None


def image_data_uri(image: Image.Image) -> str:
    """The page as a base64 PNG data URI, the OpenAI chat format's way to inline an image."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class PaddleOCRVLServerAnnotator:
    """One chat completion per page against an OpenAI-compatible server (vLLM, SGLang, ours)."""

    name = "paddleocr_vl_server"
    START_HINT = (
        "start one, e.g. `paddleocr genai_server --model_name PaddleOCR-VL-0.9B --backend vllm --port 8118`, "
        "`vllm serve PaddlePaddle/PaddleOCR-VL --trust-remote-code --port 8118`, or our own model with "
        "`python -m components.curation.openai_server --model MODEL_DIR --port 8118`; then set the `url` key "
        "of the pre-annotation config"
    )

    def __init__(self, config: PaddleOCRVLServerConfig):
        if not config.url:
            raise ValueError(f"the paddleocr_vl_server backend needs `url` (the OpenAI-compatible server); {self.START_HINT}")
        self.config = config
        root = config.url.rstrip("/")
        self.base_url = root if root.endswith("/v1") else f"{root}/v1"
        self._model = config.model
        self._session = requests.Session()

    @property
    def model_version(self) -> str:
        return self.config.model_version or f"openai:{self.served_model}"

    @property
    def served_model(self) -> str:
        if self._model is None:
            listing = self._request("GET", "/models").json()
            names = [entry.get("id") for entry in listing.get("data", []) if entry.get("id")]
            if not names:
                raise AnnotatorUnavailableError(f"{self.base_url}/models lists no model; set `model` in the config")
            self._model = names[0]
        return self._model

    def _headers(self) -> dict[str, str]:
        if self.config.api_key_env:
            token = os.environ.get(self.config.api_key_env)
            if not token:
                raise AnnotatorUnavailableError(f"environment variable {self.config.api_key_env} (api_key_env) is not set")
            return {"Authorization": f"Bearer {token}"}
        return {}

    def _request(self, method: str, path: str, payload: dict | None = None) -> requests.Response:
        url = f"{self.base_url}{path}"
        attempts = self.config.retries + 1
        last_problem = ""
        for attempt in range(attempts):
            try:
                response = self._session.request(method, url, json=payload, headers=self._headers(), timeout=self.config.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as exc:
                last_problem = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 500:
                    return self._check(response, url)
                last_problem = f"HTTP {response.status_code}: {response.text[:300]}"
            if attempt + 1 < attempts:
                time.sleep(self.config.backoff_s * 2**attempt)
        raise AnnotatorUnavailableError(
            f"PaddleOCR-VL server at {url} did not answer after {attempts} attempt(s) ({last_problem}). "
            f"Is it running? {self.START_HINT}"
        )

    @staticmethod
    def _check(response: requests.Response, url: str) -> requests.Response:
        if response.status_code < 400:
            return response
        detail = response.text[:500]
        if response.status_code in (400, 413, 422):
            raise PageAnnotationError(f"{url} refused this page: HTTP {response.status_code}: {detail}")
        raise AnnotatorUnavailableError(f"{url} answered HTTP {response.status_code}: {detail} (check url, model and api key)")

    def annotate(self, image: Image.Image, page_id: str) -> PreAnnotation:
        validate_image(image)
        payload = {
            "model": self.served_model,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_data_uri(image)}},
                {"type": "text", "text": self.config.prompt},
            ]}],
            "max_tokens": self.config.max_tokens,
            "temperature": 0.0,
            "logprobs": True,
        }
        started = time.perf_counter()
        body = self._request("POST", "/chat/completions", payload).json()
        try:
            choice = body["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            raise AnnotatorUnavailableError(f"{self.base_url}/chat/completions returned no choice: {str(body)[:300]}") from exc
        if isinstance(content, list):  # some servers return content parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        token_logprobs = [t["logprob"] for t in ((choice.get("logprobs") or {}).get("content") or []) if "logprob" in t]
        if token_logprobs:
            confidence, source = sum(math.exp(lp) for lp in token_logprobs) / len(token_logprobs), "token_probability"
        else:
            # No logprobs from this server: send the page to review first rather than guess.
            confidence, source = 0.0, "none"
        return PreAnnotation(
            strip_image_tokens(content or ""), confidence, self.model_version, [],
            {"completion_tokens": (body.get("usage") or {}).get("completion_tokens"),
             "finish_reason": choice.get("finish_reason"), "seconds": round(time.perf_counter() - started, 4),
             "confidence_source": source},
        )
