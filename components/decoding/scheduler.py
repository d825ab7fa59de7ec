"""Continuous batching: requests join the running batch at every step instead of waiting for it.

A closed batch (``DecodingEngine.generate``) decodes the pages it started with until the longest
ends; a page that arrives one step later waits for all of them. The :class:`ContinuousScheduler`
keeps a waiting queue instead: before every step it admits waiting requests into free rows
(their prefill, then they decode with the others), after every step it retires finished rows and
hands each request its new tokens. A row's tokens do not depend on when it joined
(:mod:`components.decoding.batch`), so serving this way returns what decoding the page alone does.

Requests of different decoding parameters (decoder, window, budget...) decode in separate batches,
stepped in turn. Models whose cache takes no rows mid-batch (the Hugging Face family adapters,
:class:`components.decoding.slots.DynamicSlots`) are admitted whenever their batch is empty.

It is driven either by a caller (``step`` until ``idle``: tests, benchmarks) or by one background
thread (``start``/``stop``: the Triton backend's engine loop); ``submit`` and ``cancel`` are
thread-safe, and the callbacks run on the engine loop's thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from PIL import Image

from components.decoding.batch import DecodeBatch
from components.decoding.types import CommitEvent, DecodeParams, DecodeResult, RowState

DEFAULT_MAX_ROWS = 8


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests: the caller should refuse this one (busy)."""


