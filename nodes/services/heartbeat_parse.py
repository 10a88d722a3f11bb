"""Heartbeat parsing: the agent's JSON batch checked field by field into plain data (``HeartbeatData``)
before anything is written; a bad field is a 400 naming it (``nodes.validation``). The write path is
``nodes.services.ingest``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from django.conf import settings
from django.utils import timezone

from nodes.validation import fail, get_bool, get_int, get_str, json_object, parse_time, require_object

WORKLOAD_STATES = frozenset({"starting", "running", "exited", "failed", "stopped", "preempted"})
TERMINAL_WORKLOAD_STATES = frozenset({"exited", "failed", "stopped", "preempted"})
MAX_FUTURE = timedelta(minutes=10)


def workloads_digest(raw_workloads: list) -> str:
    """A batch's ``workloads`` as one fingerprint: an unchanged list is not written again."""
    return hashlib.md5(
        orjson.dumps(raw_workloads, option=orjson.OPT_SORT_KEYS), usedforsecurity=False
    ).hexdigest()


# An empty list's (and a new node's) fingerprint: no workload status to keep.
NO_WORKLOADS_DIGESTS = frozenset({"", workloads_digest([])})


@dataclass(slots=True)
class Sample:
    """One reading of one GPU. A gauge is None when the GPU could not report it (stored as NULL)."""

    gpu_uuid: str
    ts: datetime
    util_pct: float | None
    mem_used_mib: int | None
    power_w: float | None
    temp_c: int | None
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


@dataclass(frozen=True)
class VolumeReport:
    """What a node measured a tenant volume to hold (``volumes`` of a batch)."""

    volume_id: int
    used_bytes: int
    measured_at: datetime


@dataclass(frozen=True)
class Versions:
    """The driver stack and each GPU's firmware, as a batch's ``versions`` carries them."""

    driver_version: str
    cuda_version: str
    rocm_version: str
    level_zero_version: str
    firmware: dict[str, str]  # GPU uuid -> firmware version
    digest: str


@dataclass
class HeartbeatData:
    seq: int
    sent_at: datetime | None
    status: dict
    samples: list[Sample]
    workloads: list[WorkloadReport] = field(default_factory=list)
    workloads_digest: str = ""
    volumes: list[VolumeReport] = field(default_factory=list)
    versions: Versions | None = None


@dataclass(frozen=True)
class IngestResult:
    status: str  # "accepted" | "duplicate"
    gap: tuple[int, int] | None = None
    samples: int = 0
    ignored_samples: int = 0


# --- validation ---------------------------------------------------------------------------------------


