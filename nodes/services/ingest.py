"""Heartbeat ingest: the hot path. One transaction of three round trips per batch on PostgreSQL.

Per batch: one statement checks the node credential, locks the node row, inserts the (node, epoch,
seq) marker with ON CONFLICT DO NOTHING (a duplicate stops there and writes nothing) and reads the
node's GPUs; a gap is recorded or filled (rare); then the samples, the additive per-minute rollup
upsert, the GPUs' latest values and the node update go in one pipeline (a batch that changes a
workload's state, fails a GPU or brings a node back runs that ORM work too); Django's atomic block
commits. The statements are raw SQL on purpose (set-based, whatever the batch size), with the
tables and columns of the models (``_statements``). Rows go to PostgreSQL as one JSON document per statement
(``json_to_recordset``); the statement texts do not depend on the batch size, so they are prepared
(``DB_PREPARED_STATEMENTS``). No ORM object is built per sample. SQLite runs the same steps as
plain statements. The batch arrives parsed and checked (``nodes.services.heartbeat_parse``).
The newest batch's workloads that are starting or running are announced after the commit
(``workloads_reported``): scheduling's reaper stops those the node was not given.
"""

from __future__ import annotations

import functools
import hmac
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import orjson
from django.db import connection, transaction
from django.utils import timezone