@dataclass
class Ticket:
    """One submitted page: its events as they come, then its result (or the error that ended it)."""

    key: int
    image: Image.Image
    params: DecodeParams
    prompt: str | None = None
    on_event: Callable[[CommitEvent], None] | None = None
    on_done: Callable[[Ticket], None] | None = None
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    result: DecodeResult | None = None
    error: BaseException | None = None
    cancelled: bool = False
    row: RowState | None = None  # its decoding row, once admitted
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> DecodeResult:
        """Block until the page is decoded; raises what ended it otherwise."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"page {self.key} not decoded within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def batch_key(params: DecodeParams) -> DecodeParams:
    """Rows share a batch when everything but their random seed agrees."""
    return replace(params, seed=None)


class ContinuousScheduler:
    """A waiting queue over one engine, admitted into at most ``max_rows`` decoding rows."""

    def __init__(self, engine, max_rows: int = DEFAULT_MAX_ROWS, max_waiting: int | None = None):
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.engine, self.max_rows, self.max_waiting = engine, max_rows, max_waiting
        self._waiting: deque[Ticket] = deque()
        self._batches: dict[DecodeParams, DecodeBatch] = {}
        self._tickets: dict[int, Ticket] = {}  # admitted, by key
        self._keys = itertools.count()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0

    # ----- what callers do ---------------------------------------------------------------
    def submit(self, image: Image.Image, params: DecodeParams, prompt: str | None = None,
               on_event: Callable[[CommitEvent], None] | None = None,
               on_done: Callable[[Ticket], None] | None = None, bounded: bool = True) -> Ticket:
        """Queue one page. ``bounded``: refuse it (:class:`QueueFullError`) when ``max_waiting`` pages
        wait already; the pieces of a page that was accepted earlier (its element crops) are not."""
        with self._lock:
            if bounded and self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise QueueFullError(f"{len(self._waiting)} pages already wait for a decoding row")
            ticket = Ticket(next(self._keys), image, params, prompt, on_event, on_done)
            self._waiting.append(ticket)
            self._lock.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Drop a page: waiting, it never starts; decoding, its row leaves after the current step."""
        with self._lock:
            ticket.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                self._finish(ticket, error=CancelledError(f"page {ticket.key} cancelled before it started"))

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def decoding(self) -> int:
        return sum(len(batch) for batch in self._batches.values())

    @property
    def idle(self) -> bool:
        return not self._waiting and not self.decoding

    def run_until_idle(self) -> None:
        while not self.idle:
            self.step()

    # ----- the engine loop ---------------------------------------------------------------
    def step(self) -> None:
        """Admit what fits, then one forward for each batch with rows."""
        self._admit()
        for key, batch in list(self._batches.items()):
            if not batch:
                continue
            rows = list(batch.active)
            try:
                events = batch.step()
            except Exception as exc:  # a failed forward ends its batch's pages, not the loop
                self._fail_batch(key, batch, exc)
                continue
            for event in events:
                ticket = self._tickets.get(event.row)
                if ticket is not None and ticket.on_event is not None and not ticket.cancelled:
                    ticket.on_event(event)
            batch.cancel(self._is_cancelled)  # a page cancelled meanwhile (or by its own callback) leaves now
            for row in rows:
                if row.done:
                    self._retire(row)
        self.steps += 1

    def start(self) -> None:
        """Run the engine loop on a background thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop after the current step; pages still waiting or decoding end with an error."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._lock:
            while self._waiting:
                self._finish(self._waiting.popleft(), error=CancelledError("the engine loop stopped"))
            for key, batch in list(self._batches.items()):
                self._fail_batch(key, batch, CancelledError("the engine loop stopped"))

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and self.idle:
                    self._lock.wait()
                if self._stopping:
                    return
            self.step()

    # ----- internals ---------------------------------------------------------------------
    def _is_cancelled(self, key: int) -> bool:
        ticket = self._tickets.get(key)
        return ticket is None or ticket.cancelled

    def _admit(self) -> None:
        with self._lock:
            free = self.max_rows - self.decoding
            admitted: dict[tuple[DecodeParams, bool], list[Ticket]] = {}
            held = deque()
            while self._waiting and free > 0:
                ticket = self._waiting.popleft()
                key = batch_key(ticket.params)
                batch = self._batches.get(key)
                if batch is not None and batch and not batch.joins_mid_batch:
                    held.append(ticket)  # this model's cache takes rows only into an empty batch
                    continue
                admitted.setdefault((key, ticket.prompt is not None), []).append(ticket)
                free -= 1
            self._waiting.extendleft(reversed(held))
        for (key, prompted), tickets in admitted.items():
            batch = self._batches.get(key)
            if batch is None:
                batch = self._batches[key] = self.engine.new_batch(key)
            started = time.perf_counter()
            try:
                rows = batch.admit([t.image for t in tickets], [t.key for t in tickets],
                                   [t.params.seed for t in tickets],
                                   prompts=[t.prompt for t in tickets] if prompted else None, started=started)
            except Exception as exc:  # a bad page (or a too-large window) fails its own request only
                if len(tickets) > 1:
                    for ticket in tickets:  # find which: admit them one by one
                        self._admit_one(batch, ticket, prompted)
                    continue
                self._finish(tickets[0], error=exc)
                continue
            for ticket, row in zip(tickets, rows, strict=True):
                ticket.admitted = started
                self._tickets[ticket.key] = ticket
                ticket.row = row

    def _admit_one(self, batch: DecodeBatch, ticket: Ticket, prompted: bool) -> None:
        started = time.perf_counter()
        try:
            [row] = batch.admit([ticket.image], [ticket.key], [ticket.params.seed],
                                prompts=[ticket.prompt] if prompted else None, started=started)
        except Exception as exc:
            self._finish(ticket, error=exc)
            return
        ticket.admitted = started
        self._tickets[ticket.key] = ticket
        ticket.row = row

    def _retire(self, row: RowState) -> None:
        ticket = self._tickets.pop(row.row, None)
        if ticket is None:
            return
        if row.cancelled or ticket.cancelled:
            self._finish(ticket, error=CancelledError(f"page {ticket.key} cancelled"))
        else:
            self._finish(ticket, result=self.engine.result_of(row))

    def _fail_batch(self, key: DecodeParams, batch: DecodeBatch, exc: BaseException) -> None:
        for row in batch.active:
            ticket = self._tickets.pop(row.row, None)
            if ticket is not None:
                self._finish(ticket, error=exc)
        self._batches.pop(key, None)

    def _finish(self, ticket: Ticket, result: DecodeResult | None = None, error: BaseException | None = None) -> None:
        ticket.result, ticket.error = result, error
        ticket.done.set()
        if ticket.on_done is not None:
            ticket.on_done(ticket)


class CancelledError(RuntimeError):
    """The page was cancelled (by its caller, or because the engine loop stopped)."""


class ScheduledEngine:
    """The engine seen through a running scheduler: ``generate`` queues every image and waits, so
    callers on other threads (a two-stage parse's element crops, the reader's text lines) decode in
    the shared continuous batch; everything else is the engine's own."""

    def __init__(self, scheduler: ContinuousScheduler, timeout: float | None = None):
        self.scheduler, self.timeout = scheduler, timeout

    def __getattr__(self, name: str):
        return getattr(self.scheduler.engine, name)

    def generate(self, images: list[Image.Image], params: DecodeParams | None = None,
                 prompts: list[str | None] | None = None) -> list[DecodeResult]:
        """What ``DecodingEngine.generate`` returns for the same call (each image's seed is the
        batch seed plus its index, as there)."""
        params = params or DecodeParams()
        if prompts is not None and len(prompts) != len(images):
            raise ValueError(f"{len(prompts)} task prompts for {len(images)} images")
        tickets = [self.scheduler.submit(image, replace(params, seed=None if params.seed is None else params.seed + i),
                                         prompt=None if prompts is None else prompts[i], bounded=False)
                   for i, image in enumerate(images)]
        return [ticket.wait(self.timeout) for ticket in tickets]