def _number(obj: dict, key: str, field: str, lo: float, hi: float) -> float | None:
    """A gauge: a number in [lo, hi], or null when the GPU cannot report it (the key must be there)."""
    if key not in obj:
        raise fail(field, "This field is required (null when the GPU cannot report it).")
    value = obj[key]
    if value is None:
        return None
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
        if type(p) is not dict or type(p.get("pid")) is not int:
            return False
        used = p.get("used_mib")
        if used is not None and type(used) is not int:
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
    if "mem_used_mib" not in s:
        raise fail(
            f"samples[{i}].mem_used_mib", "This field is required (null when the GPU cannot report it)."
        )
    mem = s["mem_used_mib"]
    if mem is not None and (type(mem) is not int or mem < 0 or mem >= 2**31):
        raise fail(f"samples[{i}].mem_used_mib", "Expected a non-negative integer or null.")
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
            used = p.get("used_mib") if type(p) is dict else None
            if (
                type(p) is not dict
                or type(p.get("pid")) is not int
                or (used is not None and type(used) is not int)
            ):
                raise fail(
                    f"samples[{i}].processes[{j}]",
                    "Expected an object with an integer pid and an integer (or null) used_mib.",
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
    data = json_object(raw)
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
    procs_seen: dict[str, list] = {}  # a GPU's process list, checked once while it does not change
    samples: list[Sample] = []
    append = samples.append
    # The fast path accepts a well-formed sample with a handful of type checks; anything else goes
    # to _sample_error, which finds and names the first bad field.
    for i, s in enumerate(raw_samples):
        if type(s) is not dict:
            raise fail(f"samples[{i}]", "Expected a JSON object.")
        get = s.get
        uuid = get("gpu_uuid")
        # A gauge the GPU cannot report is null, but its key must be there (a missing one is an error).
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
        if ts is None and type(ts_raw) is str:  # a time not seen in this batch yet
            try:
                ts = datetime.fromisoformat(ts_raw)
            except ValueError:
                ts = None
            if ts is not None:
                if ts.tzinfo is None:
                    ts = None  # the slow path names the problem
                else:
                    ts = ts.astimezone(UTC)
                    if ts > latest_ok:
                        ts = None
                    else:
                        times[ts_raw] = ts
        tu, tp, tt = type(util), type(power), type(temp)
        if not (
            ts is not None
            and type(uuid) is str
            and 0 < len(uuid) <= 96
            and (((tu is float or tu is int) and 0 <= util <= 100) or (util is None and "util_pct" in s))
            and ((type(mem) is int and 0 <= mem < 2**31) or (mem is None and "mem_used_mib" in s))
            and (((tp is float or tp is int) and 0 <= power <= 100_000) or (power is None and "power_w" in s))
            and (((tt is float or tt is int) and -100 <= temp <= 300) or (temp is None and "temp_c" in s))
            and (clock is None or (type(clock) is int and 0 <= clock <= 100_000))
            and type(sbe) is int
            and sbe >= 0
            and type(dbe) is int
            and dbe >= 0
            and type(throttle) is int
            and throttle >= 0
            and type(xids) is list
            and (not xids or all(type(x) is int for x in xids))
            and (procs is None or procs == procs_seen.get(uuid) or _procs_ok(procs))
            and (rpp is False or rpp is True)
            and (rrf is False or rrf is True)
            and (fob is False or fob is True)
        ):
            ts = _sample_error(i, s, times, latest_ok)
        if procs is not None:
            procs_seen[uuid] = procs
        append(
            Sample(
                uuid,
                ts,
                None if util is None else float(util),
                mem,
                None if power is None else float(power),
                None if temp is None else int(temp),
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
    digest = workloads_digest(raw_workloads)
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
        seq=seq,
        sent_at=sent_at,
        status=status,
        samples=samples,
        workloads=workloads,
        workloads_digest=digest,
        volumes=_volumes(data.get("volumes", [])),
        versions=_versions(data.get("versions")),
    )


VERSION_LENGTHS = {"driver_version": 64, "cuda_version": 32, "rocm_version": 32, "level_zero_version": 32}


def _versions(raw: Any) -> Versions | None:
    """A batch's optional ``versions``: ``{"driver_version", "cuda_version", "rocm_version",
    "level_zero_version", "gpus": [{"uuid", "firmware_version"}]}`` (absent: unchanged)."""
    if raw is None:
        return None
    require_object(raw, "versions")
    texts = {key: get_str(raw, key, f"versions.{key}", max_length=n) for key, n in VERSION_LENGTHS.items()}
    gpus = raw.get("gpus", [])
    if not isinstance(gpus, list) or len(gpus) > 64:
        raise fail("versions.gpus", "Expected a list of at most 64 GPUs.")
    firmware = {}
    for i, g in enumerate(gpus):
        require_object(g, f"versions.gpus[{i}]")
        uuid = get_str(g, "uuid", f"versions.gpus[{i}].uuid", required=True, max_length=96)
        firmware[uuid] = get_str(g, "firmware_version", f"versions.gpus[{i}].firmware_version", max_length=64)
    digest = hashlib.md5(
        orjson.dumps([texts, firmware], option=orjson.OPT_SORT_KEYS), usedforsecurity=False
    ).hexdigest()
    return Versions(firmware=firmware, digest=digest, **texts)


def _volumes(raw: Any) -> list[VolumeReport]:
    """A batch's optional ``volumes``: ``[{"volume_id", "used_bytes", "measured_at"}]``."""
    if not isinstance(raw, list):
        raise fail("volumes", "Expected a list.")
    if len(raw) > 1000:
        raise fail("volumes", "At most 1000 volumes in one batch.")
    out = []
    for i, v in enumerate(raw):
        require_object(v, f"volumes[{i}]")
        volume_id = get_str(v, "volume_id", f"volumes[{i}].volume_id", required=True, max_length=19)
        if not volume_id.isascii() or not volume_id.isdigit():
            raise fail(f"volumes[{i}].volume_id", "A volume id (digits).")
        used = get_int(
            v, "used_bytes", f"volumes[{i}].used_bytes", required=True, min_value=0, max_value=2**63 - 1
        )
        at = parse_time(v.get("measured_at"), f"volumes[{i}].measured_at")
        out.append(VolumeReport(volume_id=int(volume_id), used_bytes=used or 0, measured_at=at))
    return out


# --- ingest -------------------------------------------------------------------------------------------
