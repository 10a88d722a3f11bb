"""Reads of the fleet that other apps (scheduling, metering, the UI) share."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

from django.conf import settings
from django.db.models import (
    Avg,
    BooleanField,
    Count,
    Exists,
    ExpressionWrapper,
    OuterRef,
    Q,
    QuerySet,
    Sum,
)
from django.utils import timezone

from nodes.models import (
    FleetAlert,
    Gpu,
    GpuHealth,
    GpuMinuteRollup,
    GpuModel,
    GpuSample,
    Node,
    NodeCommand,
    NodeState,
    Region,
    SoftwareStack,
    UnknownGpuReport,
)


def gpus_schedulable(*, region: str | None = None, model: GpuModel | None = None) -> QuerySet[Gpu]:
    """GPUs that may take new work: healthy, not isolated, present, on a READY node."""
    qs = Gpu.objects.filter(
        health=GpuHealth.HEALTHY, isolated=False, removed_at__isnull=True, node__state=NodeState.READY
    ).select_related("node", "model")
    if region:
        qs = qs.filter(node__region__code=region)
    if model is not None:
        qs = qs.filter(model=model)
    return qs


@dataclass(frozen=True)
class GpuRow:
    id: int
    uuid: str
    index: int
    model_id: int | None
    model_name: str
    memory_mib: int
    nvlink_island: int | None
    numa_node: int | None
    mig_mode: bool
    schedulable: bool


@dataclass(frozen=True)
class NodeRow:
    id: int
    hostname: str
    region: str
    state: str
    interconnect: str
    labels: dict
    cpu_cores: int
    ram_mib: int
    last_heartbeat_at: datetime | None
    gpus: tuple[GpuRow, ...]


def fleet_inventory(*, include_unschedulable: bool = True) -> list[NodeRow]:
    """The whole fleet as plain data (three queries), for a scheduler snapshot."""
    nodes = Node.objects.select_related("region").order_by("id")
    if not include_unschedulable:
        nodes = nodes.filter(state=NodeState.READY)
    gpus: dict[int, list[GpuRow]] = {}
    for g in (
        Gpu.objects.filter(removed_at__isnull=True, node__in=nodes)
        .select_related("model")
        .order_by("node_id", "index")
    ):
        gpus.setdefault(g.node_id, []).append(
            GpuRow(
                id=g.id,
                uuid=g.uuid,
                index=g.index,
                model_id=g.model_id,
                model_name=g.model.name if g.model else g.reported_name,
                memory_mib=g.memory_mib,
                nvlink_island=g.nvlink_island,
                numa_node=g.numa_node,
                mig_mode=g.mig_mode,
                schedulable=g.schedulable,
            )
        )
    return [
        NodeRow(
            id=n.id,
            hostname=n.hostname,
            region=n.region.code,
            state=n.state,
            interconnect=n.interconnect,
            labels=n.labels,
            cpu_cores=n.cpu_cores,
            ram_mib=n.ram_mib,
            last_heartbeat_at=n.last_heartbeat_at,
            gpus=tuple(gpus.get(n.id, ())),
        )
        for n in nodes
    ]


def gpu_models_supporting(
    *, stack: str | None = None, min_cuda_cc: tuple[int, int] | None = None, gfx_target: str | None = None
) -> list[GpuModel]:
    """Catalog models that can run a request: e.g. ``stack="cuda", min_cuda_cc=(8, 0)`` for
    Ampere or newer, ``stack="rocm"``, or one ROCm ``gfx_target``."""
    models = list(GpuModel.objects.all())
    if stack:
        models = [m for m in models if m.software_stack == stack]
    if min_cuda_cc is not None:
        models = [
            m
            for m in models
            if m.software_stack == SoftwareStack.CUDA and m.cuda_cc_tuple and m.cuda_cc_tuple >= min_cuda_cc
        ]
    if gfx_target:
        models = [m for m in models if m.gfx_target == gfx_target]
    return models


def gpu_rollups_between(*, gpu_ids: list[int], start: datetime, end: datetime) -> QuerySet[GpuMinuteRollup]:
    """Minute rollups of these GPUs in ``[start, end)``: what metering joins allocation intervals with."""
    return GpuMinuteRollup.objects.filter(gpu_id__in=gpu_ids, minute__gte=start, minute__lt=end).order_by(
        "gpu_id", "minute"
    )


def node_commands_history(*, node: Node, limit: int = 100) -> QuerySet[NodeCommand]:
    return NodeCommand.objects.filter(node=node).prefetch_related("events").order_by("-created_at")[:limit]


# --- the staff fleet pages (overview, node detail, live snapshot) ------------------------------------
# Every read below is a fixed number of queries whatever the fleet's size: counts are aggregated in
# the database, the heat map and the snapshot read one row per GPU as tuples, no model instances.


@dataclass(frozen=True)
class FleetFilters:
    region: str = ""
    state: str = ""
    model: int | None = None  # GpuModel id: nodes with at least one GPU of it
    q: str = ""  # part of the hostname

    @property
    def active(self) -> bool:
        return bool(self.region or self.state or self.model or self.q)


def fleet_node_counts() -> dict:
    """Nodes by state, and by region and state: ``{"total", "by_state": {state: n}, "regions": [...]}``
    (every state and every region present, zeros included). Two queries."""
    regions = list(Region.objects.order_by("code").values_list("code", "name", "location"))
    by_region: dict[str, dict[str, int]] = {
        code: dict.fromkeys(NodeState.values, 0) for code, _, _ in regions
    }
    by_state = dict.fromkeys(NodeState.values, 0)
    simulated = 0
    for code, state, is_sim, n in (
        Node.objects.values_list("region__code", "state", "simulated").annotate(n=Count("id")).order_by()
    ):
        by_region.setdefault(code, dict.fromkeys(NodeState.values, 0))[state] += n
        by_state[state] += n
        if is_sim:
            simulated += n
    return {
        "total": sum(by_state.values()),
        "simulated": simulated,
        "by_state": by_state,
        "regions": [
            {
                "code": code,
                "name": name,
                "location": location,
                "states": by_region[code],
                "total": sum(by_region[code].values()),
            }
            for code, name, location in regions
        ],
    }


def fleet_gpu_counts() -> dict:
    """GPUs by model and health (one query): ``{"total", "healthy", "unhealthy", "isolated",
    "util_avg", "models": [{"name", "vendor", "total", "healthy", "unhealthy", "isolated", "util_avg"}]}``.
    An isolated GPU counts as isolated whatever its health; ``healthy`` means schedulable health."""
    fresh = Q(last_sample_at__gte=telemetry_stale_before())  # a silent GPU has no current utilisation
    models: dict[str, dict] = {}
    util_weighted = 0.0
    util_n = 0
    for name, reported, vendor, health, isolated, n, util_avg, util_n_row in (
        Gpu.objects.filter(removed_at__isnull=True)
        .values_list("model__name", "reported_name", "model__vendor", "health", "isolated")
        .annotate(
            n=Count("id"),
            util=Avg("last_util_pct", filter=fresh),
            util_n=Count("last_util_pct", filter=fresh),
        )
        .order_by()
    ):
        key = name or f"{reported} (not in the catalog)"
        m = models.setdefault(
            key,
            {"name": key, "vendor": vendor or "", "known": bool(name), "total": 0, "healthy": 0,
             "unhealthy": 0, "isolated": 0, "_util": 0.0, "_util_n": 0},
        )  # fmt: skip
        m["total"] += n
        if health == GpuHealth.UNHEALTHY:
            m["unhealthy"] += n
        if isolated:
            m["isolated"] += n
        if health == GpuHealth.HEALTHY and not isolated:
            m["healthy"] += n
        if util_avg is not None:
            m["_util"] += util_avg * util_n_row
            m["_util_n"] += util_n_row
            util_weighted += util_avg * util_n_row
            util_n += util_n_row
    rows = sorted(models.values(), key=lambda m: (-m["total"], m["name"]))
    for m in rows:
        m["util_avg"] = round(m.pop("_util") / m["_util_n"], 1) if m["_util_n"] else None
        m.pop("_util_n")
    return {
        "total": sum(m["total"] for m in rows),
        "healthy": sum(m["healthy"] for m in rows),
        "unhealthy": sum(m["unhealthy"] for m in rows),
        "isolated": sum(m["isolated"] for m in rows),
        "util_avg": round(util_weighted / util_n, 1) if util_n else None,
        "models": rows,
    }


def fleet_alerts_open() -> list[FleetAlert]:
    return list(FleetAlert.objects.filter(resolved_at__isnull=True).order_by("-opened_at")[:20])


def unknown_gpu_reports_open(*, limit: int = 20) -> list[UnknownGpuReport]:
    return list(
        UnknownGpuReport.objects.filter(resolved_at__isnull=True)
        .select_related("example_node")
        .order_by("-last_seen_at")[:limit]
    )


def telemetry_stale_before(now: datetime | None = None) -> datetime:
    """A GPU whose last sample is older than this shows no current value (its node went quiet)."""
    return (now or timezone.now()) - timedelta(seconds=settings.NODE_SUSPECT_AFTER_S)


def fresh_sample(now: datetime | None = None) -> ExpressionWrapper:
    """``Gpu`` annotation: its last sample is current. Compared in the database, so that reading
    16,000 GPUs does not build 16,000 datetimes."""
    return ExpressionWrapper(Q(last_sample_at__gte=telemetry_stale_before(now)), output_field=BooleanField())


class HeatGpu(NamedTuple):  # a tuple: 16,000 of them are made for a 2,000-node fleet
    id: int
    index: int
    model_key: int  # index into FleetHeatmap.models
    util: float | None  # None: no current sample
    mem_gib: float | None
    power_w: float | None
    temp_c: int | None
    health: str
    isolated: bool


@dataclass(frozen=True)
class HeatNode:
    id: int
    hostname: str
    state: str
    simulated: bool
    gpus: list[HeatGpu]


@dataclass(frozen=True)
class HeatRegion:
    code: str
    name: str
    nodes: list[HeatNode]

    @property
    def gpu_count(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)


@dataclass(frozen=True)
class FleetHeatmap:
    regions: list[HeatRegion]
    models: list[tuple[str, int]]  # (short name, memory GiB)

    @property
    def gpu_count(self) -> int:
        return sum(r.gpu_count for r in self.regions)


def fleet_heatmap(*, now: datetime | None = None) -> FleetHeatmap:
    """Every present GPU grouped by node, nodes grouped by region (three queries, tuples only)."""
    nodes: dict[int, HeatNode] = {}
    regions: dict[str, HeatRegion] = {}
    for node_id, hostname, state, simulated, code, name in Node.objects.order_by(
        "region__code", "hostname"
    ).values_list("id", "hostname", "state", "simulated", "region__code", "region__name"):
        region = regions.get(code)
        if region is None:
            region = regions[code] = HeatRegion(code=code, name=name, nodes=[])
        node = nodes[node_id] = HeatNode(
            id=node_id, hostname=hostname, state=state, simulated=simulated, gpus=[]
        )
        region.nodes.append(node)
    catalog = {pk: (short or name, mem) for pk, short, name, mem in GpuModel.objects.values_list(
        "id", "short_name", "name", "memory_gib")}  # fmt: skip
    model_keys: dict[tuple[str, int], int] = {}
    for (
        gpu_id, node_id, index, model_id, reported, mem_mib, fresh, util, mem_used, power, temp, health, isolated,
    ) in (
        Gpu.objects.filter(removed_at__isnull=True)
        .annotate(fresh=fresh_sample(now))
        .order_by("node_id", "index")
        .values_list(
            "id", "node_id", "index", "model_id", "reported_name", "memory_mib", "fresh", "last_util_pct",
            "last_mem_used_mib", "last_power_w", "last_temp_c", "health", "isolated",
        )
    ):  # fmt: skip
        label = catalog.get(model_id) or (reported, round(mem_mib / 1024))
        key = model_keys.setdefault(label, len(model_keys))
        if fresh and util is not None:
            gpu = HeatGpu(
                gpu_id, index, key, round(util, 1),
                round(mem_used / 1024, 1) if mem_used is not None else None,
                round(power) if power is not None else None, temp, health, isolated,
            )  # fmt: skip
        else:
            gpu = HeatGpu(gpu_id, index, key, None, None, None, None, health, isolated)
        nodes[node_id].gpus.append(gpu)
    kept = [
        HeatRegion(code=r.code, name=r.name, nodes=[n for n in r.nodes if n.gpus]) for r in regions.values()
    ]
    return FleetHeatmap(regions=[r for r in kept if r.nodes], models=list(model_keys))


def fleet_nodes(*, filters: FleetFilters) -> QuerySet[Node]:
    """The node table's rows, filtered, by hostname. Paginate it, then read the page's GPU figures
    with :func:`fleet_node_stats` (aggregating only the nodes shown)."""
    qs = Node.objects.select_related("region")
    if filters.region:
        qs = qs.filter(region__code=filters.region)
    if filters.state:
        qs = qs.filter(state=filters.state)
    if filters.model:
        qs = qs.filter(
            Exists(Gpu.objects.filter(node=OuterRef("pk"), model_id=filters.model, removed_at__isnull=True))
        )
    if filters.q:
        qs = qs.filter(hostname__icontains=filters.q)
    return qs.order_by("hostname")


@dataclass
class NodeStats:
    gpu_count: int = 0
    gpu_attention: int = 0  # unhealthy or isolated
    util_avg: float | None = None  # over GPUs with a current sample
    models: list[tuple[int, str]] | None = None  # (count, model), most first


def fleet_node_stats(*, node_ids: list[int]) -> dict[int, NodeStats]:
    """GPU count, GPUs needing attention, current average utilisation and models of each node (one
    query, grouped by node and model)."""
    fresh = Q(last_sample_at__gte=telemetry_stale_before()) & Q(last_util_pct__isnull=False)
    sums: dict[int, list] = {}
    for node_id, short, name, reported, n, attention, util_sum, util_n in (
        Gpu.objects.filter(node_id__in=node_ids, removed_at__isnull=True)
        .values_list("node_id", "model__short_name", "model__name", "reported_name")
        .annotate(
            n=Count("id"),
            attention=Count("id", filter=Q(health=GpuHealth.UNHEALTHY) | Q(isolated=True)),
            util_sum=Sum("last_util_pct", filter=fresh),
            util_n=Count("id", filter=fresh),
        )
        .order_by("node_id", "-n")
    ):
        acc = sums.setdefault(node_id, [0, 0, 0.0, 0, []])
        acc[0] += n
        acc[1] += attention
        acc[2] += util_sum or 0.0
        acc[3] += util_n
        acc[4].append((n, short or name or reported))
    return {
        node_id: NodeStats(
            gpu_count=n, gpu_attention=attention, util_avg=round(u / un, 1) if un else None, models=models
        )
        for node_id, (n, attention, u, un, models) in sums.items()
    }


def node_gpus(*, node: Node) -> list[Gpu]:
    return list(
        Gpu.objects.filter(node=node, removed_at__isnull=True).select_related("model").order_by("index")
    )


def node_state_history(*, node: Node, limit: int = 20) -> QuerySet:
    """Staff actions on the node and its GPUs, from the audit log, newest first."""
    from portal.models import AuditEvent

    gpu_ids = [str(pk) for pk in Gpu.objects.filter(node=node).values_list("id", flat=True)]
    return (
        AuditEvent.objects.filter(tenant__isnull=True)
        .filter(
            Q(target_type="nodes.node", target_id=str(node.pk))
            | Q(target_type="nodes.gpu", target_id__in=gpu_ids)
        )
        .select_related("actor_user")
        .order_by("-created", "-id")[:limit]
    )


TELEMETRY_METRICS = ("util", "mem", "power", "temp")


def node_telemetry(*, gpus: list[Gpu], start: datetime, now: datetime | None = None) -> dict:
    """Chart data for a node's GPUs since ``start``: per-minute rollups for the finished minutes, then
    the raw samples of the minute in progress (two queries).

    Returns ``{"x": [unix seconds], "gpus": [{"id", "label"}], "util": [[...] per GPU], "mem": ...,
    "power": ..., "temp": ...}`` with ``None`` where a GPU has no point at that time. Utilisation is a
    percentage (minute average), memory GiB used (average), power W (average), temperature °C (max).
    """
    now = now or timezone.now()
    ids = [g.id for g in gpus]
    column = {gpu_id: i for i, gpu_id in enumerate(ids)}
    current_minute = now.replace(second=0, microsecond=0)
    points: dict[int, list] = {}

    def put(ts: int, i: int, util, mem_mib, power, temp) -> None:
        row = points.get(ts)
        if row is None:
            row = points[ts] = [[None] * len(ids) for _ in TELEMETRY_METRICS]
        # A gauge the GPU could not report (MIG mode, fell off the bus) is a gap in its line.
        row[0][i] = None if util is None else round(util, 1)
        row[1][i] = None if mem_mib is None else round(mem_mib / 1024, 2)
        row[2][i] = None if power is None else round(power, 1)
        row[3][i] = temp

    # Rows, not model instances: a day of minutes for eight GPUs is 11,520 of them.
    rollups = GpuMinuteRollup.objects.filter(
        gpu_id__in=ids, minute__gte=start, minute__lt=current_minute, sample_count__gt=0
    ).values_list(
        "gpu_id", "minute", "util_sum", "util_count", "mem_used_sum", "mem_used_count", "power_sum",
        "power_count", "temp_max",
    )  # fmt: skip
    for gpu_id, minute, util_sum, util_n, mem_sum, mem_n, power_sum, power_n, temp_max in rollups:
        put(
            int(minute.timestamp()),
            column[gpu_id],
            util_sum / util_n if util_n else None,  # as GpuMinuteRollup.util_avg and the others
            mem_sum / mem_n if mem_n else None,
            power_sum / power_n if power_n else None,
            temp_max,
        )
    for gpu_id, ts, util, mem, power, temp in (
        GpuSample.objects.filter(gpu_id__in=ids, ts__gte=max(current_minute, start), ts__lte=now)
        .order_by("-ts")
        .values_list("gpu_id", "ts", "util_pct", "mem_used_mib", "power_w", "temp_c")[: 60 * max(len(ids), 1)]
    ):
        put(int(ts.timestamp()), column[gpu_id], util, mem, power, temp)
    xs = sorted(points)
    data: dict = {
        "x": xs,
        "gpus": [{"id": g.id, "label": f"GPU {g.index}"} for g in gpus],
    }
    for m, metric in enumerate(TELEMETRY_METRICS):
        data[metric] = [[points[x][m][i] for x in xs] for i in range(len(ids))]
    return data
