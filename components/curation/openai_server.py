"""Serve one of our page-to-markup checkpoints behind an OpenAI-compatible HTTP API, like vLLM.

Clients that speak the OpenAI chat format to a vision model (the PaddleOCR-VL pre-annotation
backend, ``paddleocr``'s ``vllm-server`` client, the ``openai`` SDK) can then use our model:

- ``GET /v1/models``, ``GET /health``;
- ``POST /v1/chat/completions``: the page comes as an ``image_url`` content part holding a
  ``data:image/...;base64,`` URI (remote URLs are refused: this server does not fetch); the text
  prompt (``OCR:``) is accepted and ignored, as the model has one task. Supported fields:
  ``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_k``, ``seed``, ``n``
  (n samples of one page in one batched decode), ``logprobs`` (per-token log probability of the
  chosen token; ``top_logprobs`` lists stay empty), ``stream`` (server-sent events), and the
  extensions ``decoder`` (``ar``/``sdb``/``block``/``ppc``), ``window``, ``block_length``,
  ``threshold``, ``span``, and ``parse`` (``page``, or ``elements``: two-stage parsing with the
  layout run here; each choice then also carries ``elements``, every element's box, category,
  markup and confidence). Streaming reads whole pages.

Decodes run one request at a time through the shared :class:`DecodingEngine` (a lock keeps
the model single-threaded). Errors come back in OpenAI's ``{"error": {...}}`` shape.

Run: ``python -m components.curation.openai_server --model MODEL_DIR --port 8118``
(binds 127.0.0.1 unless ``--host`` says otherwise).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import math
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from components.data.pages import InvalidPageError, load_image
from components.decoding.engine import DecodingEngine
from components.decoding.types import DECODERS, DecodeParams
from components.parsing import PARSE_MODES, ParseSettings, make_layout, read_pages
from components.services.process import LOOPBACK, ManagedService, free_port, http_ok

DEFAULT_MAX_TOKENS = 1024
MAX_N = 16
_PARAM_FIELDS = ("window", "block_length", "threshold", "span")


class RequestError(ValueError):
    """A request the server cannot serve; carries the HTTP status for the error body."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.code = code


def _error(message: str, status: int, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "code": status}}, status_code=status)


