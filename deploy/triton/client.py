"""A small client for product teams: page image in, markup out, over Triton HTTP or gRPC streaming.

    client = DocMarkupClient("127.0.0.1:8000", "127.0.0.1:8001")
    page = client.transcribe(png_bytes, decoder="block", threshold=0.9)
    print(page.text, page.stats["tokens_per_forward"])

    with client.stream_transcribe(png_bytes, decoder="sdb") as stream:
        for chunk in stream:            # committed text as soon as the decoder commits it
            print(chunk.text, end="")
    print(stream.stats)                 # filled in by the final response

    pages = client.transcribe_many(png_pages, decoder="sdb")   # in flight together: Triton batches them

Leaving the ``with`` block (or calling ``stream.cancel()``) before the end cancels the request
on the server, which stops decoding that page.
"""

from __future__ import annotations

import io
import json
import queue
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from deploy.triton import protocol
from deploy.triton.repository import MODEL_NAME, STREAM_MODEL_NAME

_NUMPY_TYPES = {"BYTES": np.object_, "FP32": np.float32, "INT32": np.int32, "INT64": np.int64, "BOOL": np.bool_}


class TritonUnavailableError(ConnectionError):
    """The server cannot be reached or is not ready."""


class TranscriptionError(RuntimeError):
    """The server refused or failed this request (the message says why, e.g. a corrupt image)."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status


class ServerBusyError(TranscriptionError):
    """The server is up but refused the request for load (its queue was full): nothing was
    decoded; retry later or elsewhere."""


# What Triton's scheduler says when it refuses a request for load.
_BUSY_MESSAGES = ("exceeds maximum queue size", "server busy")  # Triton's queue; the engine loop's


@dataclass
class Transcription:
    text: str
    token_ids: list[int]
    stats: dict[str, Any]


@dataclass
class StreamChunk:
    """Text committed by one decoder forward pass (``text`` may be empty while a character is incomplete)."""

    text: str
    token_ids: list[int]
    confidences: list[float]
    forward_pass: int


def encode_image(image: bytes | str | Path | Image.Image) -> bytes:
    """Encoded image bytes for the ``IMAGE`` input (PIL images are sent as PNG)."""
    if isinstance(image, bytes | bytearray):
        return bytes(image)
    if isinstance(image, Image.Image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    return Path(image).read_bytes()


def request_values(image: bytes | str | Path | Image.Image, **options: Any) -> dict[str, np.ndarray]:
    """Input name -> one-element array, for the image and every option that is not None."""
    fields = {field_name: input_name for input_name, (field_name, _) in protocol.PARAMETER_INPUTS.items()}
    fields["parse"] = protocol.PARSE_INPUT  # page | elements
    fields["probe"] = protocol.PROBE_INPUT  # the deployment's probe key: the platform's own request
    unknown = set(options) - set(fields)
    if unknown:
        raise TypeError(f"unknown decoding options {sorted(unknown)}; expected {sorted(fields)}")
    values = {protocol.IMAGE_INPUT: np.array([encode_image(image)], dtype=np.object_)}
    for field_name, value in options.items():
        if value is None:
            continue
        name = fields[field_name]
        kind = _NUMPY_TYPES[protocol.INPUT_DATATYPES[name]]
        values[name] = np.array([value.encode() if isinstance(value, str) else value], dtype=kind)
    return values


def _inputs(module, values: dict[str, np.ndarray]) -> list:
    inputs = []
    for name, array in values.items():
        tensor = module.InferInput(name, list(array.shape), protocol.INPUT_DATATYPES[name])
        if module is httpclient:
            tensor.set_data_from_numpy(array, binary_data=True)
        else:
            tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _raise_for(exc: InferenceServerException, where: str) -> None:
    """One typed error for every path: the server's message, and its status (HTTP-style: "400"
    for a bad request, "499" cancelled, "503" busy, "504" past its timeout, "500" failed) whether it
    came over HTTP, gRPC or a stream."""
    sent_status, message = protocol.split_status(exc.message() or str(exc))
    status = sent_status or exc.status()
    lowered = message.lower()
    if any(busy in lowered for busy in _BUSY_MESSAGES):  # UNAVAILABLE too, but the server is up
        raise ServerBusyError(message, status) from exc
    if "connection refused" in lowered or "failed to connect" in lowered or status in ("StatusCode.UNAVAILABLE",):
        raise TritonUnavailableError(f"Triton at {where} is unreachable: {message}") from exc
    raise TranscriptionError(message, status) from exc


class TranscriptionStream:
    """Iterator over the :class:`StreamChunk` of one streamed page; ``stats`` is set at the end."""

    def __init__(self, client: grpcclient.InferenceServerClient, model: str, values: dict[str, np.ndarray],
                 timeout_s: float, where: str):
        self._client = client
        self._responses: queue.Queue = queue.Queue()
        self._timeout_s = timeout_s
        self._where = where
        self._open = True
        self.request_id = uuid.uuid4().hex
        self.stats: dict[str, Any] | None = None
        self.chunks: list[StreamChunk] = []
        client.start_stream(callback=lambda result, error: self._responses.put((result, error)))
        try:
            client.async_stream_infer(model, _inputs(grpcclient, values), request_id=self.request_id,
                                      enable_empty_final_response=True)
        except InferenceServerException as exc:
            self._close(cancel=True)
            # The client only says "stream no longer valid"; the reason went to the callback.
            reported = [error for _, error in list(self._responses.queue) if error is not None]
            _raise_for(reported[0] if reported else exc, where)

    @property
    def text(self) -> str:
        return "".join(chunk.text for chunk in self.chunks)

    def __iter__(self) -> Iterator[StreamChunk]:
        while self._open:
            try:
                result, error = self._responses.get(timeout=self._timeout_s)
            except queue.Empty:
                self._close(cancel=True)
                raise TranscriptionError(f"no response from {self._where} for {self._timeout_s:.0f}s; request cancelled") from None
            if error is not None:
                self._close(cancel=False)
                _raise_for(error, self._where)
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param if "triton_final_response" in response.parameters else False
            stats = result.as_numpy(protocol.STATS_OUTPUT) if response.outputs else None
            if stats is not None and stats.reshape(-1)[0]:
                self.stats = json.loads(stats.reshape(-1)[0])
            elif response.outputs:
                chunk = StreamChunk(
                    text=result.as_numpy(protocol.TEXT_OUTPUT).reshape(-1)[0].decode("utf-8"),
                    token_ids=result.as_numpy(protocol.TOKEN_IDS_OUTPUT).reshape(-1).tolist(),
                    confidences=result.as_numpy(protocol.CONFIDENCES_OUTPUT).reshape(-1).tolist(),
                    forward_pass=int(result.as_numpy(protocol.FORWARD_PASS_OUTPUT).reshape(-1)[0]),
                )
                self.chunks.append(chunk)
                yield chunk
            if final:
                self._close(cancel=False)

    def cancel(self) -> None:
        """Stop reading and ask the server to cancel the request (decoding stops there)."""
        self._close(cancel=True)

    def _close(self, cancel: bool) -> None:
        if self._open:
            self._open = False
            self._client.stop_stream(cancel_requests=cancel)
            self._client.close()

    def __enter__(self) -> TranscriptionStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close(cancel=True)


class DocMarkupClient:
    """Talks to a docmarkup Triton deployment (``host:port`` URLs, no scheme)."""

    def __init__(self, http_url: str = "127.0.0.1:8000", grpc_url: str = "127.0.0.1:8001", *,
                 model: str = MODEL_NAME, stream_model: str = STREAM_MODEL_NAME, timeout_s: float = 600.0,
                 probe_key: str | None = None):
        """``probe_key``: the deployment's probe key (``TritonServer.probe_key``), for the platform's
        own requests only (``probe=True``); product clients leave it out."""
        self.http_url = http_url
        self.probe_key = probe_key
        self.grpc_url = grpc_url
        self.model = model
        self.stream_model = stream_model
        self.timeout_s = timeout_s
        self._batched: dict[str, bool] = {}  # model -> takes a leading batch dimension (from its config)

    def _shaped(self, model: str, values: dict[str, np.ndarray], fetch_config: Callable[[], dict]) -> dict[str, np.ndarray]:
        """``values`` as ``model`` takes them: a batching model (``max_batch_size`` > 0, read from its
        config once per client) wants each request as a batch of one page."""
        if model not in self._batched:
            self._batched[model] = int(fetch_config().get("max_batch_size", 0)) > 0
        return {name: array[None, ...] for name, array in values.items()} if self._batched[model] else values

    def _http(self) -> httpclient.InferenceServerClient:
        return httpclient.InferenceServerClient(self.http_url, connection_timeout=10.0, network_timeout=self.timeout_s)

    def ready(self) -> bool:
        """True when the server and both models are ready."""
        client = self._http()
        try:
            return client.is_server_ready() and all(client.is_model_ready(m) for m in (self.model, self.stream_model))
        except (InferenceServerException, OSError):
            return False
        finally:
            client.close()

    def transcribe(self, image: bytes | str | Path | Image.Image, *, decoder: str | None = None,
                   threshold: float | None = None, window: int | None = None, block_length: int | None = None,
                   span: int | None = None, max_new_tokens: int | None = None, temperature: float | None = None,
                   top_k: int | None = None, seed: int | None = None, parse: str | None = None,
                   probe: bool = False, timeout_s: float | None = None) -> Transcription:
        """Decode one page over HTTP and return its markup with the decoding stats (with
        ``parse="elements"``, a two-stage parse: ``stats["elements"]`` lists every element).
        ``probe``: the platform's own request (a deploy check, a smoke test), kept out of the
        request log, the production metrics, drift checks and the annotators' queue. A server whose
        queue is full refuses the page at once (:class:`ServerBusyError`). ``timeout_s``: the page's
        own limit on the server (waiting and decoding); past it the answer is an error with status
        "504" (continuous batching honours it; this is not the client's network timeout)."""
        values = request_values(image, decoder=decoder, threshold=threshold, window=window, block_length=block_length,
                                span=span, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                                parse=parse, probe=self._probe(probe))
        client = self._http()
        outputs = [httpclient.InferRequestedOutput(name, binary_data=True)
                   for name in (protocol.TEXT_OUTPUT, protocol.TOKEN_IDS_OUTPUT, protocol.STATS_OUTPUT)]
        try:
            values = self._shaped(self.model, values, lambda: client.get_model_config(self.model))
            result = client.infer(self.model, _inputs(httpclient, values), outputs=outputs,
                                  timeout=None if timeout_s is None else max(1, int(timeout_s * 1e6)))
        except InferenceServerException as exc:
            _raise_for(exc, self.http_url)
        except OSError as exc:  # refused / reset before Triton answered
            raise TritonUnavailableError(f"Triton at {self.http_url} is unreachable: {exc}") from exc
        finally:
            client.close()
        return Transcription(
            text=result.as_numpy(protocol.TEXT_OUTPUT).reshape(-1)[0].decode("utf-8"),
            token_ids=result.as_numpy(protocol.TOKEN_IDS_OUTPUT).reshape(-1).tolist(),
            stats=json.loads(result.as_numpy(protocol.STATS_OUTPUT).reshape(-1)[0]),
        )

    def transcribe_many(self, images: Sequence[bytes | str | Path | Image.Image], *, concurrency: int = 8,
                        return_exceptions: bool = False, **options: Any) -> list[Transcription | Exception]:
        """Decode many pages with up to ``concurrency`` requests in flight, results in input order.

        Requests in flight together are batched by the server (one forward per step for all of
        them). Every page is attempted; with ``return_exceptions`` a failed page's error stands
        in its place, otherwise the first error is raised once all pages are done.
        """
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")

        def attempt(image: bytes | str | Path | Image.Image) -> Transcription | Exception:
            try:
                return self.transcribe(image, **options)
            except (TranscriptionError, TritonUnavailableError) as exc:
                return exc

        with ThreadPoolExecutor(max_workers=min(concurrency, max(1, len(images)))) as pool:
            results = list(pool.map(attempt, images))
        failures = [result for result in results if isinstance(result, Exception)]
        if failures and not return_exceptions:
            raise failures[0]
        return results

    def _probe(self, probe: bool) -> str | None:
        """The ``PROBE`` value of a request: the probe key for the platform's own, else nothing."""
        if not probe:
            return None
        if not self.probe_key:
            raise ValueError("probe=True needs the deployment's probe key: DocMarkupClient(..., probe_key=server.probe_key)")
        return self.probe_key

    def stream_transcribe(self, image: bytes | str | Path | Image.Image, **options: Any) -> TranscriptionStream:
        """Decode one page over gRPC streaming; iterate the result for committed text chunks.

        Takes the same keyword options as :meth:`transcribe`.
        """
        options["probe"] = self._probe(options.pop("probe", False))
        values = request_values(image, **options)
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            values = self._shaped(self.stream_model, values,
                                  lambda: client.get_model_config(self.stream_model, as_json=True)["config"])
        except InferenceServerException as exc:
            client.close()
            _raise_for(exc, self.grpc_url)
        return TranscriptionStream(client, self.stream_model, values, self.timeout_s, self.grpc_url)
