"""The agent's on-disk state: a SQLite database (WAL) in the state directory.

- ``outbox``: every heartbeat batch and command report, in the order it was made. An item leaves
  only when the portal answered it with 2xx; while the portal is unreachable items stay, and they
  are sent oldest first when it comes back.
- ``dead_letter``: items the portal refused as bad (4xx other than 401), kept for a person to read.
- ``commands``: each command id seen, with its state and result: a repeated delivery of a command id
  is answered from here instead of running the command again.
- ``kv``: counters and flags (the heartbeat ``seq``, draining, each workload's log cursor).
- ``log_lines``: workload output waiting to be sent (``nodes.agent.logship``), bounded by the
  shipper. Lines get a batch number (``log_seq``) when a batch is first made of them, so a batch
  sent again is the same batch; they leave when the portal answered it.

One connection, used by one thread at a time (the agent's event loop).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    body TEXT NOT NULL,
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS dead_letter (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    body TEXT NOT NULL,
    created_at REAL NOT NULL,
    failed_at REAL NOT NULL,
    status_code INTEGER,
    error TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS commands (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL,
    result TEXT,
    message TEXT NOT NULL DEFAULT '',
    received_at REAL NOT NULL,
    finished_at REAL
);
CREATE TABLE IF NOT EXISTS log_lines (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    batch INTEGER,
    workload_id TEXT NOT NULL,
    at REAL NOT NULL,
    stream TEXT NOT NULL,
    text TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS log_lines_batch ON log_lines (batch);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

HEARTBEAT = "heartbeat"
REPORT = "report"


def _compact(value: Any) -> str:
    """JSON without spaces (orjson: a heartbeat of eighty samples is queued fifty times a second by
    a fleet process of the simulated fleet)."""
    return orjson.dumps(value).decode()


@dataclass
class OutboxItem:
    id: int
    kind: str
    key: str
    raw: str  # the body as stored: JSON, sent as it is
    created_at: float
    attempts: int

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.raw)


@dataclass
class CommandRecord:
    id: str
    kind: str
    payload: dict[str, Any]
    state: str  # accepted | succeeded | failed
    result: dict[str, Any] | None
    message: str

    @property
    def finished(self) -> bool:
        return self.state in ("succeeded", "failed")


class Buffer:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Made in one thread (where the Agent is built), used in another (its event loop); never
        # from two at once.
        self.db = sqlite3.connect(self.path, isolation_level=None, timeout=30, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        # False once a look found no workload output waiting and nothing was queued since: an idle
        # node's agent then skips the database each log interval. None: not known (look).
        self._logs_waiting: bool | None = None

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- key/value --------------------------------------------------------------------------------

    def get(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value))

    # -- outbox -----------------------------------------------------------------------------------

    def add_heartbeat(self, body: dict[str, Any]) -> int:
        """Number the batch with the next ``seq`` and queue it, in one transaction."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            seq = int(self.get("seq", "0") or 0) + 1
            self.set("seq", str(seq))
            body = {"seq": seq, **body}
            self._insert(HEARTBEAT, str(seq), body)
        return seq

    def add_report(self, command_id: str, body: dict[str, Any]) -> None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self._insert(REPORT, command_id, body)

    def _insert(self, kind: str, key: str, body: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT INTO outbox (kind, key, body, created_at) VALUES (?, ?, ?, ?)",
            (kind, key, _compact(body), time.time()),
        )

    def peek(self) -> OutboxItem | None:
        row = self.db.execute(
            "SELECT id, kind, key, body, created_at, attempts FROM outbox ORDER BY id LIMIT 1"
        ).fetchone()
        if row is None:
            return None
        return OutboxItem(row[0], row[1], row[2], row[3], row[4], row[5])

    def pending(self) -> list[OutboxItem]:
        rows = self.db.execute(
            "SELECT id, kind, key, body, created_at, attempts FROM outbox ORDER BY id"
        ).fetchall()
        return [OutboxItem(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]

    def count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]

    def has_pending_report(self, command_id: str) -> bool:
        row = self.db.execute("SELECT 1 FROM outbox WHERE kind = ? AND key = ? LIMIT 1", (REPORT, command_id))
        return row.fetchone() is not None

    def ack(self, item_id: int) -> None:
        # Not forced to disk (WAL with synchronous=NORMAL for this one commit; the next FULL commit
        # syncs it): after a power loss an item the portal already took may come back and be sent
        # again, which the portal answers as a duplicate (heartbeats by seq, reports by command id,
        # both idempotent). Saves one fsync per item sent; queueing an item stays FULL.
        self.db.execute("PRAGMA synchronous=NORMAL")
        try:
            self.db.execute("DELETE FROM outbox WHERE id = ?", (item_id,))
        finally:
            self.db.execute("PRAGMA synchronous=FULL")

    def note_failure(self, item_id: int, error: str) -> None:
        self.db.execute(
            "UPDATE outbox SET attempts = attempts + 1, last_error = ? WHERE id = ?", (error[:2000], item_id)
        )

    def dead_letter(self, item: OutboxItem, status_code: int | None, error: str) -> None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute(
                "INSERT INTO dead_letter (id, kind, key, body, created_at, failed_at, status_code, error) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    item.id,
                    item.kind,
                    item.key,
                    item.raw,
                    item.created_at,
                    time.time(),
                    status_code,
                    error[:4000],
                ),
            )
            self.db.execute("DELETE FROM outbox WHERE id = ?", (item.id,))

    def dead_letters(self) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT id, kind, key, body, status_code, error FROM dead_letter ORDER BY id"
        ).fetchall()
        return [
            {
                "id": r[0],
                "kind": r[1],
                "key": r[2],
                "body": json.loads(r[3]),
                "status_code": r[4],
                "error": r[5],
            }
            for r in rows
        ]

    def renumber_heartbeats(self) -> None:
        """A new node id (the portal forgot this node) starts its ``seq`` at 1 again: the batches
        still queued are renumbered in order."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            rows = self.db.execute(
                "SELECT id, body FROM outbox WHERE kind = ? ORDER BY id", (HEARTBEAT,)
            ).fetchall()
            for seq, (item_id, text) in enumerate(rows, start=1):
                body = json.loads(text)
                body["seq"] = seq
                self.db.execute(
                    "UPDATE outbox SET key = ?, body = ? WHERE id = ?",
                    (str(seq), _compact(body), item_id),
                )
            self.set("seq", str(len(rows)))

    # -- workload logs ----------------------------------------------------------------------------

    def log_count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM log_lines").fetchone()[0]

    def log_add(
        self, workload_id: str, lines: list[tuple[float, str, str]], cursor_key: str, cursor: str
    ) -> None:
        """Queue a workload's lines and move its cursor past them, in one transaction."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany(
                "INSERT INTO log_lines (workload_id, at, stream, text) VALUES (?, ?, ?, ?)",
                [(workload_id, at, stream, text) for at, stream, text in lines],
            )
            self.set(cursor_key, cursor)
        if lines:
            self._logs_waiting = True

    def log_batch(self, max_lines: int) -> tuple[int, str] | None:
        """``(seq, body)`` of the oldest batch not yet taken by the portal (made now from the
        oldest lines when none is open), or None when nothing waits."""
        if self._logs_waiting is False:
            return None
        row = self.db.execute("SELECT MIN(batch) FROM log_lines WHERE batch IS NOT NULL").fetchone()
        seq = row[0]
        if seq is None:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                first = self.db.execute("SELECT MIN(id) FROM log_lines").fetchone()[0]
                if first is None:
                    self._logs_waiting = False
                    return None
                seq = int(self.get("log_seq", "0") or 0) + 1
                self.set("log_seq", str(seq))
                self.db.execute(
                    "UPDATE log_lines SET batch = ? WHERE id IN "
                    "(SELECT id FROM log_lines WHERE batch IS NULL ORDER BY id LIMIT ?)",
                    (seq, max_lines),
                )
        rows = self.db.execute(
            "SELECT workload_id, at, stream, text FROM log_lines WHERE batch = ? ORDER BY id", (seq,)
        ).fetchall()
        workloads: dict[str, list[list[Any]]] = {}
        for workload_id, at, stream, text in rows:
            workloads.setdefault(workload_id, []).append([at, stream, text])
        body = {
            "seq": seq,
            "workloads": [{"workload_id": w, "lines": lines} for w, lines in workloads.items()],
        }
        return seq, _compact(body)

    def log_ack(self, seq: int) -> None:
        self.db.execute("DELETE FROM log_lines WHERE batch = ?", (seq,))

    def keys(self, prefix: str) -> list[str]:
        rows = self.db.execute("SELECT key FROM kv WHERE substr(key, 1, ?) = ?", (len(prefix), prefix))
        return [key for (key,) in rows.fetchall()]

    def delete(self, key: str) -> None:
        self.db.execute("DELETE FROM kv WHERE key = ?", (key,))

    # -- commands ---------------------------------------------------------------------------------

    def command(self, command_id: str) -> CommandRecord | None:
        row = self.db.execute(
            "SELECT id, kind, payload, state, result, message FROM commands WHERE id = ?", (command_id,)
        ).fetchone()
        if row is None:
            return None
        return CommandRecord(
            row[0], row[1], json.loads(row[2]), row[3], json.loads(row[4]) if row[4] else None, row[5]
        )

    def command_accepted(
        self, command_id: str, kind: str, payload: dict[str, Any], report: dict[str, Any]
    ) -> None:
        """Remember the command and queue its ``accepted`` report, in one transaction."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute(
                "INSERT OR IGNORE INTO commands (id, kind, payload, state, received_at) VALUES (?, ?, ?, ?, ?)",
                (command_id, kind, json.dumps(payload), "accepted", time.time()),
            )
            self._insert(REPORT, command_id, report)

    def command_finished(
        self, command_id: str, state: str, result: dict[str, Any], message: str, report: dict[str, Any]
    ) -> None:
        """Store the command's outcome and queue its final report, in one transaction."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute(
                "UPDATE commands SET state = ?, result = ?, message = ?, finished_at = ? WHERE id = ?",
                (state, json.dumps(result), message, time.time(), command_id),
            )
            self._insert(REPORT, command_id, report)

    def unfinished_commands(self) -> list[CommandRecord]:
        rows = self.db.execute(
            "SELECT id FROM commands WHERE state = 'accepted' ORDER BY received_at"
        ).fetchall()
        return [record for (cid,) in rows if (record := self.command(cid)) is not None]