from nodes import metrics as node_metrics
from nodes.locks import lock_sequence_gap
from nodes.models import (
    Gpu,
    GpuHealth,
    GpuMinuteRollup,
    GpuSample,
    HeartbeatBatch,
    Node,
    NodeCredential,
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
from nodes.signals import (
    node_ready,
    send_on_commit,
    volumes_measured,
    workload_exited,
    workload_running,
    workloads_reported,
)

logger = logging.getLogger(__name__)

# XID errors that mean lost or failing hardware (NVIDIA "XID Errors" guide): the GPU is isolated.
_AGENT_VERSION_MAX = Node._meta.get_field("agent_version").max_length

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


# The JSON rows of the PostgreSQL statements: (model field, key in the JSON row, PostgreSQL type).
# Short keys keep the documents small; the column names come from the models (``_statements``).
_SAMPLE_SHAPE = (
    ("gpu", "g", "bigint"), ("ts", "t", "timestamptz"), ("util_pct", "u", "float8"),
    ("mem_used_mib", "m", "int"), ("power_w", "p", "float8"), ("temp_c", "c", "smallint"),
    ("sm_clock_mhz", "k", "int"), ("ecc_sbe", "s", "int"), ("ecc_dbe", "d", "int"),
    ("throttle_reasons", "h", "bigint"), ("xid_errors", "x", "jsonb"), ("processes", "r", "jsonb"),
)  # fmt: skip
_ROLLUP_SHAPE = (
    ("gpu", "g", "bigint"), ("minute", "t", "timestamptz"), ("sample_count", "n", "int"),
    ("util_sum", "us", "float8"), ("util_count", "un", "int"), ("util_max", "ux", "float8"),
    ("mem_used_sum", "ms", "bigint"), ("mem_used_count", "mn", "int"), ("mem_used_max", "mx", "int"),
    ("power_sum", "ps", "float8"), ("power_count", "pn", "int"), ("temp_max", "tx", "smallint"),
)  # fmt: skip
# The rollup's maxima; its other fields after (gpu, minute) are summed on conflict.
_ROLLUP_MAX = ("util_max", "mem_used_max", "temp_max")
# A GPU's latest values: the GPU's id, then each field and the reading's value that sets it.
_GPU_LATEST_SHAPE = (
    ("id", "id", "bigint"), ("last_sample_at", "ts", "timestamptz"), ("last_util_pct", "util", "float8"),
    ("last_mem_used_mib", "mem", "int"), ("last_power_w", "power", "float8"),
    ("last_temp_c", "temp", "smallint"), ("last_sm_clock_mhz", "clock", "int"),
    ("ecc_sbe_total", "sbe", "bigint"), ("ecc_dbe_total", "dbe", "bigint"),
)  # fmt: skip
_SAMPLE_KEYS = tuple(key for _, key, _ in _SAMPLE_SHAPE)
_ROLLUP_KEYS = tuple(key for _, key, _ in _ROLLUP_SHAPE)
_GPU_LATEST_KEYS = tuple(key for _, key, _ in _GPU_LATEST_SHAPE)


def _names(model) -> SimpleNamespace:
    """A model's table (``table``) and the column of each concrete field, by field name."""
    opts = model._meta
    return SimpleNamespace(table=opts.db_table, **{f.name: f.column for f in opts.concrete_fields})


@dataclass(frozen=True, slots=True)
class _Statements:
    head: str
    marker: str  # SQLite: the marker's insert (on PostgreSQL the head statement inserts it)
    samples: str
    rollup: str  # SQLite: ``{values}`` is the rows' placeholders
    gpu_latest: str
    gpu_xids: str
    node: SimpleNamespace  # the node's columns, for its update (``_node_update``)


@functools.cache
def _statements(vendor: str) -> _Statements:
    """The ingest's statements for ``vendor`` ("postgresql" or "sqlite"), with the tables and columns
    of the models, built once per process. Their texts do not depend on the batch, so PostgreSQL
    prepares them after a few uses (``DB_PREPARED_STATEMENTS``)."""
    N, C, B, G = _names(Node), _names(NodeCredential), _names(HeartbeatBatch), _names(Gpu)
    S, R = _names(GpuSample), _names(GpuMinuteRollup)
    pg = vendor == "postgresql"
    node_cols = (
        f"n.{N.seq_epoch}, n.{N.last_seq}, n.{N.state}, n.{N.resume_state}, n.{N.workloads_digest}, "
        f"n.{N.versions_digest}"
    )
    gpu_cols = f"g.{G.id}, g.{G.uuid}, g.{G.health}, g.{G.ecc_dbe_total}, g.{G.last_sample_at}"
    gpus_join = f"LEFT JOIN {G.table} g ON g.{G.node} = n.{N.id} AND g.{G.removed_at} IS NULL"
    marker_cols = (
        f"{B.node}, {B.epoch}, {B.seq}, {B.received_at}, {B.sent_at}, {B.sample_count}, {B.out_of_order}"
    )
    marker_conflict = f"ON CONFLICT ({B.node}, {B.epoch}, {B.seq}) DO NOTHING RETURNING {B.id}"
    sample_cols = ", ".join(getattr(S, field) for field, _, _ in _SAMPLE_SHAPE)
    rollup_cols = ", ".join(getattr(R, field) for field, _, _ in _ROLLUP_SHAPE)

    # Additive, so late and replayed batches land in their minute; NULL gauges count nowhere.
    # PostgreSQL's GREATEST ignores NULLs; SQLite's two-argument MAX is NULL when either is, so
    # each side falls back on the other.
    def greatest(c: str) -> str:
        if pg:
            return f"GREATEST(r.{c}, excluded.{c})"
        return f"MAX(COALESCE(r.{c}, excluded.{c}), COALESCE(excluded.{c}, r.{c}))"

    rollup_sets = ", ".join(
        f"{getattr(R, f)} = {greatest(getattr(R, f))}"
        if f in _ROLLUP_MAX
        else f"{getattr(R, f)} = r.{getattr(R, f)} + excluded.{getattr(R, f)}"
        for f, _, _ in _ROLLUP_SHAPE[2:]
    )
    rollup_conflict = f" ON CONFLICT ({R.gpu}, {R.minute}) DO UPDATE SET {rollup_sets}"
    xids = f"UPDATE {G.table} SET {G.xid_count} = {G.xid_count} + %s, {G.last_xid} = %s WHERE {G.id} = %s"

    if not pg:
        latest_sets = ", ".join(f"{getattr(G, f)} = %s" for f, _, _ in _GPU_LATEST_SHAPE[1:])
        return _Statements(
            head=(
                f"SELECT c.{C.key_hash}, {node_cols}, NULL, {gpu_cols} FROM {N.table} n "
                f"JOIN {C.table} c ON c.{C.node} = n.{N.id} {gpus_join} WHERE n.{N.id} = %s"
            ),
            marker=f"INSERT INTO {B.table} ({marker_cols}) VALUES (%s, %s, %s, %s, %s, %s, %s) {marker_conflict}",
            samples=f"INSERT INTO {S.table} ({sample_cols}) VALUES ({', '.join(['%s'] * len(_SAMPLE_SHAPE))})",
            rollup=f"INSERT INTO {R.table} AS r ({rollup_cols}) VALUES {{values}}{rollup_conflict}",
            gpu_latest=(
                f"UPDATE {G.table} SET {latest_sets} WHERE {G.id} = %s "
                f"AND ({G.last_sample_at} IS NULL OR {G.last_sample_at} <= %s)"
            ),
            gpu_xids=xids,
            node=N,
        )

    def recordset(shape) -> str:
        """The rows of one JSON document parameter, as a table ``v`` with the shape's keys."""
        return f"json_to_recordset(%s::json) AS v({', '.join(f'{key} {type_}' for _, key, type_ in shape)})"

    latest_sets = ", ".join(f"{getattr(G, f)} = v.{key}" for f, key, _ in _GPU_LATEST_SHAPE[1:])
    return _Statements(
        # The head of a batch, one statement: lock the node row (batches of one node are
        # serialised), check the credential, insert the (node, epoch, seq) marker unless it is there
        # (a duplicate, even a concurrent one, stops here having written nothing), read the GPUs.
        head=f"""
WITH n AS (
    SELECT n.{N.id}, {node_cols}, c.{C.key_hash}
    FROM {N.table} n JOIN {C.table} c ON c.{C.node} = n.{N.id}
    WHERE n.{N.id} = %(node)s FOR UPDATE OF n
), m AS (
    INSERT INTO {B.table} ({marker_cols})
    SELECT n.{N.id}, n.{N.seq_epoch}, %(seq)s, %(now)s, %(sent)s, %(count)s, %(seq)s < n.{N.last_seq}
    FROM n WHERE n.{C.key_hash} = %(hash)s
    {marker_conflict}
)
SELECT n.{C.key_hash}, {node_cols}, (SELECT {B.id} FROM m), {gpu_cols}
FROM n {gpus_join}
""",
        marker="",
        # The rows go as one JSON document (dumped by orjson, parsed by PostgreSQL), which costs far
        # less than adapting arrays of values one by one in Python.
        samples=(
            f"INSERT INTO {S.table} ({sample_cols}) "
            f"SELECT {', '.join(_SAMPLE_KEYS)} FROM {recordset(_SAMPLE_SHAPE)}"
        ),
        rollup=(
            f"INSERT INTO {R.table} AS r ({rollup_cols}) "
            f"SELECT {', '.join(_ROLLUP_KEYS)} FROM {recordset(_ROLLUP_SHAPE)}{rollup_conflict}"
        ),
        # Only newer values replace the latest ones (a replayed batch is older): the guard is in
        # SQL, so it holds against the row as it is now, whatever the batch read before it took the
        # node's lock. The node's id leads the planner to the node's few GPUs by index: it cannot
        # see how many rows the JSON holds (it assumes 100), and without it a prepared (generic)
        # plan scans the whole GPU table.
        gpu_latest=(
            f"UPDATE {G.table} AS g SET {latest_sets} FROM {recordset(_GPU_LATEST_SHAPE)} "
            f"WHERE g.{G.node} = %s AND g.{G.id} = v.id "
            f"AND (g.{G.last_sample_at} IS NULL OR g.{G.last_sample_at} <= v.ts)"
        ),
        gpu_xids=xids,
        node=N,
    )


@dataclass(slots=True)
class _NodeRow:
    id: int
    seq_epoch: int
    last_seq: int
    state: str
    resume_state: str
    workloads_digest: str
    versions_digest: str


def heartbeat_ingest(
    *, node_id: int, credential: str, batch: HeartbeatData, now: datetime | None = None
) -> IngestResult:
    """Store one heartbeat batch of the node that ``credential`` (``gpn_<node_id>_...``) opens.

    One transaction of three round trips on PostgreSQL whatever the batch size: the head statement
    (credential, node lock, marker, GPUs), the writes (samples, rollups, GPUs' latest values, node)
    in one pipeline, and the commit. A wrong credential raises NotAuthenticated and writes nothing.
    """
    now = now or timezone.now()
    pg = _is_pg()
    sql = _statements(connection.vendor)
    key_hash = hash_secret(credential)
    with transaction.atomic():
        with connection.cursor() as cur:
            n, marker_id, gpus = _head(cur, sql, node_id, key_hash, batch, now, pg)
            if marker_id is None:
                node_metrics.HEARTBEATS.labels(result="duplicate").inc()
                return IngestResult(status="duplicate")
            seq, last_seq = batch.seq, n.last_seq
            gap = _record_sequence(n.id, n.seq_epoch, seq, last_seq, now)
            written, ignored, newly_unhealthy, tail = _write_samples(sql, n.id, gpus, batch.samples, pg)
            newest = seq > last_seq
            # The workload list changed: statuses to write (or, for a list now empty, to clear).
            relist = (
                newest
                and batch.workloads_digest != n.workloads_digest
                and (bool(batch.workloads) or n.workloads_digest not in NO_WORKLOADS_DIGESTS)
            )
            tail.append(_node_update(sql.node, n, batch, newest, now, pg))
            if newest and batch.versions is not None and batch.versions.digest != n.versions_digest:
                tail.extend(_firmware_updates(n.id, gpus, batch.versions))
            if pg:
                # One round trip for all of them; Django's atomic block commits after it.
                with connection.connection.pipeline():
                    for statement, params in tail:
                        cur.execute(statement, params)
            else:
                for statement, params in tail:
                    if params and isinstance(params[0], tuple):
                        cur.executemany(statement, params)
                    else:
                        cur.execute(statement, params)
        # Workload statuses from the newest batch only: a late batch's are out of date.
        if relist:
            _record_workloads(n.id, batch.workloads, now)
        if newest and batch.workloads:
            active = [w.workload_id for w in batch.workloads if w.state not in TERMINAL_WORKLOAD_STATES]
            if active:
                send_on_commit(workloads_reported, sender=Node, node_id=n.id, workload_ids=active)
        if batch.volumes:
            send_on_commit(volumes_measured, sender=Node, node_id=n.id, volumes=batch.volumes)
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
    cur, sql: _Statements, node_id: int, key_hash: str, batch: HeartbeatData, now: datetime, pg: bool
) -> tuple[_NodeRow, int | None, dict[str, tuple]]:
    """Check the credential, lock the node, insert the marker. Returns the node, the marker id (None
    for a duplicate) and the node's GPUs by uuid: (id, uuid, health, ecc_dbe_total, last_sample_at)."""
    sent = _db_dt(batch.sent_at) if batch.sent_at else None
    if pg:
        cur.execute(
            sql.head,
            {"node": node_id, "seq": batch.seq, "now": now, "sent": sent, "count": len(batch.samples),
             "hash": key_hash},
        )  # fmt: skip
        rows = cur.fetchall()
    else:
        cur.execute(sql.head, [node_id])
        rows = cur.fetchall()
    if not rows or not hmac.compare_digest(rows[0][0], key_hash):
        raise NotAuthenticated("Invalid node credential.")
    n = _NodeRow(node_id, *rows[0][1:7])
    marker_id = rows[0][7]
    if not pg:
        cur.execute(
            sql.marker,
            [node_id, n.seq_epoch, batch.seq, _db_dt(now), sent, len(batch.samples), batch.seq < n.last_seq],
        )
        row = cur.fetchone()
        marker_id = row[0] if row else None
    gpus = {r[9]: r[8:] for r in rows if r[8] is not None}
    return n, marker_id, gpus


