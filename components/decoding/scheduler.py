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

It is driven either by a caller (``step`` until ``idle``: tests, benchmarks) or by a background
thread (``start``/``stop``: the Triton backend's engine loop), with ``overlap_prefill`` a second
one that prefills waiting pages while the rows decode (a page's image encoder costs about as much
as 25 decoding steps of 8 rows on a CPU; in the loop it would stall them all). ``submit`` and
``cancel`` are thread-safe; the callbacks run on the engine loop's thread (a failed prefill's on
the prefill thread).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from PIL import Image

from components.decoding.batch import DecodeBatch, Prefill
from components.decoding.types import CommitEvent, DecodeParams, DecodeResult, RowState

DEFAULT_MAX_ROWS = 8


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests: the caller should refuse this one (busy)."""


class DeadlineExceededError(TimeoutError):
    """The page's own time limit (``submit(timeout_s=...)``) passed before it was decoded."""


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
    deadline: float | None = None  # perf_counter time after which the page is dropped, waiting or decoding
    bounded: bool = True  # a page admission counts; False: a piece (element crop, line) of an accepted page
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


@dataclass
class _Admission:
    """Tickets taken from the queue to join one batch together (one prefill call)."""

    key: DecodeParams
    tickets: list[Ticket]
    prompted: bool
    prefill: Prefill | None = None
    started: float = 0.0