def _decode_data_uri(url: str) -> bytes:
    if not url.startswith("data:"):
        raise RequestError("only data: URIs are accepted for images (this server does not fetch URLs)")
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise RequestError("image data URI must be base64-encoded (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"image data URI is not valid base64: {exc}") from exc


def extract_page_image(messages: Any):
    """The one page image of a chat request (the last image in the last user message that has one)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("`messages` must be a non-empty list")
    for message in reversed(messages):
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        content = message.get("content")
        if not isinstance(content, list):
            continue
        images = [part for part in content if isinstance(part, dict) and part.get("type") == "image_url"]
        if not images:
            continue
        image_url = images[-1].get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if not isinstance(url, str):
            raise RequestError("image_url part has no url")
        try:
            return load_image(_decode_data_uri(url))
        except InvalidPageError as exc:
            raise RequestError(str(exc)) from exc
    raise RequestError("no image found: send the page as an image_url content part of a user message")


def _number(body: dict, name: str, kind: type, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"`{name}` must be a number, got {value!r}")
    return kind(value)


def decode_params_from_request(body: dict) -> tuple[DecodeParams, int]:
    """OpenAI request fields -> (DecodeParams, n)."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(f"`max_tokens` must be a positive integer, got {max_tokens!r}")
    n = _number(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise RequestError(f"`n` must be between 1 and {MAX_N}, got {n}")
    decoder = body.get("decoder", "ar")
    if decoder not in DECODERS:
        raise RequestError(f"`decoder` must be one of {list(DECODERS)}, got {decoder!r}")
    extra = {name: _number(body, name, float if name == "threshold" else int, None) for name in _PARAM_FIELDS}
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(f"`seed` must be an integer, got {seed!r}")
    try:
        params = DecodeParams(
            decoder=decoder, max_new_tokens=max_tokens, temperature=_number(body, "temperature", float, 0.0),
            top_k=max(0, _number(body, "top_k", int, 0)), seed=seed,
            **{k: v for k, v in extra.items() if v is not None},
        )
    except ValueError as exc:
        raise RequestError(str(exc)) from exc
    if n > 1 and params.greedy:
        raise RequestError("`n` > 1 needs `temperature` > 0 (greedy samples would all be the same)")
    return params, n


class MarkupChatServer:
    """The engine plus the request handling, independent of the web framework for testing."""

    def __init__(self, engine, model_name: str, layout: str = "rapid-layout"):
        self.engine = engine
        self.model_name = model_name
        self.parsing = ParseSettings("elements", layout)
        self._layout = None  # built on the first element-mode request
        self.created = int(time.time())
        self._lock = threading.Lock()

    def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "docmarkup-ops"}
        ]}

    def _check_model(self, body: dict) -> None:
        requested = body.get("model")
        if requested not in (None, "", self.model_name):
            raise RequestError(f"model {requested!r} is not served here; this server serves {self.model_name!r}",
                               status=404, code="model_not_found")

    def _logprobs(self, token_ids: list[int], confidences: list[float]) -> dict:
        content = []
        for token_id, confidence in zip(token_ids, confidences, strict=False):
            token = self.engine.tokenizer.decode([token_id])
            content.append({"token": token, "logprob": math.log(max(confidence, 1e-45)),
                            "bytes": list(token.encode("utf-8")), "top_logprobs": []})
        return {"content": content}

    def complete(self, body: dict) -> dict:
        self._check_model(body)
        params, n = decode_params_from_request(body)
        image = extract_page_image(body.get("messages"))
        mode = body.get("parse", "page")
        if mode not in PARSE_MODES:
            raise RequestError(f"`parse` must be one of {list(PARSE_MODES)}, got {mode!r}")
        with self._lock:
            if mode == "elements":
                self._layout = self._layout or make_layout(self.parsing.layout)
                results = read_pages(self.engine, [image] * n, params, self.parsing, layout=self._layout)
            else:
                results = self.engine.generate([image] * n, params)
        eos = self.engine.ids.eos
        choices, completion_tokens = [], 0
        for index, result in enumerate(results):
            token_ids = [t for t in result.token_ids if t != eos]
            completion_tokens += len(result.token_ids)
            choice = {"index": index, "message": {"role": "assistant", "content": result.text},
                      "finish_reason": "length" if result.truncated else "stop"}
            choice["logprobs"] = self._logprobs(token_ids, result.confidences) if body.get("logprobs") else None
            if result.parse is not None:
                choice["elements"] = result.parse.as_dict()["elements"]
            choices.append(choice)
        prompt_tokens = self.engine.prefix_length
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    def stream(self, body: dict) -> Iterator[str]:
        """Server-sent events in the OpenAI ``chat.completion.chunk`` format; validation runs first."""
        self._check_model(body)
        params, n = decode_params_from_request(body)
        if body.get("parse", "page") != "page":
            raise RequestError("`parse: elements` is served without `stream` (elements come back whole)")
        image = extract_page_image(body.get("messages"))
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        want_logprobs = bool(body.get("logprobs"))
        eos = self.engine.ids.eos

        def chunk(index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> str:
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                       "model": self.model_name, "choices": [choice]}
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        def events() -> Iterator[str]:
            with self._lock:
                for index in range(n):
                    yield chunk(index, {"role": "assistant", "content": ""}, None)
                for event in self.engine.stream([image] * n, params):
                    ids = [t for t in event.token_ids if t != eos]
                    logprobs = self._logprobs(ids, event.confidences) if want_logprobs and ids else None
                    if event.text or logprobs:
                        yield chunk(event.row, {"content": event.text}, None, logprobs)
                    if event.finished or event.truncated:
                        yield chunk(event.row, {}, "length" if event.truncated else "stop")
            yield "data: [DONE]\n\n"

        return events()


def create_app(engine, model_name: str) -> FastAPI:
    server = MarkupChatServer(engine, model_name)
    app = FastAPI(title="docmarkup-ops OpenAI-compatible markup server")
    app.state.server = server

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models")
    def models() -> dict:
        return server.models()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(f"request body is not JSON: {exc}", 400, "invalid_request_error")
        if not isinstance(body, dict):
            return _error("request body must be a JSON object", 400, "invalid_request_error")
        try:
            if body.get("stream"):
                events = server.stream(body)  # validates before the first byte is sent
                return StreamingResponse(events, media_type="text/event-stream")
            return await run_in_threadpool(server.complete, body)
        except RequestError as exc:
            return _error(str(exc), exc.status, exc.code)

    return app


def openai_server_service(model_dir: str | Path, *, port: int | None = None, model_name: str | None = None,
                          name: str = "openai-markup-server", startup_timeout_s: float = 120.0) -> tuple[ManagedService, str]:
    """A :class:`ManagedService` running this server on 127.0.0.1; returns it and its base URL."""

    port = port or free_port()
    url = f"http://{LOOPBACK}:{port}"
    command = [sys.executable, "-m", "components.curation.openai_server", "--model", str(model_dir), "--port", str(port)]
    if model_name:
        command += ["--served-model-name", model_name]
    service = ManagedService(name=name, command=command, health=lambda: http_ok(f"{url}/health"),
                             env={"TOKENIZERS_PARALLELISM": "false"}, startup_timeout_s=startup_timeout_s)
    return service, url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder (config.json + weights + tokenizer)")
    parser.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: folder name)")
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, default=8118)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    import uvicorn  # deferred: only serving needs it

    engine = DecodingEngine.from_pretrained(args.model, device=args.device)
    name = args.served_model_name or Path(args.model).resolve().name
    uvicorn.run(create_app(engine, name), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
