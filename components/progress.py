"""Progress lines for steps that can take more than ~20 s: no silent minutes.

A step that loops over pages (pre-annotation, mining, an evaluation shard) or waits for something
(a service's start-up) reports what it has done, how long it took and when it should end, on the
first item, then at most every ``every_s`` seconds, and on the last item, so a log never goes quiet
for minutes and never floods either.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def duration(seconds: float) -> str:
    """``42s``, ``2m07s``, ``1h03m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """``[label] 5/16 pages, 42s, ETA 1m32s: <detail>`` lines for one step of known size.
    ``quiet_s``: no line before the step has run this long (a step of a few seconds stays silent)."""

    def __init__(self, label: str, total: int, unit: str = "pages", every_s: float = 10.0, quiet_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, out: Callable[[str], None] | None = None):
        self.label, self.total, self.unit, self.every_s, self.quiet_s = label, total, unit, every_s, quiet_s
        self.clock = clock
        self.out = out or (lambda line: print(line, flush=True))
        self.started = clock()
        self.done = 0
        self._last: float | None = None

    def update(self, detail: str = "", count: int = 1, always: bool = False) -> str | None:
        """Count ``count`` more items; the line printed, if this one was due (or ``always``)."""
        self.done += count
        now = self.clock()
        due = always or self._last is None or self.done >= self.total or now - self._last >= self.every_s
        if not due or (not always and now - self.started < self.quiet_s):
            return None
        self._last = now
        line = self.line(detail, now)
        self.out(line)
        return line

    def line(self, detail: str = "", now: float | None = None) -> str:
        elapsed = (self.clock() if now is None else now) - self.started
        left = elapsed / self.done * (self.total - self.done) if self.done else None
        eta = "done" if self.done >= self.total else "ETA ?" if left is None else f"ETA {duration(left)}"
        return (f"[{self.label}] {self.done}/{self.total} {self.unit}, {duration(elapsed)}, {eta}"
                + (f": {detail}" if detail else ""))


def waiting_line(what: str, elapsed_s: float, limit_s: float) -> str:
    """``[labelstudio] starting: 20s (gives up at 2m00s)`` for a wait of unknown length."""
    return f"[{what}] starting: {duration(elapsed_s)} (gives up at {duration(limit_s)})"
