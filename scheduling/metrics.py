"""Prometheus metrics of scheduling.

The cycle runs in a Celery worker, so what it counts (cycles by result, their duration, the time
of the last success, each placed workload's wait) is stored in the database by ``cycle_record``
(one upsert per cycle; plus one query for the waits when a cycle placed work). The web tier reads
it back at scrape time with gauges it computes there: workloads waiting by plan, GPUs allocated
by model, region and plan, and fragmentation by model and region (cached for a few seconds, as it
walks the fleet).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

from prometheus_client.core import GaugeMetricFamily

from portal.metrics import StoredCollector, StoredMetric, TtlCache, metrics_store_safely, register_once

QUEUE_WAIT = StoredMetric(
    "gpupool_scheduling_queue_wait_seconds",
    "From submit (or requeue) to SCHEDULED, observed once per placement, by plan.",
    "histogram",
    ("plan",),
    buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 24 * 3600),
)
CYCLE_DURATION = StoredMetric(
    "gpupool_scheduling_cycle_duration_seconds",
    "One scheduling cycle, lock to commit.",
    "histogram",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CYCLES = StoredMetric(
    "gpupool_scheduling_cycles",
    "Scheduling cycles by result (skipped: another cycle held the lock).",
    "counter",
    ("result",),
)
LAST_SUCCESS = StoredMetric(
    "gpupool_scheduling_last_success_timestamp_seconds",
    "Unix time of the last scheduling cycle that committed (0: none yet).",
    "gauge",
)
STORED = [QUEUE_WAIT, CYCLE_DURATION, CYCLES, LAST_SUCCESS]
FRAGMENTATION_CACHE_S = 15
_cache = TtlCache(FRAGMENTATION_CACHE_S)


def cycle_record(*, result: str, seconds: float | None = None, placed: list[int] = ()) -> None:  # type: ignore[assignment]
    """Store one cycle's outcome: ``result`` is ok, failed or skipped."""
    rows = CYCLES.inc(result)
    if seconds is not None:
        rows += CYCLE_DURATION.observe(seconds)
    if result == "ok":
        rows += LAST_SUCCESS.set(time.time())
    if placed:
        from scheduling.models import Workload

        for plan, attempt, submitted, queued, scheduled in Workload.objects.filter(pk__in=placed).values_list(
            "plan", "attempt", "submitted_at", "queued_at", "scheduled_at"
        ):
            since = queued if attempt > 1 and queued else submitted
            if scheduled is not None:
                rows += QUEUE_WAIT.observe(max((scheduled - since).total_seconds(), 0.0), plan)
    metrics_store_safely(rows)


@contextmanager
def cycle_recorded():
    """Times the block (one cycle) and stores its outcome; the block sets ``outcome["result"]``
    (a ``CycleResult``). An exception counts as a failed cycle and propagates."""
    outcome: dict = {}
    started = time.perf_counter()
    try:
        yield outcome
    except Exception:
        cycle_record(result="failed", seconds=time.perf_counter() - started)
        raise
    r = outcome.get("result")
    if r is None or not r.ran:
        cycle_record(result="skipped")
    else:
        cycle_record(result="ok", seconds=time.perf_counter() - started, placed=list(r.placed))


# --- read at scrape time -------------------------------------------------------------------------

# The request shapes fragmentation is measured against when there is no recent history.
DEFAULT_SHAPES = ((1, 1000), (2, 1000), (4, 1000), (8, 1000))
HISTORY = 1000  # the last workloads submitted give the common request shapes


