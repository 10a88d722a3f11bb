"""Heartbeat ingest: the hot path. One transaction of two round trips per batch on PostgreSQL.

Per batch: one statement checks the node credential, locks the node row, inserts the (node, epoch,
seq) marker with ON CONFLICT DO NOTHING (a duplicate stops there and writes nothing) and reads the
node's GPUs; a gap is recorded or filled (rare); then the samples, the additive per-minute rollup
upsert, the GPUs' latest values and the node update go in one pipeline with the COMMIT (a batch
that changes a workload's state, fails a GPU or brings a node back runs that ORM work too, then
commits on its own). Rows go to PostgreSQL as one JSON document per statement
(``json_to_recordset``); the statement texts do not depend on the batch size, so they are prepared
(``DB_PREPARED_STATEMENTS``). No ORM object is built per sample. SQLite runs the same steps as
plain statements. The batch arrives parsed and checked (``nodes.services.heartbeat_parse``).
The newest batch's workloads that are starting or running are announced after the commit
(``workloads_reported``): scheduling's reaper stops those the node was not given.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from django.db import connection, transaction
from django.utils import timezone

from nodes import metrics as node_metrics
from nodes.models import (
    GpuHealth,
    Node,
    NodeState,
    NodeWorkloadStatus,
    SequenceGap,
    hash_secret,
)
from nodes.services.health import gpu_mark_unhealthy
from nodes.services.heartbeat_parse import (
    NO_WORKLOADS_DIGESTS,
    TERMINAL_WORKLOAD_STATES,
    HeartbeatData,
    IngestResult,
    Sample,
    WorkloadReport,
)
from nodes.services.registration import NotAuthenticated
from nodes.signals import node_ready, send_on_commit, workload_exited, workload_running, workloads_reported

logger = logging.getLogger(__name__)

# XID errors that mean lost or failing hardware (NVIDIA "XID Errors" guide): the GPU is isolated.
HARDWARE_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def _is_pg() -> bool:
    return connection.vendor == "postgresql"


def _db_dt(dt: datetime) -> Any:
    """A datetime as a raw-SQL parameter: aware for PostgreSQL, naive UTC text for SQLite."""
    if _is_pg():
        return dt
    return dt.astimezone(UTC).replace(tzinfo=None).isoformat(" ")


def _from_db_dt(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value if value is None or value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.fromisoformat(value).replace(tzinfo=UTC)


# The head of a batch, one statement on PostgreSQL: lock the node row (batches of one node are
# serialised), check the credential, insert the (node, epoch, seq) marker unless it is there (a
# duplicate, even a concurrent one, stops here having written nothing), and read the node's GPUs.
_HEAD_PG = """
WITH n AS (
    SELECT n.id, n.seq_epoch, n.last_seq, n.state, n.resume_state, n.workloads_digest, c.key_hash
    FROM nodes_node n JOIN nodes_nodecredential c ON c.node_id = n.id
    WHERE n.id = %(node)s FOR UPDATE OF n
), m AS (
    INSERT INTO nodes_heartbeatbatch (node_id, epoch, seq, received_at, sent_at, sample_count, out_of_order)
    SELECT n.id, n.seq_epoch, %(seq)s, %(now)s, %(sent)s, %(count)s, %(seq)s < n.last_seq
    FROM n WHERE n.key_hash = %(hash)s
    ON CONFLICT (node_id, epoch, seq) DO NOTHING RETURNING id
)
SELECT n.key_hash, n.seq_epoch, n.last_seq, n.state, n.resume_state, n.workloads_digest, (SELECT id FROM m),
       g.id, g.uuid, g.health, g.ecc_dbe_total, g.last_sample_at
