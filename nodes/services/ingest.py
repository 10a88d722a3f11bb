"""Heartbeat ingest: the hot path. One transaction and a handful of statements per batch.

Per batch: lock the node row, insert the (node, epoch, seq) marker with ON CONFLICT DO NOTHING (a
duplicate stops there and writes nothing), record a gap or fill one, COPY the samples (PostgreSQL;
``executemany`` on SQLite), upsert the per-minute rollups additively, update each GPU's latest
values in one pipelined ``executemany``, and update the node. No ORM object is built per sample.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from nodes import metrics as node_metrics
from nodes.models import (
    GpuHealth,
    Node,
    NodeState,
    NodeWorkloadStatus,
    SequenceGap,
)
from nodes.services.health import gpu_mark_unhealthy
from nodes.services.registration import AuthenticatedNode
from nodes.signals import send_on_commit, workload_exited
from nodes.validation import fail, get_bool, get_int, get_str, parse_time, require_object

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
WORKLOAD_STATES = frozenset({"starting", "running", "exited", "failed", "stopped", "preempted"})
TERMINAL_WORKLOAD_STATES = frozenset({"exited", "failed", "stopped", "preempted"})
MAX_FUTURE = timedelta(minutes=10)


@dataclass(slots=True)
class Sample:
    gpu_uuid: str
    ts: datetime
    util_pct: float
    mem_used_mib: int
    power_w: float
    temp_c: int
    sm_clock_mhz: int | None
    ecc_sbe: int
    ecc_dbe: int
    throttle_reasons: int
    xid_errors: list[int]
    retired_pages_pending: bool
    row_remap_failure: bool
    fell_off_bus: bool
    processes: list[dict] | None


@dataclass(frozen=True)
class WorkloadReport:
    workload_id: str
    state: str
    exit_code: int | None
    started_at: datetime | None
    finished_at: datetime | None
    message: str


@dataclass
class HeartbeatData:
    seq: int
    sent_at: datetime | None
    status: dict
    samples: list[Sample]
    workloads: list[WorkloadReport] = field(default_factory=list)
    workloads_digest: str = ""


@dataclass(frozen=True)
class IngestResult:
    status: str  # "accepted" | "duplicate"
    gap: tuple[int, int] | None = None
    samples: int = 0
    ignored_samples: int = 0


# --- validation ---------------------------------------------------------------------------------------


def _number(obj: dict, key: str, field: str, lo: float, hi: float) -> float:
    value = obj.get(key)
    if value is None:
        raise fail(field, "This field is required.")
    t = type(value)
    if t is not float and t is not int:
        raise fail(field, "Expected a number.")
    if value < lo or value > hi:
        raise fail(field, f"Must be between {lo:g} and {hi:g}.")
    return value


def _count(obj: dict, key: str, field: str) -> int:
    value = obj.get(key, 0)
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise fail(field, "Expected a non-negative integer.")
    return value


def _procs_ok(procs: Any) -> bool:
    if type(procs) is not list:
        return False
    for p in procs:
        if type(p) is not dict or type(p.get("pid")) is not int or type(p.get("used_mib")) is not int:
            return False
    return True


def _sample_error(i: int, s: dict, times: dict[str, datetime], latest_ok: datetime) -> datetime:
    """The slow path: validate one sample field by field and raise naming the first bad one. Returns
    the sample's time when the sample is fine after all (a timestamp not seen before)."""
    uuid = s.get("gpu_uuid")
    if type(uuid) is not str or not uuid or len(uuid) > 96:
        raise fail(f"samples[{i}].gpu_uuid", "Expected a GPU UUID string.")
    ts_raw = s.get("ts")
    ts = times.get(ts_raw) if type(ts_raw) is str else None
    if ts is None:
        ts = parse_time(ts_raw, f"samples[{i}].ts")
        if ts > latest_ok:
            raise fail(f"samples[{i}].ts", "More than 10 minutes in the future: check the node's clock.")
        times[ts_raw] = ts
    _number(s, "util_pct", f"samples[{i}].util_pct", 0, 100)
    mem = s.get("mem_used_mib")
    if type(mem) is not int or mem < 0 or mem >= 2**31:
        raise fail(f"samples[{i}].mem_used_mib", "Expected a non-negative integer.")
    _number(s, "power_w", f"samples[{i}].power_w", 0, 100_000)
    _number(s, "temp_c", f"samples[{i}].temp_c", -100, 300)
    clock = s.get("sm_clock_mhz")
    if clock is not None and (type(clock) is not int or clock < 0 or clock > 100_000):
        raise fail(f"samples[{i}].sm_clock_mhz", "Expected a non-negative integer.")
    for key in ("ecc_sbe", "ecc_dbe", "throttle_reasons"):
        _count(s, key, f"samples[{i}].{key}")
    xids = s.get("xid_errors") or []
    if type(xids) is not list or any(type(x) is not int for x in xids):
        raise fail(f"samples[{i}].xid_errors", "Expected a list of integers.")
    procs = s.get("processes") or None
    if procs is not None:
        if type(procs) is not list:
            raise fail(f"samples[{i}].processes", "Expected a list.")
        for j, p in enumerate(procs):
            if type(p) is not dict or type(p.get("pid")) is not int or type(p.get("used_mib")) is not int:
                raise fail(
                    f"samples[{i}].processes[{j}]", "Expected an object with integer pid and used_mib."
                )
    for key in ("retired_pages_pending", "row_remap_failure", "fell_off_bus"):
        get_bool(s, key, f"samples[{i}].{key}")
    return ts