class ContinuousScheduler:
    """A waiting queue over one engine, admitted into at most ``max_rows`` decoding rows.

    ``overlap_prefill``: the pages' prefill (their image encoder and prefix, the costly part of
    admitting a page) runs on a thread of its own while the engine loop keeps stepping the rows
    already decoding; a prefilled page joins at the next step. Without it, admitting a page stalls
    every row for its prefill. Only with ``start`` (the background engine loop).
    """

    def __init__(self, engine, max_rows: int = DEFAULT_MAX_ROWS, max_waiting: int | None = None,
                 overlap_prefill: bool = False):
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.engine, self.max_rows, self.max_waiting = engine, max_rows, max_waiting
        self.overlap_prefill = overlap_prefill
        self._waiting: deque[Ticket] = deque()
        self._reserved = 0  # rows taken from the queue, prefilling or prefilled, not yet joined
        self._ready: deque[_Admission] = deque()  # prefilled, waiting for the next step to join
        self._batches: dict[DecodeParams, DecodeBatch] = {}
        self._tickets: dict[int, Ticket] = {}  # decoding, by key
        self._keys = itertools.count()
        self._lock = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.steps = 0

    # ----- what callers do ---------------------------------------------------------------
    def submit(self, image: Image.Image, params: DecodeParams, prompt: str | None = None,
               on_event: Callable[[CommitEvent], None] | None = None,
               on_done: Callable[[Ticket], None] | None = None, bounded: bool = True,
               timeout_s: float | None = None) -> Ticket:
        """Queue one page. ``bounded``: refuse it (:class:`QueueFullError`) when ``max_waiting`` pages
        wait already; the pieces of a page that was accepted earlier (its element crops, its text
        lines) are neither refused nor counted as waiting pages.
        ``timeout_s``: the page's own limit; past it, it ends with :class:`DeadlineExceededError`,
        still waiting (it never starts) or decoding (its row leaves)."""
        with self._lock:
            if bounded and self.max_waiting is not None and self.waiting_pages >= self.max_waiting:
                raise QueueFullError(f"{self.waiting_pages} pages already wait for a decoding row")
            ticket = Ticket(next(self._keys), image, params, prompt, on_event, on_done, bounded=bounded)
            if timeout_s is not None:
                ticket.deadline = ticket.submitted + timeout_s
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
        """Everything queued for a row: pages and the pieces of accepted pages."""
        return len(self._waiting)

    @property
    def waiting_pages(self) -> int:
        """Queued pages that admission counts (the pieces of accepted pages are not pages)."""
        return sum(1 for ticket in self._waiting if ticket.bounded)

    @property
    def decoding(self) -> int:
        return sum(len(batch) for batch in list(self._batches.values()))

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._reserved and not self.decoding

    def run_until_idle(self) -> None:
        while not self.idle:
            self.step()

    # ----- the engine loop ---------------------------------------------------------------
    def step(self) -> None:
        """Admit what fits (prefilling it here, unless a prefill thread does), then one forward for
        each batch with rows."""
        if not self.overlap_prefill:
            for admission in self._take():
                self._prefill(admission)
        self._join_ready()
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
            retired = [row for row in rows if row.done]
            for row in retired:
                self._retire(row)
            if retired and self.overlap_prefill:
                with self._lock:
                    self._lock.notify_all()  # rows are free: the prefill thread may take waiting pages
        self.steps += 1

    def start(self) -> None:
        """Run the engine loop (and, with ``overlap_prefill``, the prefill thread) until :meth:`stop`."""
        if self._threads:
            return
        self._stopping = False
        loops = [("engine-loop", self._loop)] + ([("prefill", self._prefill_loop)] if self.overlap_prefill else [])
        for name, target in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loops after their current step; pages still waiting or decoding end with an error."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []
        with self._lock:
            stopped = CancelledError("the engine loop stopped")
            while self._waiting:
                self._finish(self._waiting.popleft(), error=stopped)
            while self._ready:
                for ticket in self._ready.popleft().tickets:
                    self._finish(ticket, error=stopped)
            self._reserved = 0
            for key, batch in list(self._batches.items()):
                self._fail_batch(key, batch, stopped)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._ready and not self.decoding and (
                        self.overlap_prefill or not self._waiting):
                    self._lock.wait()
                if self._stopping:
                    return
            self.step()

    def _prefill_loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._admissible():
                    self._lock.wait()
                if self._stopping:
                    return
            for admission in self._take():
                self._prefill(admission)
                with self._lock:
                    self._lock.notify_all()  # the engine loop may be waiting for rows

    # ----- internals ---------------------------------------------------------------------
    def _is_cancelled(self, key: int) -> bool:
        """Whether a row leaves now: its page was cancelled, or its deadline passed."""
        ticket = self._tickets.get(key)
        if ticket is None or ticket.cancelled:
            return True
        return ticket.deadline is not None and time.perf_counter() > ticket.deadline

    @staticmethod
    def _expired(ticket: Ticket, where: str) -> DeadlineExceededError:
        limit = ticket.deadline - ticket.submitted
        return DeadlineExceededError(f"page {ticket.key} timed out after {limit:.3g} s (its timeout) {where}")

    def _free_rows(self) -> int:
        return self.max_rows - self.decoding - self._reserved

    def _admissible(self) -> bool:
        return bool(self._waiting) and self._free_rows() > 0

    def _take(self) -> list[_Admission]:
        """Waiting tickets for the free rows, grouped into one prefill per batch (and prompt use)."""
        with self._lock:
            free = self._free_rows()
            groups: dict[tuple[DecodeParams, bool], _Admission] = {}
            held: deque[Ticket] = deque()
            now = time.perf_counter()
            for ticket in [t for t in self._waiting if t.deadline is not None and now > t.deadline]:
                self._waiting.remove(ticket)
                self._finish(ticket, error=self._expired(ticket, "waiting for a decoding row"))
            while self._waiting and free > 0:
                ticket = self._waiting.popleft()
                key = batch_key(ticket.params)
                batch = self._batches.get(key)
                if batch is not None and batch and not batch.joins_mid_batch:
                    held.append(ticket)  # this model's cache takes rows only into an empty batch
                    continue
                prompted = ticket.prompt is not None
                groups.setdefault((key, prompted), _Admission(key, [], prompted)).tickets.append(ticket)
                free -= 1
            self._waiting.extendleft(reversed(held))
            for admission in groups.values():
                self._reserved += len(admission.tickets)
                if admission.key not in self._batches:
                    self._batches[admission.key] = self.engine.new_batch(admission.key)
            return list(groups.values())

    def _prefill(self, admission: _Admission) -> None:
        """Prefill an admission's pages together; if that fails, each alone, so a bad page fails only itself."""
        batch = self._batches[admission.key]
        parts = [admission]
        admission.started = time.perf_counter()
        try:
            admission.prefill = self._run_prefill(batch, admission)
        except Exception as exc:
            if len(admission.tickets) == 1:
                self._drop(admission.tickets, exc)
                return
            parts = []
            for ticket in admission.tickets:
                alone = _Admission(admission.key, [ticket], admission.prompted, started=time.perf_counter())
                try:
                    alone.prefill = self._run_prefill(batch, alone)
                    parts.append(alone)
                except Exception as error:
                    self._drop([ticket], error)
        with self._lock:
            self._ready.extend(parts)

    @staticmethod
    def _run_prefill(batch: DecodeBatch, admission: _Admission) -> Prefill:
        return batch.prefill([t.image for t in admission.tickets],
                             [t.prompt for t in admission.tickets] if admission.prompted else None)

    def _drop(self, tickets: list[Ticket], error: BaseException) -> None:
        with self._lock:
            self._reserved -= len(tickets)
            for ticket in tickets:
                self._finish(ticket, error=error)

    def _join_ready(self) -> None:
        """Prefilled pages join their batches (a batch that takes rows only when empty waits)."""
        with self._lock:
            ready, waiting = list(self._ready), deque()
            self._ready.clear()
        for admission in ready:
            batch = self._batches[admission.key]
            if batch and not batch.joins_mid_batch:
                waiting.append(admission)
                continue
            live = [t for t in admission.tickets if not t.cancelled]
            rows = batch.join(admission.prefill, [t.key for t in admission.tickets],
                              [t.params.seed for t in admission.tickets], admission.started)
            with self._lock:
                self._reserved -= len(admission.tickets)
                for ticket, row in zip(admission.tickets, rows, strict=True):
                    ticket.admitted, ticket.row = admission.started, row
                    self._tickets[ticket.key] = ticket
            if len(live) < len(admission.tickets):  # cancelled while prefilling: leave at once
                for row in batch.cancel(self._is_cancelled):
                    self._retire(row)
        with self._lock:
            self._ready.extendleft(reversed(waiting))

    def _retire(self, row: RowState) -> None:
        ticket = self._tickets.pop(row.row, None)
        if ticket is None:
            return
        if ticket.cancelled:
            self._finish(ticket, error=CancelledError(f"page {ticket.key} cancelled"))
        elif row.cancelled:  # not by its caller: its deadline passed
            self._finish(ticket, error=self._expired(ticket, f"after {len(row.generated)} tokens"))
        else:
            self._finish(ticket, result=self.engine.result_of(row))

    def _fail_batch(self, key: DecodeParams, batch: DecodeBatch, exc: BaseException) -> None:
        for row in batch.active:
            ticket = self._tickets.pop(row.row, None)
            if ticket is not None:
                self._finish(ticket, error=exc)
        batch.active, batch.slots = [], None

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