FROM n LEFT JOIN nodes_gpu g ON g.node_id = n.id AND g.removed_at IS NULL
"""
_HEAD_SQLITE = (
    "SELECT c.key_hash, n.seq_epoch, n.last_seq, n.state, n.resume_state, n.workloads_digest, NULL, "
    "g.id, g.uuid, g.health, g.ecc_dbe_total, g.last_sample_at "
    "FROM nodes_node n JOIN nodes_nodecredential c ON c.node_id = n.id "
    "LEFT JOIN nodes_gpu g ON g.node_id = n.id AND g.removed_at IS NULL WHERE n.id = %s"
)
_MARKER_SQLITE = (
    "INSERT INTO nodes_heartbeatbatch (node_id, epoch, seq, received_at, sent_at, sample_count, out_of_order) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (node_id, epoch, seq) DO NOTHING RETURNING id"
)

_SAMPLE_COLUMNS = (
    "gpu_id, ts, util_pct, mem_used_mib, power_w, temp_c, sm_clock_mhz, ecc_sbe, ecc_dbe, "
    "throttle_reasons, xid_errors, processes"
)
# Constant statement texts (whatever the batch size), prepared after a few uses on a connection. The
# rows go as one JSON document each (dumped by orjson, parsed by PostgreSQL), which costs far less
# than adapting arrays of values one by one in Python.
_SAMPLES_PG = (
    f"INSERT INTO nodes_gpusample ({_SAMPLE_COLUMNS}) "
    "SELECT g, t, u, m, p, c, k, s, d, h, x, r FROM json_to_recordset(%s::json) AS v("
    "g bigint, t timestamptz, u float8, m int, p float8, c smallint, k int, s int, d int, h bigint, "
    "x jsonb, r jsonb)"
)
_SAMPLES_SQLITE = f"INSERT INTO nodes_gpusample ({_SAMPLE_COLUMNS}) VALUES ({', '.join(['%s'] * 12)})"

_ROLLUP_COLUMNS = (
    "gpu_id, minute, sample_count, util_sum, util_count, util_max, mem_used_sum, mem_used_count, "
    "mem_used_max, power_sum, power_count, temp_max"
)
# Additive, so late and replayed batches land in their minute; NULL gauges count nowhere.
_ROLLUP_UPDATE = (
    " ON CONFLICT (gpu_id, minute) DO UPDATE SET "
    "sample_count = r.sample_count + excluded.sample_count, "
    "util_sum = r.util_sum + excluded.util_sum, util_count = r.util_count + excluded.util_count, "
    "util_max = {max}(r.util_max, excluded.util_max), "
    "mem_used_sum = r.mem_used_sum + excluded.mem_used_sum, "
    "mem_used_count = r.mem_used_count + excluded.mem_used_count, "
    "mem_used_max = {max}(r.mem_used_max, excluded.mem_used_max), "
    "power_sum = r.power_sum + excluded.power_sum, power_count = r.power_count + excluded.power_count, "
    "temp_max = {max}(r.temp_max, excluded.temp_max)"
)
_ROLLUP_PG = (
    f"INSERT INTO nodes_gpuminuterollup AS r ({_ROLLUP_COLUMNS}) "
    "SELECT g, t, n, us, un, ux, ms, mn, mx, ps, pn, tx FROM json_to_recordset(%s::json) AS v("
    "g bigint, t timestamptz, n int, us float8, un int, ux float8, ms bigint, mn int, mx int, ps float8, "
    "pn int, tx smallint)" + _ROLLUP_UPDATE.format(max="GREATEST")  # GREATEST ignores NULLs
)
# SQLite's two-argument MAX is NULL when either is: take the other one then.
_ROLLUP_SQLITE = (
    f"INSERT INTO nodes_gpuminuterollup AS r ({_ROLLUP_COLUMNS}) VALUES {{values}}"
    + _ROLLUP_UPDATE.replace("{max}(r.", "MAX(COALESCE(r.")
    .replace(", excluded.util_max)", ", excluded.util_max), COALESCE(excluded.util_max, r.util_max))")
    .replace(
        ", excluded.mem_used_max)",
        ", excluded.mem_used_max), COALESCE(excluded.mem_used_max, r.mem_used_max))",
    )
    .replace(", excluded.temp_max)", ", excluded.temp_max), COALESCE(excluded.temp_max, r.temp_max))")
)
_GPU_LATEST_COLUMNS = (
    "last_sample_at = v.ts, last_util_pct = v.util, last_mem_used_mib = v.mem, last_power_w = v.power, "
    "last_temp_c = v.temp, last_sm_clock_mhz = v.clock, ecc_sbe_total = v.sbe, ecc_dbe_total = v.dbe"
)
# Only newer values replace the latest ones (a replayed batch is older): the guard is in SQL, so it
# holds against the row as it is now, whatever the batch read before it took the node's lock. The
# node's id leads the planner to the node's few GPUs by index: it cannot see how many rows the JSON
# holds (it assumes 100), and without it a prepared (generic) plan scans the whole GPU table.
_GPU_LATEST_PG = (
    f"UPDATE nodes_gpu AS g SET {_GPU_LATEST_COLUMNS} FROM json_to_recordset(%s::json) AS v("
    "id bigint, ts timestamptz, util float8, mem int, power float8, temp smallint, clock int, sbe bigint, "
    "dbe bigint) WHERE g.node_id = %s AND g.id = v.id AND (g.last_sample_at IS NULL OR g.last_sample_at <= v.ts)"
)
_GPU_LATEST_SQLITE = (
    "UPDATE nodes_gpu SET last_sample_at = %s, last_util_pct = %s, last_mem_used_mib = %s, last_power_w = %s, "
    "last_temp_c = %s, last_sm_clock_mhz = %s, ecc_sbe_total = %s, ecc_dbe_total = %s "
    "WHERE id = %s AND (last_sample_at IS NULL OR last_sample_at <= %s)"
)
_GPU_XIDS = "UPDATE nodes_gpu SET xid_count = xid_count + %s, last_xid = %s WHERE id = %s"


@dataclass(slots=True)
class _NodeRow:
    id: int
    seq_epoch: int
    last_seq: int
    state: str
    resume_state: str
    workloads_digest: str


def heartbeat_ingest(
    *, node_id: int, credential: str, batch: HeartbeatData, now: datetime | None = None
) -> IngestResult:
    """Store one heartbeat batch of the node that ``credential`` (``gpn_<node_id>_...``) opens.

    One transaction of two round trips on PostgreSQL whatever the batch size: the head statement
    (credential, node lock, marker, GPUs), then the writes (samples, rollups, GPUs' latest values,
    node) pipelined with the commit. A wrong credential raises NotAuthenticated and writes nothing.
    """
    now = now or timezone.now()
    pg = _is_pg()
    key_hash = hash_secret(credential)
    outermost = not connection.in_atomic_block
    with transaction.atomic():
        with connection.cursor() as cur:
            n, marker_id, gpus = _head(cur, node_id, key_hash, batch, now, pg)
            if marker_id is None:
                node_metrics.HEARTBEATS.labels(result="duplicate").inc()
                return IngestResult(status="duplicate")
            seq, last_seq = batch.seq, n.last_seq
            gap = _record_sequence(n.id, n.seq_epoch, seq, last_seq, now)
            written, ignored, newly_unhealthy, tail = _write_samples(n.id, gpus, batch.samples, pg)
            newest = seq > last_seq
            # The workload list changed: statuses to write (or, for a list now empty, to clear).
            relist = (
                newest
                and batch.workloads_digest != n.workloads_digest
                and (bool(batch.workloads) or n.workloads_digest not in NO_WORKLOADS_DIGESTS)
            )
            tail.append(_node_update(n, batch, newest, now, pg))
            if pg:
                # A batch with nothing more to write after these statements (the common one: no
                # workload change, no failing GPU, the node not coming back) sends its COMMIT in
                # the same round trip; Django's commit at the end of the block then finds no
                # transaction open and does nothing. Work added below must be counted in ``more``.
                more = relist or newly_unhealthy or n.state in (NodeState.SUSPECT, NodeState.DOWN)
                with connection.connection.pipeline():
                    for sql, params in tail:
                        cur.execute(sql, params)
                    if outermost and not more:
                        cur.execute("COMMIT")
            else:
                for sql, params in tail:
                    if params and isinstance(params[0], tuple):
                        cur.executemany(sql, params)
                    else:
                        cur.execute(sql, params)
        # Workload statuses from the newest batch only: a late batch's are out of date.
        if relist:
            _record_workloads(n.id, batch.workloads, now)
        if newest and batch.workloads:
            active = [w.workload_id for w in batch.workloads if w.state not in TERMINAL_WORKLOAD_STATES]
            if active:
                send_on_commit(workloads_reported, sender=Node, node_id=n.id, workload_ids=active)
        if n.state in (NodeState.SUSPECT, NodeState.DOWN) and not n.resume_state:  # back to READY
            send_on_commit(node_ready, sender=Node, node=Node.objects.get(pk=n.id))
        for gpu_id, reason in newly_unhealthy:
            gpu_mark_unhealthy(gpu_id=gpu_id, reason=reason, now=now)

    node_metrics.HEARTBEATS.labels(result="accepted").inc()
    node_metrics.SAMPLES.inc(written)
    if ignored:
        node_metrics.SAMPLES_IGNORED.inc(ignored)
    return IngestResult(status="accepted", gap=gap, samples=written, ignored_samples=ignored)


def _head(
    cur, node_id: int, key_hash: str, batch: HeartbeatData, now: datetime, pg: bool
) -> tuple[_NodeRow, int | None, dict[str, tuple]]:
    """Check the credential, lock the node, insert the marker. Returns the node, the marker id (None
    for a duplicate) and the node's GPUs by uuid: (id, uuid, health, ecc_dbe_total, last_sample_at)."""
    sent = _db_dt(batch.sent_at) if batch.sent_at else None
    if pg:
        cur.execute(
            _HEAD_PG,
            {"node": node_id, "seq": batch.seq, "now": now, "sent": sent, "count": len(batch.samples),
             "hash": key_hash},
        )  # fmt: skip
        rows = cur.fetchall()
    else:
        cur.execute(_HEAD_SQLITE, [node_id])
        rows = cur.fetchall()
    if not rows or not hmac.compare_digest(rows[0][0], key_hash):
        raise NotAuthenticated("Invalid node credential.")
    n = _NodeRow(node_id, *rows[0][1:6])
    marker_id = rows[0][6]
    if not pg:
        cur.execute(
            _MARKER_SQLITE,
            [node_id, n.seq_epoch, batch.seq, _db_dt(now), sent, len(batch.samples), batch.seq < n.last_seq],
        )
        row = cur.fetchone()
        marker_id = row[0] if row else None
    gpus = {r[8]: r[7:] for r in rows if r[7] is not None}
    return n, marker_id, gpus


