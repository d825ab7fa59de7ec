"""The page store's derived page-id index (``<root>/pages/.id-index.sqlite``): page id -> (shard, row,
first-appearance ordinal), for lookups and for finding a shard's dead rows. It records the index
generation it reflects, so the store rebuilds it from the shards whenever that differs (after a
crash, a ``dvc checkout`` or a copy); it is never versioned."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

# Page ids per ``IN (...)`` query: under SQLite's bound-parameter limit.
LOOKUP_CHUNK = 900


def open_id_index(path: Path) -> sqlite3.Connection:
    """A connection to the index at ``path``, its tables created if new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=60)
    db.execute("CREATE TABLE IF NOT EXISTS ids (page_id TEXT PRIMARY KEY, shard TEXT NOT NULL, "
               "row INTEGER NOT NULL, ord INTEGER NOT NULL) WITHOUT ROWID")
    db.execute("CREATE INDEX IF NOT EXISTS ids_by_shard ON ids (shard)")
    db.execute("CREATE INDEX IF NOT EXISTS ids_by_ord ON ids (ord)")
    db.execute("CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT)")
    db.commit()
    return db


def indexed_generation(db: sqlite3.Connection) -> str | None:
    found = db.execute("SELECT value FROM state WHERE key = 'generation'").fetchone()
    return found[0] if found else None


def generation_token(index: dict) -> str:
    return f"{index['generation']}:{index.get('token', '')}"


def rebuild_id_index(db: sqlite3.Connection, index: dict, shard_path: Callable[[str], Path]) -> None:
    """Refill the index from the live shards of ``index`` (oldest first: a newer version wins)."""
    with db:
        db.execute("DELETE FROM ids")
        for shard in index["shards"]:
            table = pq.read_table(shard_path(shard["name"]), columns=["page_id", "ord"])
            ids, ords = table.column("page_id").to_pylist(), table.column("ord").to_pylist()
            db.executemany("INSERT OR REPLACE INTO ids VALUES (?, ?, ?, ?)",
                           ((pid, shard["name"], row, o) for row, (pid, o) in enumerate(zip(ids, ords, strict=True))))
        db.execute("INSERT OR REPLACE INTO state VALUES ('generation', ?)", (generation_token(index),))


def locate(db: sqlite3.Connection, page_ids: list[str]) -> dict[str, tuple[str, int, int]]:
    """page id -> (shard, row, ordinal) for the ids the index knows."""
    found: dict[str, tuple[str, int, int]] = {}
    for start in range(0, len(page_ids), LOOKUP_CHUNK):
        chunk = page_ids[start : start + LOOKUP_CHUNK]
        marks = ",".join("?" * len(chunk))
        for pid, shard, row, order in db.execute(f"SELECT page_id, shard, row, ord FROM ids WHERE page_id IN ({marks})", chunk):
            found[pid] = (shard, row, order)
    return found
