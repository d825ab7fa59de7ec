"""The page store: page records in immutable Parquet shards, images addressed by content.

Why this layout: a corpus of millions of pages cannot live in one JSON-lines manifest that every
step parses whole and every change rewrites whole. Here a write only ever *adds* files:

``<root>/pages/part-<seq>-<token>.parquet``
    Immutable shards of at most ``shard_rows`` records (zstd Parquet, row groups of 1,024). An
    upsert writes the new versions of its pages into a new shard; an older shard that held a
    page now has a dead row. Newer shards win. Columns are read selectively, so a scan of ids or
    of hard pages never decodes markup.
``<root>/pages/_index.json``
    The commit point: the live shards in order, their row and dead-row counts, the next sequence
    number and the next first-appearance ordinal. Replaced atomically last, so a process killed
    mid-upsert leaves the previous version intact; a shard file it had written but not committed
    is invisible and deleted by the next writer.
``<root>/pages/.id-index.sqlite``
    A derived page id -> (shard, row, ordinal) index for lookups and for finding dead rows. It
    records the index generation it reflects and is rebuilt from the shards whenever that differs
    (after a crash, a ``dvc checkout``, or a copy), so it is never versioned.
``<root>/images/<ab>/<sha256>.png``
    Content-addressed: re-rendering the same page or linking it into a split stores no new bytes.

Parquet through ``pyarrow`` rather than Lance: the shards are plain files that DVC hashes and
pushes one by one (adding 1,000 pages adds one file), every tool in the stack reads them
(pandas, DuckDB, Spark, datasets), and pyarrow is already installed by MLflow.

Small shards left by small upserts are merged (a run of them at the tail) and a shard whose rows
are mostly dead is rewritten, so the number of files and the dead weight stay bounded while each
write's cost stays bounded by ``shard_rows``, whatever the size of the store.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image

from components.data.id_index import (
    generation_token,
    indexed_generation,
    locate,
    open_id_index,
    rebuild_id_index,
)
from components.data.page_records import RECORD_COLUMNS, SCHEMA, page_columns, pages_from_table
from components.data.pages import (
    IMAGES_DIR,
    LEGACY_MANIFEST,
    InvalidPageError,
    Page,
    atomic_write_text,
    load_image,
)

SHARDS_DIR = "pages"
INDEX_NAME = "_index.json"
ID_INDEX_NAME = ".id-index.sqlite"
LOCK_NAME = ".lock"
TRASH_DIR = ".trash"
# Never versioned (DVC ignore patterns): derived from the shards or transient.
DERIVED_PATTERNS = (f"{ID_INDEX_NAME}*", LOCK_NAME, f"{TRASH_DIR}/", ".*.tmp", ".token-cache/")
TRASH_SECONDS = 24 * 3600  # a scan reading an older snapshot finds replaced shards here that long
DEFAULT_SHARD_ROWS = 10_000
ROW_GROUP_ROWS = 1_024
FORMAT_VERSION = 1

_THREAD_LOCKS: dict[Path, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()
_HELD = threading.local()  # stores whose writer lock this thread holds


@dataclass(frozen=True)
class ShardInfo:
    name: str
    seq: int
    rows: int
    dead: int = 0

    @property
    def live(self) -> int:
        return self.rows - self.dead


class PageDataset:
    """A page store folder (see the module docstring). Cheap to open; nothing is read until asked."""

    def __init__(self, root: str | os.PathLike, *, shard_rows: int | None = None):
        """``shard_rows`` applies when this call creates the store; an existing store keeps its own."""
        if shard_rows is not None and shard_rows < 1:
            raise ValueError(f"shard_rows must be positive, got {shard_rows}")
        self.root = Path(root)
        self._new_shard_rows = shard_rows or DEFAULT_SHARD_ROWS

    # ----- layout ----------------------------------------------------------------------------
    @property
    def shards_dir(self) -> Path:
        return self.root / SHARDS_DIR

    @property
    def index_path(self) -> Path:
        return self.shards_dir / INDEX_NAME

    def exists(self) -> bool:
        return self.index_path.exists()

    def _require(self) -> dict:
        if not self.exists():
            hint = (f"; it holds a legacy {LEGACY_MANIFEST}: convert it with "
                    f"`python -m recipes.page_store migrate {self.root}`"
                    if (self.root / LEGACY_MANIFEST).exists() else "")
            raise FileNotFoundError(f"no page store at {self.root} (missing {SHARDS_DIR}/{INDEX_NAME}){hint}")
        return self._read_index()

    def _read_index(self) -> dict:
        """The committed index (``shard_rows`` filled in for stores made before it was recorded)."""
        if not self.index_path.exists():
            return {"format": FORMAT_VERSION, "generation": 0, "next_seq": 0, "next_ord": 0,
                    "shard_rows": self._new_shard_rows, "shards": []}
        index = json.loads(self.index_path.read_text(encoding="utf-8"))
        if index.get("format") != FORMAT_VERSION:
            raise InvalidPageError(f"{self.index_path} has format {index.get('format')!r}; this code reads {FORMAT_VERSION}")
        index.setdefault("shard_rows", DEFAULT_SHARD_ROWS)
        return index

    def shards(self) -> list[ShardInfo]:
        """The live shards, oldest first."""
        return [ShardInfo(**shard) for shard in self._require()["shards"]]

    def fingerprint(self) -> str:
        """A hash that changes with any change of the records (shard names are unique per content)."""
        index = self._require()
        names = "\n".join(f"{s['name']}:{s['dead']}" for s in index["shards"])
        return hashlib.sha256(names.encode()).hexdigest()

    def __len__(self) -> int:
        return sum(ShardInfo(**s).live for s in self._read_index()["shards"]) if self.exists() else 0

    # ----- the id index ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _id_index(self, index: dict) -> Iterator[sqlite3.Connection]:
        """A connection to the id index. If it reflects neither ``index`` nor the current index file
        (a crash between the two commits, a ``dvc checkout``, a copied folder), it is rebuilt
        from the shards under the writer lock; a reader with an older snapshot reads it as it is."""
        db = open_id_index(self.shards_dir / ID_INDEX_NAME)
        try:
            if indexed_generation(db) not in (generation_token(index), generation_token(self._read_index())):
                with self._writer():
                    current = self._read_index()
                    if indexed_generation(db) != generation_token(current):
                        rebuild_id_index(db, current, self._shard_path)
            yield db
        finally:
            db.close()

    # ----- reading ---------------------------------------------------------------------------
    def get(self, page_id: str) -> Page | None:
        """One page by id: an index lookup and one row group read."""
        return self.get_many([page_id]).get(page_id)

    def __contains__(self, page_id: object) -> bool:
        return isinstance(page_id, str) and page_id in self.shard_of([page_id])

    def get_many(self, page_ids: Iterable[str]) -> dict[str, Page]:
        wanted = list(dict.fromkeys(page_ids))
        if not wanted or not self.exists():
            return {}
        index = self._read_index()
        with self._id_index(index) as db:
            located = locate(db, wanted)
        by_group: dict[tuple[str, int], list[int]] = {}
        for shard, row, _ in located.values():
            by_group.setdefault((shard, row // ROW_GROUP_ROWS), []).append(row % ROW_GROUP_ROWS)
        found: dict[str, Page] = {}
        for (shard, group), rows in by_group.items():
            table = pq.ParquetFile(self._shard_path(shard)).read_row_group(group, columns=RECORD_COLUMNS)
            for page in pages_from_table(table.take(rows)):
                found[page.page_id] = page
        return {pid: found[pid] for pid in wanted if pid in found}

    def scan(self, columns: list[str] | None = None, filter: pc.Expression | None = None) -> Iterator[pa.Table]:
        """Live rows, one Arrow table per shard (storage order), reading only ``columns``."""
        index = self._require()
        names = list(dict.fromkeys(["page_id", *(columns or SCHEMA.names)]))
        with self._id_index(index) as db:
            for shard in index["shards"]:
                table = self._live(pq.read_table(self._shard_path(shard["name"]), columns=names, filters=filter), shard, db)
                if table.num_rows:
                    yield table

    @staticmethod
    def _live(table: pa.Table, shard: dict, db: sqlite3.Connection) -> pa.Table:
        """The rows of ``table`` (read from ``shard``) that no newer shard has replaced."""
        if not shard["dead"]:
            return table
        live = [pid for (pid,) in db.execute("SELECT page_id FROM ids WHERE shard = ?", (shard["name"],))]
        return table.filter(pc.is_in(table.column("page_id"), pa.array(live, pa.string())))

    def iter_pages(self, filter: pc.Expression | None = None, page_ids: Iterable[str] | None = None,
                   chunk: int = 256) -> Iterator[Page]:
        """Stream pages shard by shard (storage order; memory bounded by one shard), or the pages
        ``page_ids`` names in that order, fetched ``chunk`` at a time (missing ids are skipped)."""
        if page_ids is None:
            for table in self.scan(RECORD_COLUMNS, filter):
                yield from pages_from_table(table)
            return
        if filter is not None:
            raise ValueError("iter_pages takes a filter or page ids, not both")
        wanted = list(dict.fromkeys(page_ids))
        for start in range(0, len(wanted), chunk):
            yield from self.get_many(wanted[start : start + chunk]).values()

    def shard_pages(self, shard: ShardInfo | str, filter: pc.Expression | None = None) -> list[Page]:
        """The live pages of one shard (the unit a distributed curation task works on)."""
        return pages_from_table(self._shard_table(shard, RECORD_COLUMNS, filter))

    def _shard_table(self, shard: ShardInfo | str, columns: list[str], filter: pc.Expression | None = None) -> pa.Table:
        name = shard.name if isinstance(shard, ShardInfo) else shard
        index = self._require()
        entry = next((s for s in index["shards"] if s["name"] == name), None)
        if entry is None:
            raise KeyError(f"{name} is not a live shard of {self.root}")
        table = pq.read_table(self._shard_path(name), columns=list(dict.fromkeys(["page_id", *columns])), filters=filter)
        with self._id_index(index) as db:
            return self._live(table, entry, db)

    def shard_units(self, max_pages: int | None = None) -> list[dict]:
        """Work for per-shard tasks (pre-annotation, mining, evaluation): one unit per shard, so a
        task's memory is bounded by a shard. ``max_pages`` takes the first pages in order of
        arrival (a sample that stays the same across runs), grouped by the shard holding them."""
        if max_pages is None:
            return [{"shard": shard.name, "page_ids": None} for shard in self.shards()]
        ids = self.ids(limit=max_pages)
        located = self.shard_of(ids)
        by_shard: dict[str, list[str]] = {}
        for page_id in ids:
            by_shard.setdefault(located[page_id], []).append(page_id)
        return [{"shard": shard.name, "page_ids": by_shard[shard.name]} for shard in self.shards() if shard.name in by_shard]

    def unit_page_ids(self, unit: dict) -> list[str]:
        """The page ids of a :meth:`shard_units` unit."""
        if unit["page_ids"] is not None:
            return list(unit["page_ids"])
        return self._shard_table(unit["shard"], ["page_id"]).column("page_id").to_pylist()

    def unit_pages(self, unit: dict) -> list[Page]:
        """The pages of a :meth:`shard_units` unit (a whole shard is read in one pass)."""
        if unit["page_ids"] is None:
            return self.shard_pages(unit["shard"])
        return list(self.iter_pages(page_ids=unit["page_ids"]))

    def ids(self, limit: int | None = None) -> list[str]:
        """Every page id (or the first ``limit``), in order of first appearance."""
        if not self.exists():
            return []
        index = self._read_index()
        with self._id_index(index) as db:
            return [pid for (pid,) in db.execute("SELECT page_id FROM ids ORDER BY ord LIMIT ?", (-1 if limit is None else limit,))]

    def shard_of(self, page_ids: Iterable[str]) -> dict[str, str]:
        """The live shard holding each page (ids not in the store are left out)."""
        if not self.exists():
            return {}
        index = self._read_index()
        with self._id_index(index) as db:
            return {pid: shard for pid, (shard, _, _) in locate(db, list(page_ids)).items()}

    def pages(self) -> list[Page]:
        """Every page in order of first appearance. Holds the whole store in memory: for small
        stores and tests; large ones use :meth:`iter_pages`, :meth:`scan` or :meth:`shard_pages`."""
        self._require()
        tables = list(self.scan(RECORD_COLUMNS))
        if not tables:
            return []
        table = pa.concat_tables(tables)
        return pages_from_table(table.take(pc.sort_indices(table.column("ord"))))

    def __iter__(self) -> Iterator[Page]:
        return iter(self.pages())

    def export_jsonl(self, path: str | os.PathLike) -> int:
        """Write every page as one JSON line (interop), streaming; returns the count."""
        count = 0
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            for page in self.iter_pages():
                handle.write(json.dumps(page.to_json(), ensure_ascii=False) + "\n")
                count += 1
        os.replace(tmp, target)
        return count

    # ----- images ----------------------------------------------------------------------------
    def image_path(self, page: Page) -> Path:
        return self.root / page.image

    def load_image(self, page: Page) -> Image.Image:
        return load_image(self.image_path(page))

    def save_image(self, page_id: str, image: Image.Image) -> str:
        """Store an image as PNG under its content hash; returns the store-relative path.
        (``page_id`` is accepted for the callers' readability; the bytes decide the name.)"""
        del page_id
        return self.store_image(image)[0]

    def store_image(self, image: Image.Image) -> tuple[str, bool]:
        """:meth:`save_image`, also saying whether the file is new (an import rolling back may
        delete only the files it created: another page may share the bytes)."""
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        relative = f"{IMAGES_DIR}/{digest[:2]}/{digest}.png"
        target = self.root / relative
        if target.exists():
            return relative, False
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        return relative, True

    # ----- writing ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _writer(self) -> Iterator[None]:
        """One writer at a time, across threads (a lock) and processes (``flock``); re-entrant."""
        key = self.shards_dir.resolve()
        held = getattr(_HELD, "stores", set())
        if key in held:
            yield
            return
        self.shards_dir.mkdir(parents=True, exist_ok=True)
        with _THREAD_LOCKS_GUARD:
            thread_lock = _THREAD_LOCKS.setdefault(key, threading.Lock())
        with thread_lock, open(self.shards_dir / LOCK_NAME, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            _HELD.stores = held | {key}
            try:
                yield
            finally:
                _HELD.stores = held
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _write_shard(self, seq: int, table: pa.Table) -> ShardInfo:
        """Write a shard named by its sequence number and content hash (the same records written
        again give the same file, so rewriting an unchanged store changes nothing DVC sees)."""
        tmp = self.shards_dir / f".part-{seq:09d}-{secrets.token_hex(4)}.tmp"
        pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS, compression="zstd")
        digest = hashlib.sha256()
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        name = f"part-{seq:09d}-{digest.hexdigest()[:16]}.parquet"
        os.replace(tmp, self.shards_dir / name)
        return ShardInfo(name=name, seq=seq, rows=table.num_rows)

    def _commit(self, db: sqlite3.Connection, index: dict, shards: list[ShardInfo],
                id_rows: list[tuple[str, str, int, int]]) -> None:
        """Make ``shards`` the live set: index file first (the commit point), then the id index
        (``id_rows`` plus whatever the open transaction already holds)."""
        index = {**index, "generation": index["generation"] + 1, "token": secrets.token_hex(8),
                 "shards": [vars(s).copy() for s in shards]}
        atomic_write_text(self.index_path, json.dumps(index, indent=1) + "\n")
        with db:  # a crash before this commit only costs a rebuild (the generation differs)
            db.executemany("INSERT OR REPLACE INTO ids VALUES (?, ?, ?, ?)", id_rows)
            db.execute("INSERT OR REPLACE INTO state VALUES ('generation', ?)", (generation_token(index),))
        self._collect_garbage({s.name for s in shards})

    def _collect_garbage(self, live: set[str]) -> None:
        """Move replaced shards to ``.trash/`` (a scan that started before still finds them there)
        and empty it of shards replaced over :data:`TRASH_SECONDS` ago; drop uncommitted temp files."""
        trash = self.shards_dir / TRASH_DIR
        for path in self.shards_dir.glob("*.parquet"):
            if path.name not in live:
                trash.mkdir(exist_ok=True)
                os.replace(path, trash / path.name)
                os.utime(trash / path.name)
        for path in self.shards_dir.glob(".part-*.tmp"):
            path.unlink(missing_ok=True)
        if trash.exists():
            cutoff = time.time() - TRASH_SECONDS
            for path in trash.iterdir():
                if path.stat().st_mtime < cutoff:
                    path.unlink(missing_ok=True)

    def _shard_path(self, name: str) -> Path:
        path = self.shards_dir / name
        return path if path.exists() else self.shards_dir / TRASH_DIR / name

    def write(self, pages: Iterable[Page]) -> None:
        """Replace the whole store with ``pages`` (streamed into shards; one commit at the end).
        Memory is bounded by one shard: ids go to the id index's open transaction as each shard is
        written (readers keep seeing the committed store until the commit)."""
        with self._writer():
            index = self._read_index()
            with self._id_index(index) as db:
                seq, count, shards = 0, 0, []  # a full rewrite numbers its shards afresh
                buffer: list[Page] = []

                def flush() -> None:
                    nonlocal seq, count
                    ords = list(range(count, count + len(buffer)))
                    shard = self._write_shard(seq, page_columns(buffer, ords))
                    try:
                        db.executemany("INSERT INTO ids VALUES (?, ?, ?, ?)", (
                            (p.page_id, shard.name, row, o) for row, (p, o) in enumerate(zip(buffer, ords, strict=True))))
                    except sqlite3.IntegrityError as exc:
                        raise ValueError(f"a page id appears twice in one write of {self.root}: {exc}") from exc
                    shards.append(shard)
                    seq, count = seq + 1, count + len(buffer)
                    buffer.clear()

                try:
                    db.execute("DELETE FROM ids")
                    for page in pages:
                        buffer.append(page)
                        if len(buffer) >= index["shard_rows"]:
                            flush()
                    if buffer:
                        flush()
                except BaseException:
                    db.rollback()
                    raise
                if [s.name for s in shards] == [s["name"] for s in index["shards"]] and not any(s["dead"] for s in index["shards"]):
                    db.rollback()
                    return  # the same records as now: no new version
                self._commit(db, {**index, "next_seq": seq, "next_ord": count}, shards, [])

    def upsert(self, pages: Iterable[Page], compact: bool = True) -> None:
        """Insert or replace pages by ``page_id``. Writes only new shards (plus bounded compaction);
        a page keeps its first-appearance position. ``compact=False`` leaves every existing shard
        file in place (a caller still reading older shards of this store), until :meth:`compact`."""
        batch: dict[str, Page] = {}
        for page in pages:
            batch[page.page_id] = page
        if not batch:
            return
        with self._writer():
            index = self._read_index()
            with self._id_index(index) as db:
                located = locate(db, list(batch))
                dead: dict[str, int] = {}
                for shard, _, _ in located.values():
                    dead[shard] = dead.get(shard, 0) + 1
                shards = [ShardInfo(s["name"], s["seq"], s["rows"], s["dead"] + dead.get(s["name"], 0)) for s in index["shards"]]
                next_ord, seq, id_rows = index["next_ord"], index["next_seq"], []
                items = list(batch.values())
                for start in range(0, len(items), index["shard_rows"]):
                    chunk = items[start : start + index["shard_rows"]]
                    ords = []
                    for page in chunk:
                        if page.page_id in located:
                            ords.append(located[page.page_id][2])
                        else:
                            ords.append(next_ord)
                            next_ord += 1
                    shard = self._write_shard(seq, page_columns(chunk, ords))
                    seq += 1
                    shards.append(shard)
                    id_rows += [(p.page_id, shard.name, row, o) for row, (p, o) in enumerate(zip(chunk, ords, strict=True))]
                shards, moved = self._compact(db, shards, id_rows, index["shard_rows"]) if compact else (shards, id_rows)
                index = {**index, "next_seq": seq, "next_ord": next_ord}
                self._commit(db, index, shards, moved)

    def _compact(self, db: sqlite3.Connection, shards: list[ShardInfo], pending: list[tuple[str, str, int, int]],
                 limit: int) -> tuple[list[ShardInfo], list]:
        """Drop empty shards, rewrite mostly-dead ones, merge a tail run of small ones (into at most
        ``limit`` rows). A rewritten shard keeps the sequence position of what it replaces.

        ``pending`` holds the id rows of shards written by this commit (not yet in the id index);
        returns the shards and every id row to record."""
        pending_by_id = {row[0]: row for row in pending}

        def live_ids(shard: ShardInfo) -> set[str]:
            indexed = {pid for (pid,) in db.execute("SELECT page_id FROM ids WHERE shard = ?", (shard.name,))}
            return {pid for pid in indexed if pid not in pending_by_id or pending_by_id[pid][1] == shard.name} | \
                   {pid for pid, row in pending_by_id.items() if row[1] == shard.name}

        def rewrite(group: list[ShardInfo], new_seq: int) -> tuple[ShardInfo, list]:
            tables = []
            for shard in group:
                table = pq.read_table(self._shard_path(shard.name))
                if shard.dead:
                    table = table.filter(pc.is_in(table.column("page_id"), pa.array(sorted(live_ids(shard)), pa.string())))
                tables.append(table)
            merged = pa.concat_tables(tables)
            new = self._write_shard(new_seq, merged)
            ids, ords = merged.column("page_id").to_pylist(), merged.column("ord").to_pylist()
            return new, [(pid, new.name, row, o) for row, (pid, o) in enumerate(zip(ids, ords, strict=True))]

        rows_by_id = dict(pending_by_id)
        result: list[ShardInfo] = []
        for shard in shards:
            if shard.live == 0:
                continue
            if shard.dead * 2 > shard.rows:  # mostly dead: rewrite it in place (same sequence position)
                shard, rows = rewrite([shard], shard.seq)
                rows_by_id.update((row[0], row) for row in rows)
            result.append(shard)
        tail = 0
        while tail < len(result) and result[-1 - tail].live * 2 < limit:
            tail += 1
        if tail >= 4:  # merge the newest under-half-full shards into one of at most ``limit`` rows
            take, total = [], 0
            for shard in reversed(result[-tail:]):
                if take and total + shard.live > limit:
                    break
                take.insert(0, shard)
                total += shard.live
            if len(take) >= 2:
                merged, rows = rewrite(take, max(s.seq for s in take))
                result = [*result[: -len(take)], merged]
                rows_by_id.update((row[0], row) for row in rows)
        return result, list(rows_by_id.values())

    def compact(self) -> None:
        """Compaction on demand (also runs as part of every upsert)."""
        with self._writer():
            index = self._require()
            with self._id_index(index) as db:
                shards, rows = self._compact(db, [ShardInfo(**s) for s in index["shards"]], [], index["shard_rows"])
                self._commit(db, index, shards, rows)


def migrate_jsonl(root: str | os.PathLike, *, shard_rows: int | None = None, keep: bool = False) -> int:
    """Convert a legacy ``pages.jsonl`` folder in place; image files stay where they are.
    The old manifest is renamed to ``pages.jsonl.migrated`` (or kept with ``keep``)."""
    folder = Path(root)
    manifest = folder / LEGACY_MANIFEST
    if not manifest.exists():
        raise FileNotFoundError(f"{manifest} does not exist; nothing to migrate")
    store = PageDataset(folder, shard_rows=shard_rows)
    if store.exists():
        raise FileExistsError(f"{folder} already holds a page store; not overwriting it")

    def records() -> Iterator[Page]:
        with open(manifest, encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, 1):
                if line.strip():
                    try:
                        yield Page.from_json(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise InvalidPageError(f"{manifest}:{line_no} is not valid JSON: {exc}") from exc

    store.write(records())
    if not keep:
        os.replace(manifest, manifest.with_name(LEGACY_MANIFEST + ".migrated"))
    return len(store)
