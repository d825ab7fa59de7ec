"""The Triton Python-backend model behind ``docmarkup`` and ``docmarkup_stream``.

Both models' ``model.py`` import :class:`TritonPythonModel` from here; the config decides the
mode (``model_transaction_policy { decoupled: true }`` streams) and the batching:

- ``continuous`` (default): every instance runs one engine loop on a background thread
  (:class:`components.decoding.scheduler.ContinuousScheduler`), and a prefill thread beside it
  (``overlap_prefill``: a new page's image encoder runs while the rows decode); ``execute`` only
  parses its requests and queues them, and each page joins the running batch at the next step,
  its answer sent through its response sender (the stream: one response per commit) when it ends.
  Element-mode pages are parsed on a worker thread and their crops join the same batch.
  Past ``max_waiting`` queued pages a request is refused at once ("server busy", 503);
- ``closed``: each execute decodes its dynamically batched requests as one engine batch to the
  end (kept for comparison: ``benchmarks/serving_load.py``). This file only translates
between Triton and the project: decoding is :class:`components.decoding.engine.DecodingEngine`,
the wire format is :mod:`deploy.triton.protocol`, the weights come from
:func:`deploy.triton.model_source.resolve_model` (MLflow ``champion`` alias by default) and the
custom Prometheus metrics are :mod:`monitoring.backend_metrics`.

Only importable inside the Triton Python backend stub (``triton_python_backend_utils``).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from components.data.pages import InvalidPageError
from components.decoding.engine import DecodingEngine
from components.decoding.fixed_step import STEP_SWITCHES
from components.decoding.scheduler import (
    CancelledError,
    ContinuousScheduler,
    DeadlineExceededError,
    QueueFullError,
    ScheduledEngine,
    Ticket,
)
from components.decoding.types import CommitEvent, DecodeParams, DecodeResult, DecodeStats
from components.parsing import PageParse, ParseSettings, make_layout, read_pages, resolve_parse
from deploy.triton import protocol
from deploy.triton.model_source import resolve_model
from deploy.triton.repository import BATCHING_MODES, instance_device
from monitoring.backend_metrics import BackendMetrics
from monitoring.request_log import RequestLog, ServedPage

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
FINALIZE_WAIT_S = 120.0
ELEMENT_WORKERS = 2  # element-mode pages parsed at once (layout and crops; their decoding is the engine loop's)


def _tensor(name: str, values: np.ndarray) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, values)


def request_timeout_s(request) -> float | None:
    """The request's own time limit (the client's ``timeout``, microseconds on the wire), if it set one."""
    timeout_us = request.timeout() if hasattr(request, "timeout") else 0
    return timeout_us / 1e6 if timeout_us else None


def request_input(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _error(message: str, code: int | None = None, status: int | None = None) -> pb_utils.TritonError:
    """An error response; its status travels in the message too (the gRPC stream drops the code).
    (``pb_utils.TritonError`` exists only once the stub runs, so the codes are read here.)"""
    status = status or {pb_utils.TritonError.INVALID_ARG: 400, pb_utils.TritonError.CANCELLED: 499,
                        pb_utils.TritonError.UNAVAILABLE: 503}.get(code, 500)
    text = protocol.with_status(message, status)
    return pb_utils.TritonError(text) if code is None else pb_utils.TritonError(text, code)


class TritonPythonModel:
    """One model instance: an engine over the resolved weights, served by continuous batching (an
    engine loop every request joins) or by closed batches (each execute's requests together)."""

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
        self.parsing = ParseSettings("elements", parameters.get("layout") or "rapid-layout")
        self._layout = None  # built on the first element-mode request (layout runs inside the backend)
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
        key_file = parameters.get("probe_key_file")
        self.probe_key = Path(key_file).read_text().strip() if key_file else None  # None: every PROBE refused
        self.engine = DecodingEngine.from_pretrained(resolved.path, device=instance_device(parameters.get("device"), args),
                                                     **STEP_SWITCHES[parameters.get("engine_step") or "default"])
        self.default_parse = resolve_parse(parameters.get("default_parse") or "auto", resolved.path)
        self.metrics = BackendMetrics(pb_utils, self.model_name,
                                      model_version=str(resolved.version) if resolved.version else "local")
        self.request_log = RequestLog(
            parameters.get("request_log_dir") or None,
            max_image_mb=float(parameters.get("request_log_max_image_mb") or 1024),
            image_retention_days=float(parameters.get("request_log_retention_days") or 30),
        )
        self._inflight = 0
        self._idle = threading.Condition()
        self.batching = parameters.get("batching") or "continuous"
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching {self.batching!r} is not one of {BATCHING_MODES}")
        self.scheduler: ContinuousScheduler | None = None
        self._element_pages = 0  # element-mode pages accepted and not yet read to their last crop
        if self.batching == "continuous":
            max_waiting = int(parameters.get("max_waiting") or 0)
            self.scheduler = ContinuousScheduler(
                self.engine, max_rows=max(1, self.max_batch_size), max_waiting=max_waiting or None,
                overlap_prefill=(parameters.get("overlap_prefill") or "true").lower() == "true")
            self.scheduler.start()
            self._element_workers = ThreadPoolExecutor(ELEMENT_WORKERS, thread_name_prefix="element-parse")
            self.responder = _Responder(self.logger, self.model_name)
        self.logger.log_info(
            f"{self.model_name}: serving {resolved.uri} (version {resolved.version}, {resolved.path}) "
            f"{'streaming' if self.decoupled else 'unary'}, {self.batching} batching, reading {self.default_parse} by default, "
            f"loaded in {time.perf_counter() - started:.1f}s"
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
        if self.scheduler is not None:
            self._queue_requests(requests)
            return None
        with self._in_flight():
            if not self.decoupled:
                return self._infer_batch(requests)
            try:
                self._stream_batch(requests)
            except Exception as exc:  # never leave a stream without its final response
                self._log_failure("streaming requests failed", exc)
                for request in requests:
                    with suppress(Exception):
                        request.get_response_sender().send(
                            pb_utils.InferenceResponse(error=_error(f"internal error: {exc}")), flags=FINAL
                        )
            return None

    def finalize(self) -> None:
        """Let running requests finish (bounded), then release metrics before their families."""
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0, timeout=FINALIZE_WAIT_S)
        if self.scheduler is not None:
            self.scheduler.stop()  # nothing is in flight now; anything left is answered with the reason
            self._element_workers.shutdown(wait=False, cancel_futures=True)
            self.responder.stop()
        self.metrics.close()
        self.engine = None

    # ----- continuous batching ------------------------------------------------------------------
    # Three kinds of threads: Triton's (``execute``: parse and queue), the engine loop (decoding only:
    # it never talks to Triton) and one responder that does every call into the stub after
    # ``execute`` returned (responses, cancellation checks, metrics, the request log), in order.
    def _begin(self) -> None:
        with self._idle:
            self._inflight += 1

    def _end(self) -> None:
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()

    def _queue_requests(self, requests: list) -> None:
        """Parse each request and queue its page; answer at once what cannot be queued (invalid,
        cancelled, busy). Returns without decoding: the engine loop decodes, the responder answers."""
        started = time.perf_counter()
        parsed = self._parse_all(requests, started)
        for request, entry in zip(requests, parsed, strict=True):
            sender = request.get_response_sender()
            if not isinstance(entry, tuple):
                self.responder.call(lambda s=sender, e=entry: self._send_final(s, pb_utils.InferenceResponse(error=e)))
                continue
            page = _StreamedPage(sender, parsed=entry, started=started)
            self._begin()
            try:
                if entry[3] == "elements":
                    self._queue_elements(page)
                else:
                    page.ticket = self.scheduler.submit(
                        entry[1], entry[0], on_event=lambda e, p=page: self._on_event(p, e),
                        on_done=lambda t, p=page: self.responder.call(lambda: self._finish(p, t)),
                        timeout_s=request_timeout_s(request))
            except QueueFullError as exc:
                self.responder.call(lambda p=page, error=exc: self._refuse(p, error))
            except Exception as exc:  # nothing was queued: no callback will end it
                self.responder.call(lambda p=page, error=exc: (self._fail(p, error), self._end()))

    def _queue_elements(self, page: _StreamedPage) -> None:
        """Element mode: layout and crops on a worker thread; the crops join the engine loop's batch.

        Admission counts pages, never their lines: an element page counts from acceptance until its
        last crop is decoded (``max_waiting`` element pages in flight, beside the page-mode pages
        waiting for a row); its crops and lines queue for rows uncounted."""
        limit = self.scheduler.max_waiting
        with self._idle:
            held = self.scheduler.waiting_pages + self._element_pages
            if limit is not None and held >= limit:
                raise QueueFullError(f"{held} pages already wait or are being read")
            self._element_pages += 1
        self._element_workers.submit(self._parse_elements, page)

    def _parse_elements(self, page: _StreamedPage) -> None:
        """A worker thread: the page's two-stage parse, its crops decoded by the engine loop."""
        params, image = page.parsed[0], page.parsed[1]
        try:
            [result] = self._read([image], params, "elements", engine=ScheduledEngine(self.scheduler))
        except Exception as exc:
            self.responder.call(lambda error=exc: (self._fail(page, error), self._end()))
            return
        finally:
            with self._idle:
                self._element_pages -= 1
        self.responder.call(lambda: self._answer_elements(page, result))

    def _answer_elements(self, page: _StreamedPage, result: DecodeResult) -> None:
        params = page.parsed[0]
        try:
            self._record_elements(self._metrics_of(page), params, [result])
            if not self.decoupled:
                self._answer(page, result)
                return
            for event in self._element_events([result], [page]):
                page.accounting.add(event)
                page.text.append(event.text)
                if event.token_ids:
                    page.sender.send(self._commit_response(event))
            self._close_finished(page, params, page.parsed, page.started, self.scheduler.decoding + 1)
        except Exception as exc:
            self._fail(page, exc)
        finally:
            self._end()

    def _on_event(self, page: _StreamedPage, event: CommitEvent) -> None:
        """A commit of a queued page (engine loop thread): counted; a stream's is sent by the responder."""
        page.accounting.add(event)
        page.text.append(event.text)
        if self.decoupled and event.token_ids:  # forwards that only decided (block decoding) send nothing
            self.responder.call(lambda: self._send_commit(page, event))

    def _send_commit(self, page: _StreamedPage, event: CommitEvent) -> None:
        """The responder: one streamed commit, unless the client went away (then the row is dropped)."""
        if page.closed or page.cancel_asked:
            return
        if page.sender.is_cancelled():
            page.cancel_asked = True
            self.scheduler.cancel(page.ticket)  # its row leaves after the current step; _finish closes it
            return
        page.sender.send(self._commit_response(event))

    def _finish(self, page: _StreamedPage, ticket: Ticket) -> None:
        """The responder: a queued page ended; its final answer, whatever happened."""
        try:
            if page.closed:
                return
            params = page.parsed[0]
            if isinstance(ticket.error, CancelledError):
                self._close_cancelled(page, params, page.started)
            elif isinstance(ticket.error, DeadlineExceededError):
                page.closed = True
                self._metrics_of(page).record_request(params.decoder, "timeout", time.perf_counter() - page.started)
                self._send_final(page.sender, pb_utils.InferenceResponse(error=_error(str(ticket.error), status=504)))
            elif ticket.error is not None:
                self._fail(page, ticket.error)
            elif self.decoupled:
                self._close_finished(page, params, page.parsed, page.started, self.scheduler.decoding + 1)
            else:
                self._answer(page, ticket.result)
        except Exception as exc:
            self._log_failure("answering a page failed", exc)
        finally:
            self._end()

    def _answer(self, page: _StreamedPage, result: DecodeResult) -> None:
        """The unary answer of a page decoded in the engine loop."""
        page.closed = True
        params = page.parsed[0]
        batch = self.scheduler.decoding + 1
        self._metrics_of(page).record_batch(params.decoder, batch)
        response = self._page_response(result, params, page.parsed[2], time.perf_counter() - page.started,
                                       batch_size=batch, probe=page.parsed[4])
        self._send_final(page.sender, response)

    def _refuse(self, page: _StreamedPage, exc: QueueFullError) -> None:
        """Over capacity: refused at once, with the reason (the client raises ServerBusyError)."""
        page.closed = True
        try:
            params = page.parsed[0]
            self._metrics_of(page).record_request(params.decoder, "refused", time.perf_counter() - page.started)
            self._send_final(page.sender, pb_utils.InferenceResponse(error=_error(
                f"server busy: the queue is full ({exc}; max_waiting {self.scheduler.max_waiting}), retry later",
                pb_utils.TritonError.UNAVAILABLE)))
        finally:
            self._end()

    def _fail(self, page: _StreamedPage, exc: BaseException) -> None:
        if page.closed:
            return
        page.closed = True
        params = page.parsed[0]
        self._log_failure("decoding failed", exc)
        self._metrics_of(page).record_request(params.decoder, "error", time.perf_counter() - page.started)
        code = pb_utils.TritonError.INVALID_ARG if isinstance(exc, (ValueError, InvalidPageError)) else None
        self._send_final(page.sender, pb_utils.InferenceResponse(
            error=_error(f"decoding failed: {type(exc).__name__}: {exc}", code)))

    def _send_final(self, sender, response) -> None:
        try:  # the client may be gone already; the final flag still releases the request
            sender.send(response, flags=FINAL)
        except Exception as exc:
            self.logger.log_warn(f"{self.model_name}: could not send a final response: {exc}")

    # ---------------------------------------------------------------------------------------
    def _parse(self, request) -> tuple[DecodeParams, object, bytes, str, bool]:
        inputs = {name: request_input(request, name) for name in protocol.INPUT_NAMES}
        params = protocol.decode_params_from_inputs(
            inputs, default_decoder=self.default_decoder, max_new_tokens_limit=self.max_new_tokens_limit
        )
        mode = protocol.parse_mode_from_inputs(inputs, self.default_parse)
        try:
            self.engine.check_params(params)
        except ValueError as exc:
            raise protocol.RequestError(str(exc)) from exc
        image_bytes = protocol.image_bytes_from_input(inputs[protocol.IMAGE_INPUT])
        probe = protocol.probe_from_inputs(inputs, self.probe_key)
        return params, protocol.load_page_input(image_bytes), image_bytes, mode, probe

    def _read(self, images: list, params: DecodeParams, mode: str, engine=None,
              record: BackendMetrics | None = None) -> list[DecodeResult]:
        """Whole pages (one engine call), or two-stage parses whose elements form one engine batch
        (``engine``: the engine loop's view, under continuous batching; ``record``: the metrics to
        count the elements in now, on this thread)."""
        engine = engine or self.engine
        if mode != "elements":
            return engine.generate(images, params)
        with self._idle:  # element workers share one layout model; building it once
            if self._layout is None:
                self._layout = make_layout(self.parsing.layout)
        results = read_pages(engine, images, params, self.parsing, layout=self._layout)
        if record is not None:
            self._record_elements(record, params, results)
        return results

    @staticmethod
    def _record_elements(metrics: BackendMetrics, params: DecodeParams, results: list[DecodeResult]) -> None:
        for result in results:
            for element in result.parse.elements:
                outcome = "error" if element.error else "skipped" if element.skipped else "decoded"
                metrics.record_element(params.decoder, element.category, outcome,
                                       element.confidence if outcome == "decoded" else None)

    def _metrics_of(self, page: _StreamedPage | tuple) -> BackendMetrics:
        """Where one page's observations go: nowhere for the platform's own probes (``parsed[4]``)."""
        parsed = page.parsed if isinstance(page, _StreamedPage) else page
        return self.metrics.of_request(bool(parsed and parsed[4]))

    @staticmethod
    def _record_decoding(metrics: BackendMetrics, decoder: str, stats: DecodeStats | protocol.StreamAccounting) -> None:
        """Acceleration metrics of one page (engine stats, or a stream's accounting of them)."""
        metrics.record_decoding(
            decoder, new_tokens=stats.new_tokens, forward_passes=stats.forward_passes,
            accepted_lengths=stats.accepted_lengths, mean_confidence=stats.mean_confidence if stats.new_tokens else None,
        )

    def _record_answered(self, params: DecodeParams, stats: DecodeStats | protocol.StreamAccounting, *, text: str,
                         finished: bool, truncated: bool, image_bytes: bytes, latency: float,
                         elements: list[dict] | None = None, probe: bool = False) -> None:
        """Metrics and the production request log (drift checks, low-confidence feedback) of a page
        answered in full; the platform's own probes are not production and leave no record."""
        metrics = self.metrics.of_request(probe)
        self._record_decoding(metrics, params.decoder, stats)
        metrics.record_request(params.decoder, protocol.outcome_of(finished, truncated), latency)
        if probe:
            return
        try:
            self.request_log.record(ServedPage(
                page_id=RequestLog.page_id_for(image_bytes), decoder=params.decoder,
                mean_confidence=stats.mean_confidence, new_tokens=stats.new_tokens,
                forward_passes=stats.forward_passes, latency_s=latency, truncated=truncated, text=text,
                model_version=str(self.model_info.get("version") or self.model_info.get("uri")),
                elements=elements or [],
            ), image_bytes)
        except OSError as exc:  # a full disk must not fail the request that was already answered
            self.logger.log_warn(f"{self.model_name}: request log write failed: {exc}")

    def _log_failure(self, what: str, exc: BaseException) -> None:
        self.logger.log_error(f"{self.model_name}: {what}: {exc}\n{traceback.format_exc()}")

    def _parse_all(self, requests: list, started: float) -> list[tuple[DecodeParams, object, bytes] | pb_utils.TritonError]:
        """Each request's (params, image, image bytes), or the error to answer it with (counted)."""
        parsed: list = []
        for request in requests:
            decoder = self.default_decoder
            try:
                if request.is_cancelled():
                    self.metrics.record_request(decoder, "cancelled", time.perf_counter() - started)
                    parsed.append(_error("request cancelled", pb_utils.TritonError.CANCELLED))
                    continue
                parsed.append(self._parse(request))
            except (protocol.RequestError, InvalidPageError) as exc:
                decoder = protocol.requested_decoder(request_input(request, protocol.DECODER_INPUT), decoder)
                self.metrics.record_request(decoder, "invalid", time.perf_counter() - started)
                parsed.append(_error(str(exc), pb_utils.TritonError.INVALID_ARG))
            except Exception as exc:
                self._log_failure("reading the request failed", exc)
                self.metrics.record_request(decoder, "error", time.perf_counter() - started)
                parsed.append(_error(f"reading the request failed: {exc}"))
        return parsed

    def _groups(self, parsed: list) -> list[list[int]]:
        """Which parsed requests decode together (equal parameters, no seed; see protocol.batch_groups)."""
        params = [entry[0] if isinstance(entry, tuple) else None for entry in parsed]
        modes = [entry[3] if isinstance(entry, tuple) else "page" for entry in parsed]
        return protocol.batch_groups(params, max(1, self.max_batch_size), modes)

    def _infer_batch(self, requests: list) -> list[pb_utils.InferenceResponse]:
        """Answer every request of one (dynamically batched) execute, in order.

        Requests with equal parameters are decoded together by one engine call (one forward per
        step for all their pages); a bad request is answered with its error and never fails the
        others. Each page's latency runs from the start of this execute to its batch's end.
        """
        started = time.perf_counter()
        parsed = self._parse_all(requests, started)
        responses = [None if isinstance(entry, tuple) else pb_utils.InferenceResponse(error=entry) for entry in parsed]
        for group in self._groups(parsed):
            params = parsed[group[0]][0]
            group_metrics = self.metrics.of_request(all(parsed[i][4] for i in group))
            group_metrics.record_batch(params.decoder, len(group))
            try:
                results = self._read([parsed[i][1] for i in group], params, parsed[group[0]][3], record=group_metrics)
            except Exception as exc:
                self._log_failure("decoding failed", exc)
                for i in group:
                    self._metrics_of(parsed[i]).record_request(params.decoder, "error", time.perf_counter() - started)
                    responses[i] = pb_utils.InferenceResponse(
                        error=_error(f"decoding failed: {type(exc).__name__}: {exc}"))
                continue
            latency = time.perf_counter() - started
            for i, result in zip(group, results, strict=True):
                responses[i] = self._page_response(result, params, parsed[i][2], latency, batch_size=len(group),
                                                   probe=parsed[i][4])
        return responses

    def _lead(self) -> tuple[int, ...]:
        """A batching model's outputs carry the batch dimension (one page per request)."""
        return (1,) if self.max_batch_size > 0 else ()

    def _page_response(self, result, params: DecodeParams, image_bytes: bytes, latency: float,
                       batch_size: int, probe: bool = False) -> pb_utils.InferenceResponse:
        self._record_answered(params, result.stats, text=result.text, finished=result.finished,
                              truncated=result.truncated, image_bytes=image_bytes, latency=latency,
                              elements=served_elements(result.parse), probe=probe)
        payload = protocol.result_stats(result, params, self.model_info, latency) | {"batch_size": batch_size}
        lead = self._lead()
        return pb_utils.InferenceResponse(output_tensors=[
            _tensor(protocol.TEXT_OUTPUT, protocol.as_object_array([result.text]).reshape(*lead, 1)),
            _tensor(protocol.TOKEN_IDS_OUTPUT, np.asarray(result.token_ids, dtype=np.int64).reshape(*lead, -1)),
            _tensor(protocol.STATS_OUTPUT, protocol.as_object_array([protocol.to_json(payload)]).reshape(*lead, 1)),
        ])

    def _commit_response(self, event: CommitEvent) -> pb_utils.InferenceResponse:
        lead = self._lead()
        return pb_utils.InferenceResponse(output_tensors=[
            _tensor(protocol.TEXT_OUTPUT, protocol.as_object_array([event.text]).reshape(*lead, 1)),
            _tensor(protocol.TOKEN_IDS_OUTPUT, np.asarray(event.token_ids, dtype=np.int64).reshape(*lead, -1)),
            _tensor(protocol.CONFIDENCES_OUTPUT, np.asarray(event.confidences, dtype=np.float32).reshape(*lead, -1)),
            _tensor(protocol.FORWARD_PASS_OUTPUT, np.asarray([event.forward_pass], dtype=np.int64).reshape(*lead, 1)),
            _tensor(protocol.STATS_OUTPUT, protocol.as_object_array([""]).reshape(*lead, 1)),
        ])

    def _final_response(self, accounting: protocol.StreamAccounting, payload: dict) -> pb_utils.InferenceResponse:
        lead = self._lead()
        return pb_utils.InferenceResponse(output_tensors=[
            _tensor(protocol.TEXT_OUTPUT, protocol.as_object_array([""]).reshape(*lead, 1)),
            _tensor(protocol.TOKEN_IDS_OUTPUT, np.zeros((*lead, 0), dtype=np.int64)),
            _tensor(protocol.CONFIDENCES_OUTPUT, np.zeros((*lead, 0), dtype=np.float32)),
            _tensor(protocol.FORWARD_PASS_OUTPUT, np.asarray([accounting.forward_passes], dtype=np.int64).reshape(*lead, 1)),
            _tensor(protocol.STATS_OUTPUT, protocol.as_object_array([protocol.to_json(payload)]).reshape(*lead, 1)),
        ])

    def _stream_batch(self, requests: list) -> None:
        """Stream each request's commits as they happen, decoding equal-parameter requests together."""
        started = time.perf_counter()
        parsed = self._parse_all(requests, started)
        for request, entry in zip(requests, parsed, strict=True):
            if not isinstance(entry, tuple):
                request.get_response_sender().send(pb_utils.InferenceResponse(error=entry), flags=FINAL)
        for group in self._groups(parsed):
            group_requests = [requests[i] for i in group]
            try:
                self._stream_group(group_requests, [parsed[i] for i in group], started)
            except Exception as exc:  # one group's failure must not leave the others' streams open
                self._log_failure("streaming a batch failed", exc)
                for request in group_requests:
                    with suppress(Exception):  # pages already closed refuse a second final
                        request.get_response_sender().send(
                            pb_utils.InferenceResponse(error=_error(f"internal error: {exc}")), flags=FINAL)

    def _stream_group(self, requests: list, parsed: list, started: float) -> None:
        """One engine stream for the group; each page's final response goes out as soon as it ends.

        A cancelled page is closed at once and its row leaves the engine's batch (no more
        forwards for it); the others go on.
        """
        params = parsed[0][0]
        group_metrics = self.metrics.of_request(all(entry[4] for entry in parsed))
        group_metrics.record_batch(params.decoder, len(requests))
        pages = [_StreamedPage(request.get_response_sender(), parsed=entry)
                 for request, entry in zip(requests, parsed, strict=True)]
        if parsed[0][3] == "elements":
            events = self._element_events(
                self._read([entry[1] for entry in parsed], params, "elements", record=group_metrics), pages)
        else:
            events = self.engine.stream([entry[1] for entry in parsed], params, cancelled=lambda row: pages[row].closed)
        try:
            for event in events:
                page = pages[event.row]
                if page.closed:
                    continue
                if page.sender.is_cancelled():
                    self._close_cancelled(page, params, started)
                else:
                    page.accounting.add(event)
                    page.text.append(event.text)
                    if event.token_ids:  # forwards that only decided (block decoding) send nothing
                        page.sender.send(self._commit_response(event))
                    if event.finished or event.truncated:
                        self._close_finished(page, params, parsed[event.row], started, len(pages))
                if all(other.closed for other in pages):
                    break
        except Exception as exc:
            self._log_failure("streamed decoding failed", exc)
            for page in pages:
                if not page.closed:
                    page.closed = True
                    self._metrics_of(page).record_request(params.decoder, "error", time.perf_counter() - started)
                    page.sender.send(pb_utils.InferenceResponse(
                        error=_error(f"decoding failed: {type(exc).__name__}: {exc}")), flags=FINAL)
        finally:
            events.close()  # stops the engine's loop: cancelled pages cost no more forwards
        for page, entry in zip(pages, parsed, strict=True):  # no last event for a page: close it, never hang
            if not page.closed:
                self._close_finished(page, params, entry, started, len(pages))

    def _element_events(self, results: list[DecodeResult], pages: list[_StreamedPage]) -> Iterator[CommitEvent]:
        """Element mode on the stream: once the pages are parsed, each page streams one event per
        decoded element in reading order, its markup followed by the blank line that joins
        elements; the last one is final."""
        for row, result in enumerate(results):
            pages[row].elements = served_elements(result.parse)
            decoded = [e for e in result.parse.decoded if e.markup.strip()]
            if not decoded:
                yield CommitEvent(row=row, token_ids=[], text="", confidences=[], forward_pass=0,
                                  finished=result.finished, truncated=result.truncated)
            forwards = 0
            for index, element in enumerate(decoded):
                last = index == len(decoded) - 1
                forwards += element.stats.forward_passes
                yield CommitEvent(row=row, token_ids=element.token_ids,
                                  text=element.markup + ("" if last else "\n\n"), confidences=element.confidences,
                                  forward_pass=forwards, decided=len(element.token_ids),
                                  finished=last and result.finished, truncated=last and result.truncated)

    def _close_cancelled(self, page: _StreamedPage, params: DecodeParams, started: float) -> None:
        page.closed = True
        metrics = self._metrics_of(page)
        self._record_decoding(metrics, params.decoder, page.accounting)
        metrics.record_request(params.decoder, "cancelled", time.perf_counter() - started)
        self.logger.log_info(f"{self.model_name}: request cancelled after {page.accounting.forward_passes} forwards")
        try:  # the client may be gone already; the final flag still releases the request
            page.sender.send(pb_utils.InferenceResponse(error=_error("request cancelled", pb_utils.TritonError.CANCELLED)),
                             flags=FINAL)
        except Exception as exc:
            self.logger.log_warn(f"{self.model_name}: could not close a cancelled request: {exc}")

    def _close_finished(self, page: _StreamedPage, params: DecodeParams, parsed: tuple, started: float,
                        batch_size: int) -> None:
        page.closed = True
        latency = time.perf_counter() - started
        accounting = page.accounting
        self._record_answered(params, accounting, text="".join(page.text), finished=accounting.finished,
                              truncated=accounting.truncated, image_bytes=parsed[2], latency=latency,
                              elements=page.elements, probe=parsed[4])
        payload = accounting.as_dict(params, self.model_info, latency, cancelled=False) | {"batch_size": batch_size}
        page.sender.send(self._final_response(accounting, payload), flags=FINAL)


def served_elements(parse: PageParse | None) -> list[dict]:
    """The request log's record of a two-stage parse: every element with a box, as served (page
    mode: none)."""
    if parse is None:
        return []
    return [{"category": e.category, "box": [round(float(v), 1) for v in e.box], "markup": e.markup,
             "confidence": round(float(e.confidence), 4)} for e in parse.elements if not e.error]


@dataclass
class _StreamedPage:
    """One streamed request inside a decoding group."""

    sender: object
    accounting: protocol.StreamAccounting = field(default_factory=protocol.StreamAccounting)
    text: list[str] = field(default_factory=list)
    closed: bool = False
    elements: list[dict] = field(default_factory=list)  # element mode: the served boxes, for the request log
    parsed: tuple | None = None  # (params, image, image bytes, mode, probe)
    started: float = 0.0  # when its execute began (latency counts from there)
    ticket: Ticket | None = None  # continuous batching: its place in the engine loop
    cancel_asked: bool = False  # continuous batching: the client went away, the row is being dropped


class _Responder:
    """One thread for every call into the stub made after ``execute`` returned, in submission order:
    the engine loop stays free of inter-process calls, and the stub sees them from one thread."""

    def __init__(self, logger, model_name: str):
        self.logger, self.model_name = logger, model_name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="responder", daemon=True)
        self._thread.start()

    def call(self, function) -> None:
        self._calls.put(function)

    def stop(self, timeout: float = FINALIZE_WAIT_S) -> None:
        self._calls.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (function := self._calls.get()) is not None:
            try:
                function()
            except Exception as exc:  # one failed answer must not stop the others'
                self.logger.log_error(f"{self.model_name}: responder: {exc}\n{traceback.format_exc()}")
