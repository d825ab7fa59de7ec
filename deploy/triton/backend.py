"""The Triton Python-backend model behind ``docmarkup`` and ``docmarkup_stream``.

Both models' ``model.py`` import :class:`TritonPythonModel` from here; the config decides the
mode (``model_transaction_policy { decoupled: true }`` streams). This file only translates
between Triton and the project: decoding is :class:`components.decoding.engine.DecodingEngine`,
the wire format is :mod:`deploy.triton.protocol`, the weights come from
:func:`deploy.triton.model_source.resolve_model` (MLflow ``champion`` alias by default) and the
custom Prometheus metrics are :mod:`monitoring.backend_metrics`.

Only importable inside the Triton Python backend stub (``triton_python_backend_utils``).
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from components.data.pages import InvalidPageError, load_image
from components.decoding.engine import DecodingEngine
from components.decoding.types import CommitEvent, DecodeParams
from deploy.triton import protocol
from deploy.triton.model_source import resolve_model
from monitoring.backend_metrics import BackendMetrics
from monitoring.request_log import RequestLog, ServedPage

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
FINALIZE_WAIT_S = 120.0


def _tensor(name: str, values: np.ndarray) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, values)


def _error(message: str, code: int | None = None) -> pb_utils.TritonError:
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


class TritonPythonModel:
    """One model instance: an engine over the resolved weights. The unary model decodes each
    dynamically batched execute's compatible requests together; the stream model serves its
    requests one after another."""

    def initialize(self, args: dict) -> None:
        self.model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        self.logger = pb_utils.Logger
        parameters = {
            key: value.get("string_value", "") for key, value in self.model_config.get("parameters", {}).items()
        }
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        self.max_batch_size = int(self.model_config.get("max_batch_size", 0))
        self.default_decoder = parameters.get("default_decoder") or "ar"
        self.max_new_tokens_limit = int(parameters.get("max_new_tokens_limit") or 2048)
        threads = int(parameters.get("torch_threads") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        resolved = resolve_model(
            parameters.get("model_uri", ""),
            tracking_uri=parameters.get("mlflow_tracking_uri") or None,
            cache_dir=Path(parameters["model_cache_dir"]) if parameters.get("model_cache_dir") else None,
        )
        self.model_info = resolved.describe()
        self.engine = DecodingEngine.from_pretrained(resolved.path, device=parameters.get("device") or "cpu")
        self.metrics = BackendMetrics(pb_utils, self.model_name)
        self.request_log = RequestLog(parameters.get("request_log_dir") or None)
        self._inflight = 0
        self._idle = threading.Condition()
        self.logger.log_info(
            f"{self.model_name}: serving {resolved.uri} (version {resolved.version}, {resolved.path}) "
            f"{'streaming' if self.decoupled else 'unary'}, loaded in {time.perf_counter() - started:.1f}s"
        )

    # ---------------------------------------------------------------------------------------
    @contextmanager
    def _in_flight(self) -> Iterator[None]:
        with self._idle:
            self._inflight += 1
        try:
            yield
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def execute(self, requests: list) -> list | None:
        with self._in_flight():
            if self.decoupled:
                for request in requests:
                    try:
                        self._stream_one(request)
                    except Exception as exc:  # never leave a stream without its final response
                        self._log_failure("streaming request failed", exc)
                        with suppress(Exception):
                            request.get_response_sender().send(
                                pb_utils.InferenceResponse(error=_error(f"internal error: {exc}")), flags=FINAL
                            )
                return None
            return self._infer_batch(requests)

    def finalize(self) -> None:
        """Let running requests finish (bounded), then release metrics before their families."""
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0, timeout=FINALIZE_WAIT_S)
        self.metrics.close()
        self.engine = None

    # ---------------------------------------------------------------------------------------
    def _parse(self, request) -> tuple[DecodeParams, object, bytes]:
        inputs = {}
        for name in protocol.INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            inputs[name] = None if tensor is None else tensor.as_numpy()
        params = protocol.decode_params_from_inputs(
            inputs, default_decoder=self.default_decoder, max_new_tokens_limit=self.max_new_tokens_limit
        )
        image_bytes = protocol.image_bytes_from_input(inputs[protocol.IMAGE_INPUT])
        return params, load_image(image_bytes), image_bytes

    def _record_served(self, image_bytes: bytes, decoder: str, text: str, new_tokens: int, forward_passes: int,
                       confidence_sum: float, latency: float, truncated: bool) -> None:
        """Append the page to the production request log (drift checks, low-confidence feedback)."""
        try:
            self.request_log.record(ServedPage(
                page_id=RequestLog.page_id_for(image_bytes), decoder=decoder,
                mean_confidence=confidence_sum / new_tokens if new_tokens else 0.0, new_tokens=new_tokens,
                forward_passes=forward_passes, latency_s=latency, truncated=truncated, text=text,
                model_version=str(self.model_info.get("version") or self.model_info.get("uri")),
            ), image_bytes)
        except OSError as exc:  # a full disk must not fail the request that was already answered
            self.logger.log_warn(f"{self.model_name}: request log write failed: {exc}")

    def _log_failure(self, what: str, exc: BaseException) -> None:
        self.logger.log_error(f"{self.model_name}: {what}: {exc}\n{traceback.format_exc()}")

    def _infer_batch(self, requests: list) -> list[pb_utils.InferenceResponse]:
        """Answer every request of one (dynamically batched) execute, in order.

        Requests with equal parameters are decoded together by one engine call (one forward per
        step for all their pages); a bad request is answered with its error and never fails the
        others. Each page's latency runs from the start of this execute to its batch's end.
        """
        started = time.perf_counter()
        responses: list[pb_utils.InferenceResponse | None] = [None] * len(requests)
        parsed: list[tuple[DecodeParams, object, bytes] | None] = [None] * len(requests)
        for index, request in enumerate(requests):
            decoder = self.default_decoder
            try:
                if request.is_cancelled():
                    self.metrics.record_request(decoder, "cancelled", time.perf_counter() - started)
                    responses[index] = pb_utils.InferenceResponse(
                        error=_error("request cancelled", pb_utils.TritonError.CANCELLED))
                    continue
                parsed[index] = self._parse(request)
            except (protocol.RequestError, InvalidPageError) as exc:
                self.metrics.record_request(decoder, "invalid", time.perf_counter() - started)
                responses[index] = pb_utils.InferenceResponse(error=_error(str(exc), pb_utils.TritonError.INVALID_ARG))
            except Exception as exc:
                self._log_failure("reading the request failed", exc)
                self.metrics.record_request(decoder, "error", time.perf_counter() - started)
                responses[index] = pb_utils.InferenceResponse(error=_error(f"reading the request failed: {exc}"))
        groups = protocol.batch_groups([p[0] if p else None for p in parsed], max(1, self.max_batch_size))
        for group in groups:
            params = parsed[group[0]][0]
            try:
                results = self.engine.generate([parsed[i][1] for i in group], params)
            except Exception as exc:
                self._log_failure("decoding failed", exc)
                for i in group:
                    self.metrics.record_request(params.decoder, "error", time.perf_counter() - started)
                    responses[i] = pb_utils.InferenceResponse(
                        error=_error(f"decoding failed: {type(exc).__name__}: {exc}"))
                continue
            latency = time.perf_counter() - started
            for i, result in zip(group, results, strict=True):
                responses[i] = self._page_response(result, params, parsed[i][2], latency, batch_size=len(group))
        return responses

    def _page_response(self, result, params: DecodeParams, image_bytes: bytes, latency: float,
                       batch_size: int) -> pb_utils.InferenceResponse:
        stats = result.stats
        self.metrics.record_decoding(
            params.decoder, new_tokens=stats.new_tokens, forward_passes=stats.forward_passes,
            accepted_lengths=stats.accepted_lengths, mean_confidence=stats.mean_confidence if stats.new_tokens else None,
        )
        self.metrics.record_request(params.decoder, protocol.outcome_of(result.finished, result.truncated), latency)
        self._record_served(image_bytes, params.decoder, result.text, stats.new_tokens, stats.forward_passes,
                            stats.confidence_sum, latency, result.truncated)
        payload = protocol.result_stats(result, params, self.model_info, latency) | {"batch_size": batch_size}
        # A batching model's outputs carry the batch dimension (one page per request).
        lead = (1,) if self.max_batch_size > 0 else ()
        return pb_utils.InferenceResponse(output_tensors=[
            _tensor(protocol.TEXT_OUTPUT, protocol.as_object_array([result.text]).reshape(*lead, 1)),
            _tensor(protocol.TOKEN_IDS_OUTPUT, np.asarray(result.token_ids, dtype=np.int64).reshape(*lead, -1)),
            _tensor(protocol.STATS_OUTPUT, protocol.as_object_array([protocol.to_json(payload)]).reshape(*lead, 1)),
        ])

    def _commit_response(self, event: CommitEvent) -> pb_utils.InferenceResponse:
        return pb_utils.InferenceResponse(output_tensors=[
            _tensor(protocol.TEXT_OUTPUT, protocol.as_object_array([event.text])),
            _tensor(protocol.TOKEN_IDS_OUTPUT, np.asarray(event.token_ids, dtype=np.int64)),
            _tensor(protocol.CONFIDENCES_OUTPUT, np.asarray(event.confidences, dtype=np.float32)),
            _tensor(protocol.FORWARD_PASS_OUTPUT, np.asarray([event.forward_pass], dtype=np.int64)),
            _tensor(protocol.STATS_OUTPUT, protocol.as_object_array([""])),
        ])

    def _final_response(self, accounting: protocol.StreamAccounting, payload: dict) -> pb_utils.InferenceResponse:
        return pb_utils.InferenceResponse(output_tensors=[
            _tensor(protocol.TEXT_OUTPUT, protocol.as_object_array([""])),
            _tensor(protocol.TOKEN_IDS_OUTPUT, np.zeros(0, dtype=np.int64)),
            _tensor(protocol.CONFIDENCES_OUTPUT, np.zeros(0, dtype=np.float32)),
            _tensor(protocol.FORWARD_PASS_OUTPUT, np.asarray([accounting.forward_passes], dtype=np.int64)),
            _tensor(protocol.STATS_OUTPUT, protocol.as_object_array([protocol.to_json(payload)])),
        ])

    def _stream_one(self, request) -> None:
        """Send one response per commit, then the stats with the final flag; stop early on cancel."""
        sender = request.get_response_sender()
        started = time.perf_counter()
        decoder = self.default_decoder
        try:
            params, image, image_bytes = self._parse(request)
            decoder = params.decoder
        except (protocol.RequestError, InvalidPageError) as exc:
            self.metrics.record_request(decoder, "invalid", time.perf_counter() - started)
            sender.send(pb_utils.InferenceResponse(error=_error(str(exc), pb_utils.TritonError.INVALID_ARG)), flags=FINAL)
            return
        except Exception as exc:
            self._log_failure("reading the request failed", exc)
            self.metrics.record_request(decoder, "error", time.perf_counter() - started)
            sender.send(pb_utils.InferenceResponse(error=_error(f"reading the request failed: {exc}")), flags=FINAL)
            return

        accounting = protocol.StreamAccounting()
        cancelled = False
        text: list[str] = []
        events = self.engine.stream([image], params)
        try:
            for event in events:
                if sender.is_cancelled():
                    cancelled = True
                    break
                accounting.add(event)
                text.append(event.text)
                if event.token_ids:  # forwards that only decided (block decoding) send nothing
                    sender.send(self._commit_response(event))
        except Exception as exc:
            self._log_failure("streamed decoding failed", exc)
            self.metrics.record_request(decoder, "error", time.perf_counter() - started)
            sender.send(pb_utils.InferenceResponse(error=_error(f"decoding failed: {type(exc).__name__}: {exc}")),
                        flags=FINAL)
            return
        finally:
            events.close()  # stops the engine's loop: a cancelled page costs no more forwards

        latency = time.perf_counter() - started
        self.metrics.record_decoding(
            decoder, new_tokens=accounting.new_tokens, forward_passes=accounting.forward_passes,
            accepted_lengths=accounting.accepted_lengths,
            mean_confidence=accounting.mean_confidence if accounting.new_tokens else None,
        )
        if cancelled:
            self.metrics.record_request(decoder, "cancelled", latency)
            self.logger.log_info(f"{self.model_name}: request cancelled after {accounting.forward_passes} forwards")
            try:  # the client may be gone already; the final flag still releases the request
                sender.send(pb_utils.InferenceResponse(error=_error("request cancelled", pb_utils.TritonError.CANCELLED)),
                            flags=FINAL)
            except Exception as exc:
                self.logger.log_warn(f"{self.model_name}: could not close a cancelled request: {exc}")
            return
        self.metrics.record_request(decoder, protocol.outcome_of(accounting.finished, accounting.truncated), latency)
        self._record_served(image_bytes, decoder, "".join(text), accounting.new_tokens, accounting.forward_passes,
                            accounting.confidence_sum, latency, accounting.truncated)
        payload = accounting.as_dict(params, self.model_info, latency, cancelled=False)
        sender.send(self._final_response(accounting, payload), flags=FINAL)
