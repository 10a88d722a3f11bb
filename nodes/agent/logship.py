"""Workload output, from the runtime to the portal (``POST /agent/v1/nodes/<id>/logs``).

Every ``workload_log_interval_s`` the agent asks the runtime for each workload's new lines after
its cursor (``Runtime.output``: the container's log stream, the process's pipes, the simulated
runtime's lines), passes them through the workload's rate limit, and queues them in the on-disk
buffer (``buffer.log_lines``) with the new cursor in one transaction; then it sends the queued lines
in numbered batches, oldest first, each until the portal answers it.

- Rate limit, per workload: ``workload_log_lines_per_s`` lines and ``workload_log_bytes_per_s``
  bytes per second (token buckets holding ``workload_log_burst_s`` seconds of each). Lines past it
  are dropped, and in their place one stderr line says ``[gpupool] N lines dropped ...``, so the
  reader sees the gap.
- Bound and backpressure: the buffer holds at most ``workload_log_buffer_lines``. When the portal
  is away and it fills, the agent stops reading (cursors stay), so the output waits where the
  runtime keeps it (the process's files; the container's log, which the engine caps at
  ``LOG_MAX_SIZE`` x ``LOG_MAX_FILES``) and is read once batches leave.
- A line is cut to ``LINE_MAX_CHARS`` characters and NUL becomes U+FFFD (the portal stores text).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nodes.agent.buffer import Buffer
from nodes.agent.runtimes import OutputLine, Runtime, RuntimeFailure

LINE_MAX_CHARS = 4096  # the portal's WORKLOAD_LOG_LINE_MAX_CHARS
BATCH_MAX_LINES = 5000  # within the portal's WORKLOAD_LOG_BATCH_MAX_LINES
CURSOR_PREFIX = "logcursor:"


@dataclass(frozen=True)
class LogLimits:
    lines_per_s: float = 1000.0
    bytes_per_s: float = 1024 * 1024
    burst_s: float = 5.0
    buffer_lines: int = 200_000


class RateLimit:
    """Two token buckets (lines, bytes), full at the start."""

    def __init__(self, limits: LogLimits, now: float) -> None:
        self.limits = limits
        self.lines = limits.lines_per_s * limits.burst_s
        self.bytes = limits.bytes_per_s * limits.burst_s
        self.at = now
        self.dropped = 0

    def admit(self, size: int, now: float) -> bool:
        elapsed = max(0.0, now - self.at)
        self.at = now
        cap = self.limits.burst_s
        self.lines = min(self.limits.lines_per_s * cap, self.lines + elapsed * self.limits.lines_per_s)
        self.bytes = min(self.limits.bytes_per_s * cap, self.bytes + elapsed * self.limits.bytes_per_s)
        if self.lines >= 1 and self.bytes >= size:
            self.lines -= 1
            self.bytes -= size
            return True
        self.dropped += 1
        return False


def dropped_marker(count: int, limits: LogLimits) -> str:
    return (
        f"[gpupool] {count} lines dropped: this workload wrote faster than its limit of "
        f"{limits.lines_per_s:g} lines/s and {limits.bytes_per_s:g} bytes/s"
    )


def clean(text: str) -> str:
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    return text[:LINE_MAX_CHARS]


class LogShipper:
    """Reads workloads' output into the buffer (``collect``); the agent sends the batches."""

    def __init__(
        self,
        buffer: Buffer,
        runtime: Runtime,
        limits: LogLimits,
        clock: Callable[[], float] = time.time,
        log: Any = None,
    ) -> None:
        self.buffer = buffer
        self.runtime = runtime
        self.limits = limits
        self.clock = clock
        self.log = log
        self.rates: dict[str, RateLimit] = {}
        self.backpressured = 0  # reads skipped because the buffer was full
        self.dropped = 0  # lines dropped by the rate limits

    async def collect(self, workload_ids: list[str]) -> int:
        """Read every listed workload's new lines into the buffer; returns how many were queued.
        Cursors of workloads no longer listed are forgotten."""
        queued = 0
        for workload_id in workload_ids:
            queued += await self.collect_one(workload_id)
        listed = {CURSOR_PREFIX + w for w in workload_ids}
        for key in self.buffer.keys(CURSOR_PREFIX):
            if key not in listed:
                self.buffer.delete(key)
                self.rates.pop(key[len(CURSOR_PREFIX) :], None)
        return queued

    async def collect_one(self, workload_id: str) -> int:
        free = self.limits.buffer_lines - self.buffer.log_count()
        if free <= 1:  # one place kept for a dropped-lines marker
            self.backpressured += 1
            return 0
        key = CURSOR_PREFIX + workload_id
        stored = self.buffer.get(key, "{}") or "{}"
        cursor = json.loads(stored)
        try:
            if self.runtime.status_blocks:
                lines, cursor = await asyncio.to_thread(self.runtime.output, workload_id, cursor, free - 1)
            else:
                lines, cursor = self.runtime.output(workload_id, cursor, free - 1)
        except RuntimeFailure as exc:
            if self.log is not None:
                self.log.warning("reading the output of workload %s failed: %s", workload_id, exc)
            return 0
        out = self._limited(workload_id, lines)
        moved = json.dumps(cursor)
        if out or moved != stored:  # nothing new: no write (a fleet process runs a hundred agents)
            self.buffer.log_add(workload_id, out, key, moved)
        return len(out)

    def _limited(self, workload_id: str, lines: list[OutputLine]) -> list[OutputLine]:
        now = self.clock()
        rate = self.rates.get(workload_id)
        if rate is None:
            rate = self.rates[workload_id] = RateLimit(self.limits, now)
        out: list[OutputLine] = []
        for at, stream, text in lines:
            text = clean(text)
            if rate.admit(len(text.encode()) + 1, now):
                out.append((at, stream, text))
        if rate.dropped:
            out.append((now, "stderr", dropped_marker(rate.dropped, self.limits)))
            self.dropped += rate.dropped
            rate.dropped = 0
        return out