def heartbeat_parse(raw: bytes, *, now: datetime | None = None) -> HeartbeatData:
    """Validate a heartbeat body strictly; raise ValidationFailed naming the first bad field."""
    now = now or timezone.now()
    max_bytes = settings.NODE_HEARTBEAT_MAX_BYTES
    if len(raw) > max_bytes:
        raise fail("body", f"The batch is {len(raw)} bytes; at most {max_bytes} are accepted.")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise fail("body", "Not valid JSON.") from None
    require_object(data, "body")
    seq = get_int(data, "seq", "seq", required=True, min_value=1, max_value=2**62)
    sent_at = parse_time(data.get("sent_at"), "sent_at", required=False)
    status = data.get("status")
    if status is None:
        status = {}
    require_object(status, "status")
    raw_samples = data.get("samples", [])
    if not isinstance(raw_samples, list):
        raise fail("samples", "Expected a list.")
    max_samples = settings.NODE_HEARTBEAT_MAX_SAMPLES
    if len(raw_samples) > max_samples:
        raise fail("samples", f"{len(raw_samples)} samples; at most {max_samples} in one batch.")

    latest_ok = now + MAX_FUTURE
    times: dict[str, datetime] = {}
    samples: list[Sample] = []
    append = samples.append
    # The fast path accepts a well-formed sample with a handful of type checks; anything else goes
    # to _sample_error, which finds and names the first bad field.
    for i, s in enumerate(raw_samples):
        if type(s) is not dict:
            raise fail(f"samples[{i}]", "Expected a JSON object.")
        get = s.get
        uuid = get("gpu_uuid")
        ts_raw = get("ts")
        util = get("util_pct")
        mem = get("mem_used_mib")
        power = get("power_w")
        temp = get("temp_c")
        clock = get("sm_clock_mhz")
        sbe = get("ecc_sbe") or 0
        dbe = get("ecc_dbe") or 0
        throttle = get("throttle_reasons") or 0
        xids = get("xid_errors") or []
        procs = get("processes") or None
        rpp = get("retired_pages_pending", False)
        rrf = get("row_remap_failure", False)
        fob = get("fell_off_bus", False)
        ts = times.get(ts_raw) if type(ts_raw) is str else None
        tu, tp, tt = type(util), type(power), type(temp)
        if not (
            ts is not None
            and type(uuid) is str
            and 0 < len(uuid) <= 96
            and (tu is float or tu is int)
            and 0 <= util <= 100
            and type(mem) is int
            and 0 <= mem < 2**31
            and (tp is float or tp is int)
            and 0 <= power <= 100_000
            and (tt is float or tt is int)
            and -100 <= temp <= 300
            and (clock is None or (type(clock) is int and 0 <= clock <= 100_000))
            and type(sbe) is int
            and sbe >= 0
            and type(dbe) is int
            and dbe >= 0
            and type(throttle) is int
            and throttle >= 0
            and type(xids) is list
            and (not xids or all(type(x) is int for x in xids))
            and (procs is None or _procs_ok(procs))
            and (rpp is False or rpp is True)
            and (rrf is False or rrf is True)
            and (fob is False or fob is True)
        ):
            ts = _sample_error(i, s, times, latest_ok)
        append(
            Sample(
                uuid,
                ts,
                float(util),
                mem,
                float(power),
                int(temp),
                clock,
                sbe,
                dbe,
                throttle,
                xids,
                rpp,
                rrf,
                fob,
                procs,
            )
        )

    raw_workloads = data.get("workloads", [])
    if not isinstance(raw_workloads, list):
        raise fail("workloads", "Expected a list.")
    if len(raw_workloads) > 1000:
        raise fail("workloads", "At most 1000 workloads in one batch.")
    workloads = []
    digest = hashlib.md5(
        orjson.dumps(raw_workloads, option=orjson.OPT_SORT_KEYS), usedforsecurity=False
    ).hexdigest()
    for i, w in enumerate(raw_workloads):
        require_object(w, f"workloads[{i}]")
        state = get_str(w, "state", f"workloads[{i}].state", required=True, max_length=16)
        if state not in WORKLOAD_STATES:
            raise fail(f"workloads[{i}].state", f"One of {', '.join(sorted(WORKLOAD_STATES))}.")
        workloads.append(
            WorkloadReport(
                workload_id=get_str(w, "workload_id", f"workloads[{i}].workload_id", required=True, max_length=64),
                state=state,
                exit_code=get_int(w, "exit_code", f"workloads[{i}].exit_code", min_value=-(2**31), max_value=2**31 - 1),
                started_at=parse_time(w.get("started_at"), f"workloads[{i}].started_at", required=False),
                finished_at=parse_time(w.get("finished_at"), f"workloads[{i}].finished_at", required=False),
                message=get_str(w, "message", f"workloads[{i}].message", max_length=4000),
            )
        )  # fmt: skip
    return HeartbeatData(
        seq=seq, sent_at=sent_at, status=status, samples=samples, workloads=workloads, workloads_digest=digest
    )