def _node_update(
    N: SimpleNamespace, n: _NodeRow, batch: HeartbeatData, newest: bool, now: datetime, pg: bool
) -> tuple[str, list]:
    """The node's update: its last heartbeat, what the newest batch says, and its return to READY."""
    sets, params = [f"{N.last_heartbeat_at} = %s"], [_db_dt(now)]
    if newest:
        sets += [
            f"{N.last_seq} = %s",
            f"{N.status} = %s" + ("::jsonb" if pg else ""),
            f"{N.workloads_digest} = %s",
        ]
        params += [batch.seq, _dumps(batch.status), batch.workloads_digest]
        versions = batch.versions
        if versions is not None and versions.digest != n.versions_digest:
            # Only when they changed (an upgrade): the same digest writes nothing more.
            for field in ("driver_version", "cuda_version", "rocm_version", "level_zero_version"):
                sets.append(f"{getattr(N, field)} = %s")
                params.append(getattr(versions, field))
            sets.append(f"{N.versions_digest} = %s")
            params.append(versions.digest)
        agent_version = batch.status.get("agent_version")
        if isinstance(agent_version, str) and agent_version:
            sets.append(f"{N.agent_version} = %s")
            params.append(agent_version[:_AGENT_VERSION_MAX])
    if n.state in (NodeState.SUSPECT, NodeState.DOWN):
        sets += [
            f"{N.state} = %s",
            f"{N.resume_state} = %s",
            f"{N.state_reason} = %s",
            f"{N.state_changed_at} = %s",
        ]
        params += [n.resume_state or NodeState.READY, "", "Heartbeats resumed.", _db_dt(now)]
    params.append(n.id)
    return f"UPDATE {N.table} SET {', '.join(sets)} WHERE {N.id} = %s", params


