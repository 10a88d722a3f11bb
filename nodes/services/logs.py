"""Workload log batches from the agents (``POST /agent/v1/nodes/<id>/logs``, nodes/PROTOCOL.md).

nodes checks the wire format; where the lines go is the app that owns workloads (scheduling), which
registers its sink in its ``AppConfig.ready()``: nodes imports nothing above it.

A batch is ``{"seq": N, "workloads": [{"workload_id": "42", "lines": [[at, stream, text], ...]}]}``:
``at`` is seconds since the epoch (UTC; a time ahead of the portal's clock is taken as the portal's
time), ``stream`` is ``stdout`` or ``stderr``, ``text`` one line without its newline, at most
``WORKLOAD_LOG_LINE_MAX_CHARS`` characters and no NUL (the agent cuts and cleans lines).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from django.conf import settings

from nodes.validation import fail, require_object
from portal.errors import DomainError

STREAMS = frozenset({"stdout", "stderr"})
MAX_WORKLOADS_PER_BATCH = 1000
MAX_SEQ = 2**63 - 1


@dataclass(frozen=True)
class WorkloadLines:
    workload_id: str
    lines: list[tuple[datetime, str, str]]


@dataclass(frozen=True)
class LogBatch:
    seq: int
    workloads: list[WorkloadLines]

    @property
    def line_count(self) -> int:
        return sum(len(w.lines) for w in self.workloads)


@dataclass
class LogIngestResult:
    status: str  # accepted | duplicate
    lines: int = 0
    refused: dict[str, str] = field(default_factory=dict)  # workload id -> why
    written: list[int] = field(default_factory=list)  # ids of workloads that got lines


LogSink = Callable[..., LogIngestResult]
_sink: LogSink | None = None


class LogsUnavailable(DomainError):
    status_code = 503
    code = "unavailable"


def workload_logs_group(workload_id: int | str) -> str:
    """The channel-layer group that hears "lines were added" for one workload (its followers)."""
    return f"workload-logs.{workload_id}"


def log_sink_register(sink: LogSink) -> None:
    """Where accepted batches go: ``sink(node_id=..., batch=LogBatch, received_at=...)``."""
    global _sink
    _sink = sink


def node_logs_ingest(*, node_id: int, batch: LogBatch) -> LogIngestResult:
    if _sink is None:
        raise LogsUnavailable("No app stores workload logs on this portal.")
    return _sink(node_id=node_id, batch=batch, received_at=datetime.now(UTC))


def log_batch_parse(body: bytes, *, now: float) -> LogBatch:
    """The body as a :class:`LogBatch`, or ValidationFailed naming the first bad field."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise fail("body", "Not valid JSON (or nested more than 1024 levels deep).") from None
    data = require_object(data, "body")
    seq = data.get("seq")
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        raise fail("seq", "Expected a whole number of at least 1.")
    raw = data.get("workloads")
    if not isinstance(raw, list) or len(raw) > MAX_WORKLOADS_PER_BATCH:
        raise fail("workloads", f"Expected a list of at most {MAX_WORKLOADS_PER_BATCH} workloads.")
    max_chars = settings.WORKLOAD_LOG_LINE_MAX_CHARS
    max_lines = settings.WORKLOAD_LOG_BATCH_MAX_LINES
    total = 0
    out: list[WorkloadLines] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        item = require_object(item, f"workloads[{i}]")
        wid = item.get("workload_id")
        if not isinstance(wid, str) or not wid.isascii() or not wid.isdigit() or len(wid) > 19:
            raise fail(f"workloads[{i}].workload_id", "Expected a workload id (digits).")
        if wid in seen:
            raise fail(f"workloads[{i}].workload_id", "Listed twice.")
        seen.add(wid)
        lines = item.get("lines")
        if not isinstance(lines, list):
            raise fail(f"workloads[{i}].lines", "Expected a list of [at, stream, text].")
        total += len(lines)
        if total > max_lines:
            raise fail("workloads", f"At most {max_lines} lines in one batch.")
        out.append(WorkloadLines(wid, _lines(lines, i, now, max_chars)))
    return LogBatch(seq=seq, workloads=out)


def _lines(lines: list[Any], i: int, now: float, max_chars: int) -> list[tuple[datetime, str, str]]:
    parsed = []
    fromtimestamp = datetime.fromtimestamp
    for j, line in enumerate(lines):
        if type(line) is not list or len(line) != 3:
            raise fail(f"workloads[{i}].lines[{j}]", "Expected [at, stream, text].")
        at, stream, text = line
        if type(at) not in (int, float) or not math.isfinite(at) or at < 0:
            raise fail(f"workloads[{i}].lines[{j}].at", "Expected seconds since the epoch.")
        if type(stream) is not str or stream not in STREAMS:  # a list is not hashable: no 500
            raise fail(f"workloads[{i}].lines[{j}].stream", "Expected stdout or stderr.")
        if type(text) is not str or len(text) > max_chars:
            raise fail(f"workloads[{i}].lines[{j}].text", f"Expected text of at most {max_chars} characters.")
        if "\x00" in text:
            raise fail(f"workloads[{i}].lines[{j}].text", "NUL characters are not stored.")
        parsed.append((fromtimestamp(min(at, now), UTC), stream, text))
    return parsed