# --- ingest -------------------------------------------------------------------------------------------


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


_INSERT_BATCH = (
    "INSERT INTO nodes_heartbeatbatch (node_id, epoch, seq, received_at, sent_at, sample_count, out_of_order) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (node_id, epoch, seq) DO NOTHING RETURNING id"
)
_SAMPLE_COLUMNS = (
    "gpu_id, ts, util_pct, mem_used_mib, power_w, temp_c, sm_clock_mhz, ecc_sbe, ecc_dbe, "
    "throttle_reasons, xid_errors, processes"
)
_ROLLUP_SQL = (
    "INSERT INTO nodes_gpuminuterollup AS r (gpu_id, minute, sample_count, util_sum, util_max, "
    "mem_used_sum, mem_used_max, power_sum, temp_max) VALUES {values} "
    "ON CONFLICT (gpu_id, minute) DO UPDATE SET "
    "sample_count = r.sample_count + excluded.sample_count, "
    "util_sum = r.util_sum + excluded.util_sum, "
    "util_max = {greatest}(r.util_max, excluded.util_max), "
    "mem_used_sum = r.mem_used_sum + excluded.mem_used_sum, "
    "mem_used_max = {greatest}(r.mem_used_max, excluded.mem_used_max), "
    "power_sum = r.power_sum + excluded.power_sum, "
    "temp_max = {greatest}(r.temp_max, excluded.temp_max)"
)
_GPU_LATEST_SQL = (
    "UPDATE nodes_gpu SET last_sample_at = %s, last_util_pct = %s, last_mem_used_mib = %s, "
    "last_power_w = %s, last_temp_c = %s, last_sm_clock_mhz = %s, ecc_sbe_total = %s, "
    "ecc_dbe_total = %s, last_xid = %s, xid_count = %s WHERE id = %s"
)


_NODE_AND_GPUS = (
    "SELECT n.last_seq, n.state, n.resume_state, n.workloads_digest, g.id, g.uuid, g.health, "
    "g.ecc_dbe_total, g.last_sample_at, g.xid_count, g.last_xid "
    "FROM nodes_node n LEFT JOIN nodes_gpu g ON g.node_id = n.id AND g.removed_at IS NULL WHERE n.id = %s"
)