def _node_update(
    n: _NodeRow, batch: HeartbeatData, newest: bool, now: datetime, pg: bool
) -> tuple[str, list]:
    sets, params = ["last_heartbeat_at = %s"], [_db_dt(now)]
    if newest:
        sets += ["last_seq = %s", "status = %s" + ("::jsonb" if pg else ""), "workloads_digest = %s"]
        params += [batch.seq, _dumps(batch.status), batch.workloads_digest]
        agent_version = batch.status.get("agent_version")
        if isinstance(agent_version, str) and agent_version:
            sets.append("agent_version = %s")
            params.append(agent_version[:32])
    if n.state in (NodeState.SUSPECT, NodeState.DOWN):
        sets += ["state = %s", "resume_state = %s", "state_reason = %s", "state_changed_at = %s"]
        params += [n.resume_state or NodeState.READY, "", "Heartbeats resumed.", _db_dt(now)]
    params.append(n.id)
    return f"UPDATE nodes_node SET {', '.join(sets)} WHERE id = %s", params


def _record_sequence(
    node_id: int, epoch: int, seq: int, last_seq: int, now: datetime
) -> tuple[int, int] | None:
    if seq > last_seq + 1:
        SequenceGap.objects.create(
            node_id=node_id, epoch=epoch, first_seq=last_seq + 1, last_seq=seq - 1, detected_at=now
        )
        node_metrics.GAPS.inc()
        return (last_seq + 1, seq - 1)
    if seq < last_seq:
        # A late batch: it fills (part of) a recorded gap.
        gap = (
            SequenceGap.objects.select_for_update()
            .filter(node_id=node_id, epoch=epoch, first_seq__lte=seq, last_seq__gte=seq)
            .first()
        )
        if gap is not None:
            if gap.first_seq == gap.last_seq:
                gap.delete()
            elif seq == gap.first_seq:
                SequenceGap.objects.filter(pk=gap.pk).update(
                    first_seq=seq + 1, filled_count=gap.filled_count + 1
                )
            elif seq == gap.last_seq:
                SequenceGap.objects.filter(pk=gap.pk).update(
                    last_seq=seq - 1, filled_count=gap.filled_count + 1
                )
            else:
                SequenceGap.objects.create(
                    node_id=node_id,
                    epoch=epoch,
                    first_seq=seq + 1,
                    last_seq=gap.last_seq,
                    detected_at=gap.detected_at,
                )
                SequenceGap.objects.filter(pk=gap.pk).update(
                    last_seq=seq - 1, filled_count=gap.filled_count + 1
                )
    return None


