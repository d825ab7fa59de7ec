"""Prometheus metrics the Triton backend reports next to Triton's own ``nv_inference_*`` metrics.

The backend creates them with ``pb_utils.MetricFamily`` so they are served by Triton's metrics
endpoint (no second exporter, no extra port). Every series carries ``model`` (the Triton model)
and ``decoder`` (ar / sdb / block / ppc) labels, so dashboards compare decoders directly, plus
``model_version`` (the registered version served) and ``load`` (one id per loaded instance).

``load`` is not decoration. Triton's metric families are process-wide and prometheus-cpp hands
out *one* metric per (family, label set): a reloaded model's new instance, loaded while the old one
still serves, would share the old instance's metric objects, and the old instance's ``finalize``
frees them, so the new instance's next observation writes freed memory and the server dies with
``Signal (11)`` (reproduced by reloading under traffic). A label unique to each load keeps every
instance's metrics its own; dashboards sum over ``load`` (counters restart at a reload, as they
would at a server restart):

- ``docmarkup_request_latency_seconds``  histogram, wall time of one page request;
- ``docmarkup_tokens_per_forward``       histogram, per request: new tokens / forward passes;
- ``docmarkup_acceptance_length``        histogram, per forward pass: tokens committed by it;
- ``docmarkup_mean_confidence``          histogram, per request: mean confidence of committed tokens;
- ``docmarkup_batch_pages``               histogram, pages decoded together: per engine batch (closed
  batching), or per page the rows decoding when it ended (continuous batching);
- ``docmarkup_requests_total``           counter, by ``outcome`` (ok, truncated, invalid, cancelled, refused: busy, timeout, error);
- ``docmarkup_elements_total``           counter, element mode (``PARSE=elements``): elements by
  ``category`` and ``outcome`` (decoded, skipped, error);
- ``docmarkup_element_confidence``       histogram, element mode: mean confidence per decoded element, by ``category``;
- ``docmarkup_generated_tokens_total`` / ``docmarkup_forward_passes_total``  counters.

This module is plain Python: the ``pb_utils`` module is handed in by the backend, so the
definitions and the scrape parser are importable (and testable) outside Triton.
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    description: str
    kind: MetricKind
    buckets: tuple[float, ...] = ()


REQUEST_LATENCY = MetricSpec(
    "docmarkup_request_latency_seconds", "Wall time of one page request in the backend, in seconds.", "histogram",
    (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
TOKENS_PER_FORWARD = MetricSpec(
    "docmarkup_tokens_per_forward", "New tokens per decoder forward pass, one observation per request.", "histogram",
    (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0),
)
ACCEPTANCE_LENGTH = MetricSpec(
    "docmarkup_acceptance_length", "Tokens committed by one decoder forward pass.", "histogram",
    (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0),
)
MEAN_CONFIDENCE = MetricSpec(
    "docmarkup_mean_confidence", "Mean model confidence of the committed tokens, one observation per request.",
    "histogram", (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.999, 1.0),
)
BATCH_PAGES = MetricSpec(
    "docmarkup_batch_pages", "Pages decoded together in one engine batch, one observation per batch.", "histogram",
    (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
)
REQUESTS = MetricSpec("docmarkup_requests_total", "Page requests handled, by outcome.", "counter")
GENERATED_TOKENS = MetricSpec("docmarkup_generated_tokens_total", "Tokens generated.", "counter")
FORWARD_PASSES = MetricSpec("docmarkup_forward_passes_total", "Decoder forward passes run.", "counter")

ELEMENTS = MetricSpec("docmarkup_elements_total", "Page elements handled in element mode, by category and outcome.",
                      "counter")
ELEMENT_CONFIDENCE = MetricSpec(
    "docmarkup_element_confidence", "Mean confidence of one decoded element (element mode), by category.", "histogram",
    (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.999, 1.0),
)

ALL_METRICS = (REQUEST_LATENCY, TOKENS_PER_FORWARD, ACCEPTANCE_LENGTH, MEAN_CONFIDENCE, BATCH_PAGES, REQUESTS,
               GENERATED_TOKENS, FORWARD_PASSES, ELEMENTS, ELEMENT_CONFIDENCE)
ELEMENT_OUTCOMES = ("decoded", "skipped", "error")
OUTCOMES = ("ok", "truncated", "invalid", "cancelled", "refused", "timeout", "error")


class _Unobserved:
    """A metric that records nothing (what a probe's observations reach)."""

    def increment(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


_UNOBSERVED = _Unobserved()


class BackendMetrics:
    """The backend's metric families, with one metric per label set created on first use."""

    def __init__(self, pb_utils: Any, model_name: str, *, model_version: str = "unknown", load_id: str | None = None):
        self._pb_utils = pb_utils
        self._model_name = model_name
        self._instance_labels = {"model_version": model_version, "load": load_id or uuid.uuid4().hex[:12]}
        kinds = {
            "counter": pb_utils.MetricFamily.COUNTER,
            "gauge": pb_utils.MetricFamily.GAUGE,
            "histogram": pb_utils.MetricFamily.HISTOGRAM,
        }
        self._families = {
            spec.name: pb_utils.MetricFamily(name=spec.name, description=spec.description, kind=kinds[spec.kind])
            for spec in ALL_METRICS
        }
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._observing = True

    def of_request(self, probe: bool) -> BackendMetrics:
        """The metrics one request's observations go to: these, or for the platform's own probes a
        view that records nothing in any series (the one place probes are kept out of the metrics)."""
        if not probe:
            return self
        quiet = copy.copy(self)
        quiet._observing = False
        return quiet

    def _metric(self, spec: MetricSpec, **labels: str) -> Any:
        if not self._observing:
            return _UNOBSERVED
        full = {"model": self._model_name, **self._instance_labels, **labels}
        key = (spec.name, tuple(sorted(full.items())))
        metric = self._metrics.get(key)
        if metric is None:
            family = self._families[spec.name]
            if spec.kind == "histogram":
                metric = family.Metric(labels=full, buckets=list(spec.buckets))
            else:
                metric = family.Metric(labels=full)
            self._metrics[key] = metric
        return metric

    def record_request(self, decoder: str, outcome: str, latency_s: float) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        self._metric(REQUESTS, decoder=decoder, outcome=outcome).increment(1)
        self._metric(REQUEST_LATENCY, decoder=decoder).observe(latency_s)

    def record_decoding(self, decoder: str, *, new_tokens: int, forward_passes: int,
                        accepted_lengths: Iterable[int], mean_confidence: float | None) -> None:
        """Quality-of-acceleration metrics of one finished (or cancelled) decode."""
        if forward_passes > 0:
            self._metric(TOKENS_PER_FORWARD, decoder=decoder).observe(new_tokens / forward_passes)
        self._metric(GENERATED_TOKENS, decoder=decoder).increment(new_tokens)
        self._metric(FORWARD_PASSES, decoder=decoder).increment(forward_passes)
        acceptance = self._metric(ACCEPTANCE_LENGTH, decoder=decoder)
        for length in accepted_lengths:
            acceptance.observe(float(length))
        if mean_confidence is not None:
            self._metric(MEAN_CONFIDENCE, decoder=decoder).observe(float(mean_confidence))

    def record_element(self, decoder: str, category: str, outcome: str, confidence: float | None = None) -> None:
        """One element of a two-stage parse (``category`` is the layout's: a bounded set)."""
        if outcome not in ELEMENT_OUTCOMES:
            raise ValueError(f"unknown element outcome {outcome!r}; expected one of {ELEMENT_OUTCOMES}")
        self._metric(ELEMENTS, decoder=decoder, category=category, outcome=outcome).increment(1)
        if confidence is not None:
            self._metric(ELEMENT_CONFIDENCE, decoder=decoder, category=category).observe(float(confidence))

    def record_batch(self, decoder: str, pages: int) -> None:
        self._metric(BATCH_PAGES, decoder=decoder).observe(float(pages))

    def close(self) -> None:
        """Drop metrics before their families (Triton refuses the other order)."""
        self._metrics.clear()
        self._families.clear()


_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'(?P<key>[A-Za-z_][A-Za-z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus exposition text as ``{(sample name as exposed, labels): value}``.

    Hand-rolled on purpose: ``prometheus_client``'s parser renames counter samples (adds
    ``_total``), so names would not match what Triton and dashboards show.
    """
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if line.startswith("#") or match is None:
            continue
        labels = frozenset(
            (label["key"], re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], label["value"]))
            for label in _LABEL.finditer(match["labels"] or "")
        )
        samples[(match["name"], labels)] = float(match["value"])
    return samples


def sample_value(text_or_samples: str | Mapping, name: str, **labels: str) -> float | None:
    """The value of the one sample called ``name`` whose labels include ``labels`` (None if absent)."""
    samples = parse_samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    wanted = set(labels.items())
    matches = [value for (sample, sample_labels), value in samples.items() if sample == name and wanted <= sample_labels]
    if len(matches) > 1:
        raise ValueError(f"{len(matches)} samples of {name} match {labels}; be more specific")
    return matches[0] if matches else None
