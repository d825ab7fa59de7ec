"""The wire protocol of the docmarkup Triton models, as plain Python (testable without Triton).

Request: ``IMAGE`` (BYTES, one encoded page: PNG/JPEG/...) plus optional one-element inputs
choosing the decoder per request: ``DECODER`` (BYTES: ar | sdb | block | ppc), ``THRESHOLD``
(FP32 τ), ``WINDOW`` / ``BLOCK_LENGTH`` / ``SPAN`` / ``MAX_NEW_TOKENS`` (INT32),
``TEMPERATURE`` (FP32), ``TOP_K`` (INT32), ``SEED`` (INT64), and ``PARSE`` (BYTES: page | elements):
a whole page in one decode, or two-stage parsing (layout inside the backend, then every element's
crop, all elements of the batch's pages in one engine batch); ``PROBE`` (BYTES): the platform's probe
key, marking one of its own requests (deploy's version check, smoke tests), answered but never
logged, counted or fed to drift checks and the annotators' queue. The key is generated at deploy
time (0600, beside the server's admin key) and checked by the backend: a ``PROBE`` without the key
is refused with the reason, so no client's traffic can hide from monitoring. Anything omitted takes the :class:`DecodeParams` default (the
decoder and parse defaults come from the model config).

In element mode ``STATS`` carries ``parse`` and ``elements`` (box, category, markup, confidence,
skipped/error reason per element); the stream sends one response per element, in reading order.

Response (``docmarkup``): ``TEXT``, ``TOKEN_IDS``, ``STATS`` (JSON). Stream
(``docmarkup_stream``): per commit ``TEXT`` (the new text only), ``TOKEN_IDS``, ``CONFIDENCES``,
``FORWARD_PASS``; the final response carries ``STATS`` (non-empty JSON) and Triton's final flag.

Both models batch dynamically (``max_batch_size`` > 0): each request is one page with a leading
batch dimension of 1 on every input and output, Triton groups concurrent requests into one
``execute``, and the backend decodes those with equal parameters together (:func:`batch_groups`).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from components.data.pages import load_image
from components.decoding.types import DECODERS, CommitEvent, DecodeParams, DecodeResult

IMAGE_INPUT = "IMAGE"
# Errors carry an HTTP-style status in front of the message ("[400] input IMAGE ... is not a readable
# image"): Triton's gRPC stream delivers a decoupled model's error as text only, without its code,
# so the client reads the status back from the message on every path (HTTP, gRPC, stream).
_STATUS_PREFIX = re.compile(r"^\[(?P<status>\d{3})\] ")
# Triton input name -> (DecodeParams field, Python type).
PARAMETER_INPUTS: dict[str, tuple[str, type]] = {
    "DECODER": ("decoder", str),
    "THRESHOLD": ("threshold", float),
    "WINDOW": ("window", int),
    "BLOCK_LENGTH": ("block_length", int),
    "SPAN": ("span", int),
    "MAX_NEW_TOKENS": ("max_new_tokens", int),
    "TEMPERATURE": ("temperature", float),
    "TOP_K": ("top_k", int),
    "SEED": ("seed", int),
}
PARSE_INPUT = "PARSE"
# A request the platform makes of itself (deploy's version check, smoke tests, health probes): it is
# answered like any other but never reaches the request log, the production metrics, the drift
# check or the annotators' queue. It carries the deployment's probe key (see probe_from_inputs).
PROBE_INPUT = "PROBE"
INPUT_NAMES = (IMAGE_INPUT, *PARAMETER_INPUTS, PARSE_INPUT, PROBE_INPUT)
DECODER_INPUT = "DECODER"
PARSE_MODES = ("page", "elements")
# Triton datatypes of the inputs, for clients.
INPUT_DATATYPES = {
    IMAGE_INPUT: "BYTES", "DECODER": "BYTES", "THRESHOLD": "FP32", "WINDOW": "INT32", "BLOCK_LENGTH": "INT32",
    "SPAN": "INT32", "MAX_NEW_TOKENS": "INT32", "TEMPERATURE": "FP32", "TOP_K": "INT32", "SEED": "INT64",
    PARSE_INPUT: "BYTES", PROBE_INPUT: "BYTES",
}
TEXT_OUTPUT, TOKEN_IDS_OUTPUT, STATS_OUTPUT = "TEXT", "TOKEN_IDS", "STATS"
CONFIDENCES_OUTPUT, FORWARD_PASS_OUTPUT = "CONFIDENCES", "FORWARD_PASS"


class RequestError(ValueError):
    """The request itself is wrong (missing image, bad parameter): the client must fix it."""


def _scalar(name: str, array: np.ndarray, kind: type) -> Any:
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise RequestError(f"input {name} must hold exactly one value, got {values.size}")
    value = values[0]
    if kind is str:
        if isinstance(value, bytes | np.bytes_):
            try:
                return bytes(value).decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise RequestError(f"input {name} is not UTF-8 text") from exc
        return str(value).strip()
    if kind is float:
        number = float(value)
        if not math.isfinite(number):
            raise RequestError(f"input {name} must be a finite number, got {number}")
        return number
    return int(value)


def decode_params_from_inputs(
    inputs: Mapping[str, np.ndarray | None], *, default_decoder: str = "ar", max_new_tokens_limit: int = 2048
) -> DecodeParams:
    """The request's :class:`DecodeParams`; raises :class:`RequestError` with the reason if invalid."""
    chosen: dict[str, Any] = {"decoder": default_decoder}
    for input_name, (field_name, kind) in PARAMETER_INPUTS.items():
        array = inputs.get(input_name)
        if array is not None:
            chosen[field_name] = _scalar(input_name, array, kind)
    if chosen["decoder"] not in DECODERS:
        raise RequestError(f"DECODER must be one of {', '.join(DECODERS)}; got {chosen['decoder']!r}")
    if chosen.get("max_new_tokens", 0) > max_new_tokens_limit:
        raise RequestError(f"MAX_NEW_TOKENS {chosen['max_new_tokens']} exceeds this deployment's limit {max_new_tokens_limit}")
    try:
        return DecodeParams(**chosen)
    except ValueError as exc:
        raise RequestError(str(exc)) from exc