@dataclass(slots=True)
class _NodeRow:
    id: int
    last_seq: int
    state: str
    resume_state: str
    workloads_digest: str


def heartbeat_ingest(
    *, node: AuthenticatedNode, batch: HeartbeatData, now: datetime | None = None
) -> IngestResult:
    now = now or timezone.now()
    pg = _is_pg()
    with transaction.atomic():
        with connection.cursor() as cur:
            # The marker first: a duplicate (even a concurrent one) stops here having written nothing.
            cur.execute(
                _INSERT_BATCH,
                [
                    node.id,
                    node.seq_epoch,
                    batch.seq,
                    _db_dt(now),
                    _db_dt(batch.sent_at) if batch.sent_at else None,
                    len(batch.samples),
                    False,
                ],
            )
            if cur.fetchone() is None:
                node_metrics.HEARTBEATS.labels(result="duplicate").inc()
                return IngestResult(status="duplicate")
            # Then the node row, locked: batches of one node are serialised (gaps, latest values).
            cur.execute(_NODE_AND_GPUS + (" FOR UPDATE OF n" if pg else ""), [node.id])
            rows = cur.fetchall()
            n = _NodeRow(node.id, *rows[0][:4])
            gpus = {r[5]: r[4:] for r in rows if r[4] is not None}
            seq, epoch, last_seq = batch.seq, node.seq_epoch, n.last_seq
            gap = _record_sequence(n.id, epoch, seq, last_seq, now)
            if seq < last_seq:
                cur.execute(
                    "UPDATE nodes_heartbeatbatch SET out_of_order = %s WHERE node_id = %s AND epoch = %s AND seq = %s",
                    [True, n.id, epoch, seq],
                )
            written, ignored, newly_unhealthy, tail = _write_samples(cur, gpus, batch.samples, pg)

            newest = seq > last_seq
            node_sql, node_params = _node_update(n, batch, newest, now, pg)
            tail.append((node_sql, node_params))
            if pg:
                with connection.connection.pipeline():
                    for sql, params in tail:
                        cur.execute(sql, params)
            else:
                for sql, params in tail:
                    if params and isinstance(params[0], tuple):
                        cur.executemany(sql, params)
                    else:
                        cur.execute(sql, params)
        # Workload statuses from the newest batch only: a late batch's are out of date.
        if newest and batch.workloads and batch.workloads_digest != n.workloads_digest:
            _record_workloads(n.id, batch.workloads, now)
        for gpu_id, reason in newly_unhealthy:
            gpu_mark_unhealthy(gpu_id=gpu_id, reason=reason, now=now)

    node_metrics.HEARTBEATS.labels(result="accepted").inc()
    node_metrics.SAMPLES.inc(written)
    if ignored:
        node_metrics.SAMPLES_IGNORED.inc(ignored)
    return IngestResult(status="accepted", gap=gap, samples=written, ignored_samples=ignored)


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


_GPU_LATEST_PG = (
    "UPDATE nodes_gpu AS g SET last_sample_at = v.ts, last_util_pct = v.util, last_mem_used_mib = v.mem, "
    "last_power_w = v.power, last_temp_c = v.temp, last_sm_clock_mhz = v.clock, ecc_sbe_total = v.sbe, "
    "ecc_dbe_total = v.dbe, last_xid = v.xid, xid_count = v.xcount FROM (VALUES {values}) "
    "AS v(ts, util, mem, power, temp, clock, sbe, dbe, xid, xcount, id) WHERE g.id = v.id"
)
_GPU_LATEST_PG_ROW = (
    "(%s::timestamptz, %s::float8, %s::int, %s::float8, %s::smallint, %s::int, %s::bigint, %s::bigint, "
    "%s::int, %s::bigint, %s::bigint)"
)


