"""The local event queue: one SQLite file with a size cap; events stay until trimmed, uploads are marked."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edgellm.telemetry.events import FIELDS
from edgellm.telemetry.settings import telemetry_dir

_TYPES = {"ts": "REAL NOT NULL", "ttft_ms": "REAL", "prefill_tok_s": "REAL", "decode_tok_s": "REAL",
          "total_ms": "REAL", "peak_rss_mib": "REAL", "threads": "INTEGER", "prompt_tokens": "INTEGER",
          "cached_tokens": "INTEGER", "completion_tokens": "INTEGER"}
_SCHEMA = ("CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, "
           + ", ".join(f"{f} {_TYPES.get(f, 'TEXT')}" for f in FIELDS)
           + ", uploaded INTEGER NOT NULL DEFAULT 0)")


def db_path() -> Path:
    return telemetry_dir() / "events.db"


@contextlib.contextmanager
def connect(path: Path | None = None) -> Iterator[sqlite3.Connection]:
    path = path or db_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=5.0)
    try:
        conn.row_factory = sqlite3.Row
        conn.execute(_SCHEMA)
        yield conn
        conn.commit()
    finally:
        conn.close()


def insert(event: dict[str, Any], max_bytes: int) -> None:
    """Append one event; above ``max_bytes`` the oldest quarter of the events is dropped."""
    cols = [f for f in FIELDS if f in event]
    with connect() as conn:
        conn.execute(f"INSERT INTO events ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                     [event[c] for c in cols])
    if db_path().stat().st_size > max_bytes:
        trim()


def trim() -> None:
    with connect() as conn:
        (count,) = conn.execute("SELECT COUNT(*) FROM events").fetchone()
        conn.execute("DELETE FROM events WHERE id IN (SELECT id FROM events ORDER BY id LIMIT ?)", (max(1, count // 4),))
        conn.commit()
        conn.execute("VACUUM")


def query(since: float | None = None, *, pending_only: bool = False, limit: int | None = None) -> list[dict[str, Any]]:
    """Events (oldest first) as dicts with their ``id``; ``pending_only``: those not uploaded yet."""
    if not db_path().is_file():
        return []
    where, args = [], []
    if since is not None:
        where.append("ts >= ?")
        args.append(since)
    if pending_only:
        where.append("uploaded = 0")
    sql = "SELECT * FROM events" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY id"
    if limit:
        sql += f" LIMIT {int(limit)}"
    with connect() as conn:
        return [dict(row) for row in conn.execute(sql, args)]


def mark_uploaded(ids: list[int]) -> None:
    with connect() as conn:
        conn.executemany("UPDATE events SET uploaded = 1 WHERE id = ?", [(i,) for i in ids])


def stats() -> dict[str, int]:
    if not db_path().is_file():
        return {"events": 0, "pending_upload": 0, "bytes": 0}
    with connect() as conn:
        (n,) = conn.execute("SELECT COUNT(*) FROM events").fetchone()
        (pending,) = conn.execute("SELECT COUNT(*) FROM events WHERE uploaded = 0").fetchone()
    return {"events": n, "pending_upload": pending, "bytes": db_path().stat().st_size}