def _write_samples(node_id: int, gpus: dict[str, tuple], samples: list[Sample], pg: bool):
    """The statements that insert the samples, upsert the rollups and update the GPUs' latest values
    (run by the caller, pipelined with the node update). ``gpus`` maps uuid to
    (id, uuid, health, ecc_dbe_total, last_sample_at).

    Returns (written, ignored, [(gpu_id, reason)] for GPUs this batch shows failing, statements).
    """
    if not samples:
        return 0, 0, [], []
    rows: list[tuple] = []
    # (gpu_id, minute) -> [count, util_sum, util_n, util_max, mem_sum, mem_n, mem_max, power_sum,
    # power_n, temp_max]
    rollups: dict[tuple[int, datetime], list] = {}
    minutes: dict[datetime, datetime] = {}
    latest: dict[int, Sample] = {}
    xids_seen: dict[int, list[int]] = {}
    failing: dict[int, str] = {}
    ignored = 0
    append = rows.append
    for s in samples:
        g = gpus.get(s.gpu_uuid)
        if g is None:
            ignored += 1
            continue
        gid = g[0]
        ts = s.ts
        util, mem, power, temp = s.util_pct, s.mem_used_mib, s.power_w, s.temp_c
        append(
            (gid, ts, util, mem, power, temp, s.sm_clock_mhz, s.ecc_sbe, s.ecc_dbe, s.throttle_reasons,
             s.xid_errors or None, s.processes or None)
        )  # fmt: skip
        minute = minutes.get(ts)
        if minute is None:
            minute = minutes[ts] = ts.replace(second=0, microsecond=0)
        key = (gid, minute)
        r = rollups.get(key)
        if r is None:
            r = rollups[key] = [0, 0.0, 0, None, 0, 0, None, 0.0, 0, None]
        r[0] += 1
        if util is not None:
            r[1] += util
            r[2] += 1
            if r[3] is None or util > r[3]:
                r[3] = util
        if mem is not None:
            r[4] += mem
            r[5] += 1
            if r[6] is None or mem > r[6]:
                r[6] = mem
        if power is not None:
            r[7] += power
            r[8] += 1
        if temp is not None and (r[9] is None or temp > r[9]):
            r[9] = temp
        prev = latest.get(gid)
        if prev is None or ts >= prev.ts:
            latest[gid] = s
        if s.xid_errors:
            xids_seen.setdefault(gid, []).extend(s.xid_errors)
        if g[2] == GpuHealth.HEALTHY and gid not in failing:
            reason = _failure_reason(s, g[3])
            if reason:
                failing[gid] = reason
    if not rows:
        return 0, ignored, [], []

    tail: list[tuple[str, Any]] = []
    keys = sorted(rollups)  # a fixed order: concurrent upserts of one GPU lock rows alike
    if pg:
        names = ("g", "t", "u", "m", "p", "c", "k", "s", "d", "h", "x", "r")
        tail.append((_SAMPLES_PG, [_json_rows(names, rows)]))
        names = ("g", "t", "n", "us", "un", "ux", "ms", "mn", "mx", "ps", "pn", "tx")
        tail.append((_ROLLUP_PG, [_json_rows(names, [(*key, *rollups[key]) for key in keys])]))
    else:
        dumps = _dumps
        tail.append(
            (
                _SAMPLES_SQLITE,
                [
                    (
                        *r[:1],
                        _db_dt(r[1]),
                        *r[2:10],
                        dumps(r[10]) if r[10] else None,
                        dumps(r[11]) if r[11] else None,
                    )
                    for r in rows
                ],
            )
        )
        values = ", ".join(["(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"] * len(keys))
        params: list[Any] = []
        for gid, minute in keys:
            params.extend((gid, _db_dt(minute), *rollups[(gid, minute)]))
        tail.append((_ROLLUP_SQLITE.format(values=values), params))

    by_id = {g[0]: g for g in gpus.values()}
    fresh = []
    for gid, s in latest.items():
        prev_at = _from_db_dt(by_id[gid][4])
        if prev_at is not None and s.ts < prev_at:
            continue  # a late batch (buffer replay): the latest values stay
        fresh.append(
            (gid, s.ts, s.util_pct, s.mem_used_mib, s.power_w, s.temp_c, s.sm_clock_mhz, s.ecc_sbe, s.ecc_dbe)
        )
    if fresh:
        if pg:
            names = ("id", "ts", "util", "mem", "power", "temp", "clock", "sbe", "dbe")
            tail.append((_GPU_LATEST_PG, [_json_rows(names, fresh), node_id]))
        else:
            tail.append((_GPU_LATEST_SQLITE, [(*(_db_dt(f[1]),), *f[2:], f[0], _db_dt(f[1])) for f in fresh]))
    for gid, xids in xids_seen.items():
        tail.append((_GPU_XIDS, [len(xids), xids[-1], gid]))
    return len(rows), ignored, sorted(failing.items()), tail