def _firmware_updates(node_id: int, gpus: dict[str, tuple], versions) -> list[tuple[str, list]]:
    """Each GPU's firmware as the batch reports it (only run when the versions changed)."""
    G = _names(Gpu)
    statement = f"UPDATE {G.table} SET {G.firmware_version} = %s WHERE {G.id} = %s AND {G.node} = %s"
    return [
        (statement, [firmware, gpus[uuid][0], node_id])
        for uuid, firmware in sorted(versions.firmware.items())
        if uuid in gpus
    ]


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
        gap = lock_sequence_gap(node_id=node_id, epoch=epoch, seq=seq)
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


def _write_samples(sql: _Statements, node_id: int, gpus: dict[str, tuple], samples: list[Sample], pg: bool):
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
        tail.append((sql.samples, [_json_rows(_SAMPLE_KEYS, rows)]))
        tail.append((sql.rollup, [_json_rows(_ROLLUP_KEYS, [(*key, *rollups[key]) for key in keys])]))
    else:
        dumps = _dumps
        tail.append(
            (
                sql.samples,
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
        values = ", ".join([f"({', '.join(['%s'] * len(_ROLLUP_SHAPE))})"] * len(keys))
        params: list[Any] = []
        for gid, minute in keys:
            params.extend((gid, _db_dt(minute), *rollups[(gid, minute)]))
        tail.append((sql.rollup.format(values=values), params))

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
            tail.append((sql.gpu_latest, [_json_rows(_GPU_LATEST_KEYS, fresh), node_id]))
        else:
            tail.append((sql.gpu_latest, [(*(_db_dt(f[1]),), *f[2:], f[0], _db_dt(f[1])) for f in fresh]))
    for gid, xids in xids_seen.items():
        tail.append((sql.gpu_xids, [len(xids), xids[-1], gid]))
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
        # Another start time is another run of the workload (a retry placed on this node again
        # before the node forgot the ended run): its own end is news, even in the same state.
        same_run = row is not None and row.started_at == w.started_at
        if same_run and row.state == w.state and row.exit_code == w.exit_code:
            continue
        was_terminal = same_run and row.state in TERMINAL_WORKLOAD_STATES
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
