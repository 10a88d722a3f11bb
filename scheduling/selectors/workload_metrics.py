"""A workload's GPU metrics per minute, from the fleet's telemetry, only while it held each GPU.

A whole GPU's readings are the workload's own: utilisation, memory, power and temperature come from
the GPU's minute rollups. A shared GPU (a fraction, or one over-subscribed) also runs other tenants'
work, so only what the node's collector attributes to the workload is given: the memory of its own
processes (from the raw samples' process lists, kept ``TELEMETRY_RAW_RETENTION_DAYS``) and the GPU's
temperature; utilisation and power are ``None`` there. Only minutes wholly inside an allocation are
given, so nothing from before or after the workload held the GPU shows.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from nodes.models import Gpu, GpuMinuteRollup, GpuSample
from scheduling.models import MILLI, Allocation, Workload

MINUTE = timedelta(minutes=1)


def ceil_minute(t: datetime) -> datetime:
    floor = t.replace(second=0, microsecond=0)
    return floor if floor == t else floor + MINUTE


def floor_minute(t: datetime) -> datetime:
    return t.replace(second=0, microsecond=0)


@dataclass(frozen=True)
class Held:
    """One allocation of a GPU: ``[start, end)``, ``end`` None while held; shared when it held a
    fraction of the GPU (the rest ran others' work)."""

    gpu_id: int
    start: datetime
    end: datetime | None
    shared: bool


def workload_held(*, workload: Workload) -> list[Held]:
    """Every GPU allocation the workload had, oldest first (one query)."""
    rows = Allocation.objects.filter(workload=workload).order_by("started_at", "id")
    return [
        Held(gpu_id, start, end, fraction < MILLI)
        for gpu_id, start, end, fraction in rows.values_list(
            "gpu_id", "started_at", "ended_at", "fraction_milli"
        )
    ]


def workload_last_placement(held: list[Held], *, now: datetime) -> tuple[list[Held], datetime, datetime]:
    """The allocations of the workload's current (or last) placement, from its start to now (or its
    end). ``held`` is not empty."""
    last = [h for h in held if h.end is None]
    if last:
        return last, min(h.start for h in last), now
    end = max(h.end for h in held)
    last = [h for h in held if h.end == end]
    return last, min(h.start for h in last), end


def _minutes(held: Held, since: datetime, until: datetime, now: datetime) -> tuple[datetime, datetime]:
    """The whole minutes ``[first, stop)`` of ``held`` inside ``[since, until)``."""
    first = ceil_minute(max(held.start, since))
    stop = floor_minute(min(held.end or now, until, now))
    return first, stop


def workload_gpu_metrics(
    *, workload: Workload, since: datetime, until: datetime, now: datetime
) -> list[dict]:
    """Per GPU the workload held in ``[since, until)``: ``{"gpu", "node", "index", "model", "shared",
    "held": [{"start", "end"}], "minutes": [{"minute", "util_pct", "mem_used_mib", "power_w",
    "temp_c"}]}``. Minute averages, temperature the minute's maximum; ``None`` where the GPU did not
    report a gauge or, on a shared GPU, where it cannot be attributed. Four queries at most."""
    spans: dict[int, list[tuple[Held, datetime, datetime]]] = defaultdict(list)
    for h in workload_held(workload=workload):
        if h.start < until and (h.end is None or h.end > since):
            first, stop = _minutes(h, since, until, now)
            spans[h.gpu_id].append((h, first, stop))
    if not spans:
        return []
    gpus = {
        g.pk: g
        for g in Gpu.objects.filter(pk__in=spans)
        .select_related("node", "model")
        .order_by("node__hostname", "index")
    }
    lo = min(first for rows in spans.values() for _, first, _ in rows)
    hi = max(stop for rows in spans.values() for _, _, stop in rows)
    points: dict[int, dict[datetime, dict]] = defaultdict(dict)

    def inside(gpu_id: int, minute: datetime, *, shared: bool) -> bool:
        return any(h.shared == shared and first <= minute < stop for h, first, stop in spans[gpu_id])

    whole = [gpu_id for gpu_id, rows in spans.items() if any(not h.shared for h, _, _ in rows)]
    shared = [gpu_id for gpu_id, rows in spans.items() if any(h.shared for h, _, _ in rows)]
    if whole and lo < hi:
        rollups = GpuMinuteRollup.objects.filter(
            gpu_id__in=whole, minute__gte=lo, minute__lt=hi, sample_count__gt=0
        ).values_list(
            "gpu_id", "minute", "util_sum", "util_count", "mem_used_sum", "mem_used_count", "power_sum",
            "power_count", "temp_max",
        )  # fmt: skip
        for gpu_id, minute, util_sum, util_n, mem_sum, mem_n, power_sum, power_n, temp in rollups:
            if inside(gpu_id, minute, shared=False):
                points[gpu_id][minute] = {
                    "minute": minute,
                    "util_pct": round(util_sum / util_n, 1) if util_n else None,
                    "mem_used_mib": round(mem_sum / mem_n) if mem_n else None,
                    "power_w": round(power_sum / power_n, 1) if power_n else None,
                    "temp_c": temp,
                }
    if shared and lo < hi:
        points_shared = _attributed(workload, shared, lo, hi)
        for (gpu_id, minute), point in points_shared.items():
            if inside(gpu_id, minute, shared=True):
                points[gpu_id][minute] = point
    return [
        {
            "gpu": g.uuid,
            "node": g.node.hostname,
            "index": g.index,
            "model": g.model.name if g.model_id else "",
            "shared": any(h.shared for h, _, _ in spans[g.pk]),
            "held": [{"start": h.start, "end": h.end} for h, _, _ in spans[g.pk]],
            "minutes": [points[g.pk][m] for m in sorted(points[g.pk])],
        }
        for g in gpus.values()
    ]


def _attributed(workload: Workload, gpu_ids: list[int], lo: datetime, hi: datetime) -> dict:
    """Per (GPU, minute): the memory of the workload's own processes (average over the minute's
    readings; None when no reading listed processes) and the GPU's temperature (maximum)."""
    me = str(workload.pk)
    acc: dict[tuple[int, datetime], list] = {}
    samples = GpuSample.objects.filter(gpu_id__in=gpu_ids, ts__gte=lo, ts__lt=hi).values_list(
        "gpu_id", "ts", "temp_c", "processes"
    )
    for gpu_id, ts, temp, processes in samples.iterator(chunk_size=2000):
        slot = acc.setdefault((gpu_id, floor_minute(ts)), [0, 0, None])
        if processes is not None:
            slot[0] += sum(int(p.get("used_mib") or 0) for p in processes if p.get("workload_id") == me)
            slot[1] += 1
        if temp is not None:
            slot[2] = temp if slot[2] is None else max(slot[2], temp)
    return {
        key: {
            "minute": key[1],
            "util_pct": None,
            "mem_used_mib": round(mem / listed) if listed else None,
            "power_w": None,
            "temp_c": temp,
        }
        for key, (mem, listed, temp) in acc.items()
    }