def _live():
    from django.db.models import Count, F, Sum

    from scheduling.models import WAITING_STATES, Allocation, Plan, Workload

    pending = GaugeMetricFamily(
        "gpupool_scheduling_pending_workloads",
        "Workloads waiting to be placed (PENDING or QUEUED), by plan.",
        labels=["plan"],
    )
    counts = dict(
        Workload.objects.filter(state__in=list(WAITING_STATES)).values_list("plan").annotate(n=Count("id"))
    )
    for plan in Plan.values:
        pending.add_metric([plan], counts.get(plan, 0))
    yield pending

    allocated = GaugeMetricFamily(
        "gpupool_gpus_allocated",
        "GPUs held by allocations (fractions add up), by model, region and plan.",
        labels=["model", "region", "plan"],
    )
    for row in (
        Allocation.objects.active()
        .values("plan", model=F("gpu_model__name"), region=F("node__region__code"))
        .annotate(milli=Sum("fraction_milli"))
        .order_by()
    ):
        allocated.add_metric([row["model"], row["region"], row["plan"]], row["milli"] / 1000)
    yield allocated

    fragmentation = GaugeMetricFamily(
        "gpupool_scheduling_fragmentation",
        "Share (0-1) of free GPU capacity that the common request shapes cannot use, by model and region.",
        labels=["model", "region"],
    )
    for (model, region), share in sorted(_cache.get("fragmentation", fleet_fragmentation).items()):
        fragmentation.add_metric([model, region], share)
    yield fragmentation


def fleet_fragmentation() -> dict[tuple[str, str], float]:
    """(model, region) -> fragmentation share of the free capacity on schedulable nodes, against
    the shapes of the last workloads submitted (scheduling.engine.fragmentation). Four queries."""
    from django.db.models import F

    from nodes.models import SCHEDULABLE_NODE_STATES, Gpu, GpuHealth, Node
    from scheduling.engine.fragmentation import Distribution, node_fragmentation
    from scheduling.engine.spec import Demand
    from scheduling.models import MILLI, Allocation, Workload

    nodes = {
        n["id"]: n
        for n in Node.objects.filter(state__in=SCHEDULABLE_NODE_STATES).values(
            "id", "cpu_cores", "ram_mib", region_code=F("region__code")
        )
    }
    if not nodes:
        return {}
    used: dict[int, int] = defaultdict(int)
    load: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    for node_id, gpu_id, milli, wid, cpu, ram in Allocation.objects.active().values_list(
        "node_id", "gpu_id", "fraction_milli", "workload_id", "workload__cpu_millicores", "workload__ram_mib"
    ):
        used[gpu_id] += milli
        load[node_id][wid] = (cpu, ram)
    islands: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    node_model: dict[int, str] = {}
    for gid, node_id, model, health, isolated, island, numa in Gpu.objects.filter(
        node_id__in=list(nodes), removed_at__isnull=True, model__isnull=False
    ).values_list("id", "node_id", "model__name", "health", "isolated", "nvlink_island", "numa_node"):
        node_model.setdefault(node_id, model)
        if health != GpuHealth.HEALTHY or isolated:
            continue
        key = island if island is not None else (numa or 0)
        islands[node_id][key].append(max(MILLI - used[gid], 0))
    models = frozenset(node_model.values())
    shapes = list(
        Workload.objects.filter(gang=False, gpu_count__gt=0)
        .order_by("-id")
        .values_list("gpu_count", "gpu_fraction_milli", "cpu_millicores", "ram_mib")[:HISTORY]
    ) or [(g, m, 0, 0) for g, m in DEFAULT_SHAPES]
    dist = Distribution.from_demands(Demand(models, m, g, c, r) for g, m, c, r in shapes)
    free: dict[tuple[str, str], float] = defaultdict(float)
    stranded: dict[tuple[str, str], float] = defaultdict(float)
    for node_id, groups in islands.items():
        n = nodes[node_id]
        key = (node_model[node_id], n["region_code"])
        gkey = tuple(tuple(sorted(groups[i], reverse=True)) for i in sorted(groups))
        cpu_used = sum(c for c, _ in load[node_id].values())
        ram_used = sum(r for _, r in load[node_id].values())
        free[key] += sum(map(sum, gkey))
        stranded[key] += node_fragmentation(
            dist, key[0], n["cpu_cores"] * 1000 - cpu_used, n["ram_mib"] - ram_used, gkey, True
        )
    return {key: (stranded[key] / total if total else 0.0) for key, total in free.items()}


def register_collector() -> None:
    register_once("scheduling", StoredCollector(STORED, live=_live))
