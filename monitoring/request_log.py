"""The production request log: what served pages looked like, for drift checks and feedback.

Serving appends one JSON line per page (confidence, output length, decoder, latency, speed) and
keeps the page image of low-confidence requests, so they can go back to annotators. Appends are
single ``write`` calls on an ``O_APPEND`` file, so concurrent model instances never interleave
half lines; a torn last line after a crash is skipped by the reader.

Kept images are bounded: images older than ``image_retention_days`` go, then the oldest ones
until the folder holds at most ``max_image_mb``. Pruning runs when an image is kept (at most
once a minute per process) and from the monitoring flow; a pruned entry keeps its JSON line.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from components.services.process import VAR_DIR
from monitoring.suspect import review_reasons

DEFAULT_LOG_DIR = VAR_DIR / "production"


@dataclass
class ServedPage:
    page_id: str
    decoder: str
    mean_confidence: float
    new_tokens: int
    forward_passes: int
    latency_s: float
    truncated: bool
    text: str
    model_version: str = "unknown"
    timestamp: float = field(default_factory=time.time)
    image: str | None = None  # relative path of the stored image, for low-confidence pages
    # Element mode: each layout element as served ({category, box [x0, y0, x1, y1] in page pixels,
    # markup, confidence}), so a page sent back for review shows the served boxes; empty in page mode.
    elements: list[dict] = field(default_factory=list)


class RequestLog:
    """Append-only JSONL log plus an image folder for pages worth a second look (unsure, empty,
    truncated or looping outputs: :mod:`monitoring.suspect`)."""

    PRUNE_INTERVAL_S = 60.0

    def __init__(
        self, root: str | Path | None = None, keep_images_below: float = 0.9, max_image_mb: float = 1024.0,
        image_retention_days: float = 30.0,
    ):
        self.root = Path(root or os.environ.get("DOCMARKUP_REQUEST_LOG", DEFAULT_LOG_DIR))
        self.keep_images_below = keep_images_below
        self.max_image_bytes = int(max_image_mb * 1024 * 1024)
        self.retention_s = image_retention_days * 86400.0
        self._last_prune = 0.0

    def prune_images(self, now: float | None = None) -> list[Path]:
        """Delete kept images past retention, then the oldest until under the size cap."""
        now = time.time() if now is None else now
        self._last_prune = now
        folder = self.root / "images"
        if not folder.is_dir():
            return []
        files = []
        for path in folder.glob("*.png"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        removed = []
        for mtime, size, path in files:
            if now - mtime <= self.retention_s and total <= self.max_image_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            removed.append(path)
        return removed

    @property
    def path(self) -> Path:
        return self.root / "requests.jsonl"

    @staticmethod
    def page_id_for(image_bytes: bytes) -> str:
        return "prod-" + hashlib.sha256(image_bytes).hexdigest()[:16]

    def record(self, entry: ServedPage, image_bytes: bytes | None = None) -> ServedPage:
        self.root.mkdir(parents=True, exist_ok=True)
        if image_bytes is not None and review_reasons(entry.text, truncated=entry.truncated,
                                                      mean_confidence=entry.mean_confidence,
                                                      low_confidence=self.keep_images_below):
            relative = f"images/{entry.page_id}.png"
            target = self.root / relative
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_suffix(".tmp")
                tmp.write_bytes(image_bytes)
                os.replace(tmp, target)
            entry.image = relative
            if time.time() - self._last_prune >= self.PRUNE_INTERVAL_S:
                self.prune_images()
        line = (json.dumps(asdict(entry), ensure_ascii=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return entry

    def entries(self, since: float | None = None) -> list[ServedPage]:
        if not self.path.exists():
            return []
        entries = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                entry = ServedPage(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue  # a torn last line from a crash
            if since is None or entry.timestamp >= since:
                entries.append(entry)
        return entries

    def image_path(self, entry: ServedPage) -> Path | None:
        """The kept image of ``entry``; None if none was kept or it has been pruned since."""
        if not entry.image or not (self.root / entry.image).exists():
            return None
        return self.root / entry.image