def _write_samples(cur, gpus: dict[str, tuple], samples: list[Sample], pg: bool):
    """COPY the samples now; return the statements that upsert the rollups and update the GPUs'
    latest values (run by the caller, pipelined with the node update). ``gpus`` maps uuid to
    (id, uuid, health, ecc_dbe_total, last_sample_at, xid_count, last_xid).

    Returns (written, ignored, [(gpu_id, reason)] for GPUs this batch shows failing, statements).
    """
    if not samples:
        return 0, 0, [], []
    rows: list[tuple] = []
    rollups: dict[tuple[int, datetime], list] = {}
    latest: dict[int, Sample] = {}
    xids_seen: dict[int, list[int]] = {}
    failing: dict[int, str] = {}
    ignored = 0
    dumps = _dumps
    proc_json: dict[int, tuple[Any, str]] = {}  # the same processes list, dumped once per GPU
    for s in samples:
        g = gpus.get(s.gpu_uuid)
        if g is None:
            ignored += 1
            continue
        gid = g[0]
        ts = s.ts
        procs = None
        if s.processes:
            cached = proc_json.get(gid)
            if cached is not None and cached[0] == s.processes:
                procs = cached[1]
            else:
                procs = dumps(s.processes)
                proc_json[gid] = (s.processes, procs)
        rows.append(
            (
                gid,
                ts if pg else _db_dt(ts),
                s.util_pct,
                s.mem_used_mib,
                s.power_w,
                s.temp_c,
                s.sm_clock_mhz,
                s.ecc_sbe,
                s.ecc_dbe,
                s.throttle_reasons,
                dumps(s.xid_errors) if s.xid_errors else None,
                procs,
            )
        )
        key = (gid, ts.replace(second=0, microsecond=0))
        r = rollups.get(key)
        if r is None:
            rollups[key] = [1, s.util_pct, s.util_pct, s.mem_used_mib, s.mem_used_mib, s.power_w, s.temp_c]
        else:
            r[0] += 1
            r[1] += s.util_pct
            if s.util_pct > r[2]:
                r[2] = s.util_pct
            r[3] += s.mem_used_mib
            if s.mem_used_mib > r[4]:
                r[4] = s.mem_used_mib
            r[5] += s.power_w
            if s.temp_c > r[6]:
                r[6] = s.temp_c
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

    if pg:
        with cur.cursor.copy(f"COPY nodes_gpusample ({_SAMPLE_COLUMNS}) FROM STDIN") as copy:
            write = copy.write_row
            for row in rows:
                write(row)
    else:
        cur.executemany(
            f"INSERT INTO nodes_gpusample ({_SAMPLE_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            rows,
        )

    tail: list[tuple[str, Any]] = []
    values_sql = ", ".join(["(%s, %s, %s, %s, %s, %s, %s, %s, %s)"] * len(rollups))
    params: list[Any] = []
    for (gid, minute), r in sorted(rollups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        params.extend((gid, minute if pg else _db_dt(minute), *r))
    tail.append((_ROLLUP_SQL.format(values=values_sql, greatest="GREATEST" if pg else "MAX"), params))

    updates, late = [], []
    by_id = {g[0]: g for g in gpus.values()}
    for gid, s in latest.items():
        g = by_id[gid]
        prev_at = _from_db_dt(g[4])
        xids = xids_seen.get(gid, ())
        xid_count = g[5] + len(xids)
        last_xid = xids[-1] if xids else g[6]
        if prev_at is not None and s.ts < prev_at:
            # A late batch (buffer replay): keep the newer latest values, fold in the XID count.
            if xids:
                late.append((last_xid, xid_count, gid))
            continue
        updates.append(
            (
                s.ts if pg else _db_dt(s.ts),
                s.util_pct,
                s.mem_used_mib,
                s.power_w,
                s.temp_c,
                s.sm_clock_mhz,
                s.ecc_sbe,
                s.ecc_dbe,
                last_xid,
                xid_count,
                gid,
            )
        )
    if updates:
        if pg:
            sql = _GPU_LATEST_PG.format(values=", ".join([_GPU_LATEST_PG_ROW] * len(updates)))
            tail.append((sql, [v for u in updates for v in u]))
        else:
            tail.append((_GPU_LATEST_SQL, updates))
    for params in late:
        tail.append(("UPDATE nodes_gpu SET last_xid = %s, xid_count = %s WHERE id = %s", list(params)))
    return len(rows), ignored, sorted(failing.items()), tail


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
    if create:
        NodeWorkloadStatus.objects.bulk_create(create)
    if update:
        NodeWorkloadStatus.objects.bulk_update(
            update, ["state", "exit_code", "message", "started_at", "finished_at", "updated_at"]
        )