def parse_mode_from_inputs(inputs: Mapping[str, np.ndarray | None], default: str = "page") -> str:
    """The request's ``PARSE`` mode (``default`` when omitted); an unknown mode is a :class:`RequestError`."""
    array = inputs.get(PARSE_INPUT)
    mode = default if array is None else _scalar(PARSE_INPUT, array, str)
    if mode not in PARSE_MODES:
        raise RequestError(f"PARSE must be one of {', '.join(PARSE_MODES)}; got {mode!r}")
    return mode


def probe_from_inputs(inputs: Mapping[str, np.ndarray | None], probe_key: str | None) -> bool:
    """Whether the request is one of the platform's own probes: ``PROBE`` carries ``probe_key``.

    A ``PROBE`` that does not (a client's guess, a stale key, a server without one) is a
    :class:`RequestError`: traffic that could hide from the request log and the metrics is refused
    with the reason, never served unrecorded."""
    array = inputs.get(PROBE_INPUT)
    if array is None:
        return False
    sent = _scalar(PROBE_INPUT, array, str)
    if not probe_key or not hmac.compare_digest(sent.encode(), probe_key.encode()):
        raise RequestError("PROBE is reserved for the platform's own requests and needs its probe key "
                           "(var/services/<triton service>/probe.key); send the request without PROBE")
    return True


def requested_decoder(array: np.ndarray | None, default: str) -> str:
    """The decoder a request asked for, as a metrics label: ``default`` when it named none, one of
    :data:`DECODERS`, or ``"unknown"`` (never the raw text, so labels stay a bounded set)."""
    if array is None:
        return default
    try:
        name = _scalar(DECODER_INPUT, array, str)
    except (RequestError, ValueError, TypeError):
        return "unknown"
    return name if name in DECODERS else "unknown"


def with_status(message: str, status: int) -> str:
    """``message`` as the backend sends it, its status in front."""
    return f"[{status}] {message}"


def split_status(message: str) -> tuple[str | None, str]:
    """(status, message) of an error text the backend sent; (None, text) for any other error."""
    match = _STATUS_PREFIX.match(message)
    return (match["status"], message[match.end():]) if match else (None, message)


