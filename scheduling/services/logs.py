"""Workload logs: what the agents capture of each workload's stdout and stderr, kept per line.

The rule: a node may add lines only to workloads that were placed on it (an allocation of that
workload on that node, open or ended: the last lines of a finished job arrive after its end); lines
for any other workload are refused and not stored. A batch is stored once: its (node, seq) receipt
and its lines are one transaction, so a batch sent again is a duplicate that changes nothing.
Lines are kept for the retention of the tenant's service plan (``WORKLOAD_LOG_RETENTION_DAYS``)
and deleted by ``workload_logs_purge`` (Celery beat, hourly).

On PostgreSQL the lines go in with binary ``COPY ... FROM STDIN`` (psycopg 3's ``cursor.copy`` with
``set_types``): several times the rate of ``bulk_create`` for batches of thousands, and a fifth of
text ``COPY``'s CPU in this process (docs/performance.md); SQLite takes ``bulk_create``.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from nodes.services.logs import LogBatch, LogIngestResult
from scheduling.models import Allocation, WorkloadLogBatch, WorkloadLogLine

NOT_PLACED = "not placed on this node"


def workload_logs_ingest(*, node_id: int, batch: LogBatch, received_at: datetime) -> LogIngestResult:
    """Store a node's batch; answers ``duplicate`` for a seq already stored."""
    wanted = {int(w.workload_id) for w in batch.workloads if w.lines}
    placed = (
        set(
            Allocation.objects.filter(node_id=node_id, workload_id__in=wanted)
            .values_list("workload_id", flat=True)
            .distinct()
        )
        if wanted
        else set()
    )
    refused = {
        w.workload_id: NOT_PLACED for w in batch.workloads if w.lines and int(w.workload_id) not in placed
    }
    stored = [
        (int(w.workload_id), w.lines) for w in batch.workloads if w.lines and int(w.workload_id) in placed
    ]
    count = sum(len(lines) for _, lines in stored)
    try:
        with transaction.atomic():
            WorkloadLogBatch.objects.create(
                node_id=node_id, seq=batch.seq, received_at=received_at, lines=count
            )
            _insert(stored)
    except IntegrityError:
        if WorkloadLogBatch.objects.filter(node_id=node_id, seq=batch.seq).exists():
            return LogIngestResult(status="duplicate")
        raise
    written = sorted({workload_id for workload_id, _ in stored})
    return LogIngestResult(status="accepted", lines=count, refused=refused, written=written)


COPY_FIELDS = ("workload", "at", "stream", "text")


def _insert(stored: list[tuple[int, list[tuple[datetime, str, str]]]]) -> None:
    if not stored:
        return
    if connection.vendor == "postgresql":
        meta = WorkloadLogLine._meta
        fields = [meta.get_field(name) for name in COPY_FIELDS]
        columns = ", ".join(field.column for field in fields)
        # Binary COPY takes each column in its own type, named from the model ("varchar(6)" is
        # "varchar" to psycopg; the server still checks the length).
        types = [field.db_type(connection).partition("(")[0] for field in fields]
        with (
            connection.cursor() as cursor,
            cursor.copy(f"COPY {meta.db_table} ({columns}) FROM STDIN (FORMAT BINARY)") as copy,
        ):
            copy.set_types(types)
            write_row = copy.write_row
            for workload_id, lines in stored:
                for at, stream, text in lines:
                    write_row((workload_id, at, stream, text))
        return
    WorkloadLogLine.objects.bulk_create(
        [
            WorkloadLogLine(workload_id=workload_id, at=at, stream=stream, text=text)
            for workload_id, lines in stored
            for at, stream, text in lines
        ],
        batch_size=500,
    )


def workload_logs_purge(*, now: datetime | None = None) -> dict[str, int]:
    """Delete lines past their tenant's plan's retention, and batch receipts past the longest
    retention (a node never sends a batch again after that long). Safe to run twice."""
    now = now or timezone.now()
    lines = 0
    for plan, days in settings.WORKLOAD_LOG_RETENTION_DAYS.items():
        cutoff = now - timedelta(days=days)
        lines += WorkloadLogLine.objects.filter(workload__tenant__service_plan=plan, at__lt=cutoff).delete()[
            0
        ]
    longest = max(settings.WORKLOAD_LOG_RETENTION_DAYS.values())
    batches = WorkloadLogBatch.objects.filter(received_at__lt=now - timedelta(days=longest)).delete()[0]
    return {"lines": lines, "batches": batches}