def _json_rows(names: tuple[str, ...], rows: list[tuple]) -> str:
    """Rows as a JSON array of objects, for ``json_to_recordset`` (datetimes as RFC 3339)."""
    return orjson.dumps([dict(zip(names, row, strict=True)) for row in rows]).decode()


def _failure_reason(s: Sample, dbe_baseline: int) -> str:
    for x in s.xid_errors:
        if x in HARDWARE_XIDS:
            return f"XID {x}: {HARDWARE_XIDS[x]}"
    if s.ecc_dbe > dbe_baseline:
        return f"double-bit ECC errors ({s.ecc_dbe})"
    if s.fell_off_bus:
        return "GPU has fallen off the bus"
    if s.row_remap_failure:
        return "row remapping failure"
    if s.retired_pages_pending:
        return "retired pages pending (reset required)"
    return ""


def _record_workloads(node_id: int, reports: list[WorkloadReport], now: datetime) -> None:
    ids = [w.workload_id for w in reports]
    known = {
        w.workload_id: w for w in NodeWorkloadStatus.objects.filter(node_id=node_id, workload_id__in=ids)
    }
    create, update = [], []
    node = None
    for w in reports:
        row = known.get(w.workload_id)
        if row is not None and row.state == w.state and row.exit_code == w.exit_code:
            continue
        was_terminal = row is not None and row.state in TERMINAL_WORKLOAD_STATES
        if row is None:
            row = NodeWorkloadStatus(node_id=node_id, workload_id=w.workload_id)
            create.append(row)
        else:
            update.append(row)
        row.state, row.exit_code, row.message = w.state, w.exit_code, w.message
        row.started_at, row.finished_at, row.updated_at = w.started_at, w.finished_at, now
        if w.state in TERMINAL_WORKLOAD_STATES and not was_terminal:
            node = node or Node.objects.get(pk=node_id)
            send_on_commit(
                workload_exited,
                sender=Node,
                node=node,
                workload_id=w.workload_id,
                state=w.state,
                exit_code=w.exit_code,
                finished_at=w.finished_at or now,
                message=w.message,
            )
        elif w.state == "running":  # newly running (unchanged rows were skipped above)
            node = node or Node.objects.get(pk=node_id)
            send_on_commit(
                workload_running,
                sender=Node,
                node=node,
                workload_id=w.workload_id,
                started_at=w.started_at or now,
            )
    if create:
        NodeWorkloadStatus.objects.bulk_create(create)
    if update:
        NodeWorkloadStatus.objects.bulk_update(
            update, ["state", "exit_code", "message", "started_at", "finished_at", "updated_at"]
        )
    # What the node no longer lists is gone from it: a status row is what the node says now.
    NodeWorkloadStatus.objects.filter(node_id=node_id).exclude(workload_id__in=ids).delete()