def image_bytes_from_input(array: np.ndarray | None) -> bytes:
    """The encoded page image of the ``IMAGE`` input (kept for the request log)."""
    if array is None:
        raise RequestError(f"input {IMAGE_INPUT} is required")
    values = np.asarray(array, dtype=object).reshape(-1)
    if values.size != 1:
        raise RequestError(f"input {IMAGE_INPUT} must hold exactly one encoded page image, got {values.size}")
    data = values[0]
    if isinstance(data, str):
        data = data.encode("latin-1")
    return bytes(data)


def image_from_input(array: np.ndarray | None) -> Image.Image:
    """Decode the ``IMAGE`` input; corrupt or empty pages raise ``InvalidPageError`` with the reason."""
    return load_page_input(image_bytes_from_input(array))


def load_page_input(data: bytes) -> Image.Image:
    """The page of an ``IMAGE`` input; errors name the input and its size."""
    return load_image(data, what=f"input {IMAGE_INPUT} ({len(data):,} bytes)")


def batch_groups(params: Sequence[DecodeParams | None], max_pages: int,
                 modes: Sequence[str] | None = None) -> list[list[int]]:
    """Indices of the requests to decode together, in arrival order.

    Requests share a batch only when their parameters (and parse modes) are equal and carry no
    seed: a seeded page's sampling stream depends on its row in the batch, so it is decoded alone
    to stay reproducible. ``None`` (a request already answered with an error) is skipped.
    """
    if max_pages < 1:
        raise ValueError("max_pages must be >= 1")
    groups: list[list[int]] = []
    open_groups: dict[tuple[DecodeParams, str], list[int]] = {}
    for index, request_params in enumerate(params):
        if request_params is None:
            continue
        if request_params.seed is not None:
            groups.append([index])
            continue
        key = (request_params, modes[index] if modes is not None else "page")
        group = open_groups.get(key)
        if group is None or len(group) >= max_pages:
            group = open_groups[key] = []
            groups.append(group)
        group.append(index)
    return groups


def params_dict(params: DecodeParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def result_stats(result: DecodeResult, params: DecodeParams, model: Mapping[str, Any], latency_s: float) -> dict[str, Any]:
    """The ``STATS`` JSON of a finished page: engine accounting, how it was decoded, what model
    served it, and in element mode every element (box, category, markup, confidence, reasons)."""
    parsed = {} if result.parse is None else {
        "parse": "elements", "elements": [e.as_dict() for e in result.parse.elements], "reason": result.parse.reason}
    return {
        **parsed,
        **result.stats.as_dict(),
        "accepted_lengths": list(result.stats.accepted_lengths),
        "finished": result.finished,
        "truncated": result.truncated,
        "latency_s": latency_s,
        "params": params_dict(params),
        "model": dict(model),
    }


@dataclass
class StreamAccounting:
    """Stats of a streamed page rebuilt from its events (one per forward), equal to ``generate``'s."""

    forward_passes: int = 0
    new_tokens: int = 0
    confidence_sum: float = 0.0
    accepted_lengths: list[int] = field(default_factory=list)
    finished: bool = False
    truncated: bool = False

    def add(self, event: CommitEvent) -> None:
        self.accepted_lengths.append(event.decided)
        self.forward_passes = event.forward_pass
        self.new_tokens += len(event.token_ids)
        self.confidence_sum += float(sum(event.confidences))
        self.finished, self.truncated = event.finished, event.truncated

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def mean_confidence(self) -> float:
        return self.confidence_sum / self.new_tokens if self.new_tokens else 0.0

    def as_dict(self, params: DecodeParams, model: Mapping[str, Any], latency_s: float, cancelled: bool) -> dict[str, Any]:
        return {
            "forward_passes": self.forward_passes,
            "new_tokens": self.new_tokens,
            "tokens_per_forward": self.tokens_per_forward,
            "seconds": latency_s,
            "tokens_per_second": self.new_tokens / latency_s if latency_s > 0 else 0.0,
            "mean_confidence": self.mean_confidence,
            "accepted_lengths": self.accepted_lengths,
            "finished": self.finished,
            "truncated": self.truncated,
            "cancelled": cancelled,
            "latency_s": latency_s,
            "params": params_dict(params),
            "model": dict(model),
        }


def outcome_of(finished: bool, truncated: bool) -> str:
    return "truncated" if truncated and not finished else "ok"


def to_json(payload: Mapping[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, default=str)


def as_object_array(values: Iterable[str | bytes]) -> np.ndarray:
    return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=np.object_)
