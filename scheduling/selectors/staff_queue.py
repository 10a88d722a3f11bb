"""The staff queue view's reads: pending demand by GPU model and region, why it waits, and each
tenant's fair-share standing as the engine computes it.

The standing is the engine's own ``scheduling.engine.queueing.FairShare`` (weighted dominant share of
compute-weighted GPU, CPU and RAM) over the same inputs the scheduling cycle gives it: schedulable
nodes with their GPU model, CPU and RAM; every workload holding GPUs in a preemptible state, per
node; the tenants' weights. It is read without the cycle's row locks. A fixed number of queries.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from django.db.models import Count, Min, Sum

from nodes.models import SCHEDULABLE_NODE_STATES, Gpu, GpuModel
from portal.models import Tenant
from scheduling.engine import types as E
from scheduling.engine.queueing import FairShare
from scheduling.models import MILLI, WAITING_STATES, Allocation, Quota, Workload
from scheduling.services.lifecycle import PREEMPTIBLE_STATES

ENGINE_VENDORS = {v.value for v in E.Vendor}
ANY_MODEL = "Any model meeting its constraints"
ANY_REGION = "any"


@dataclass
class DemandGroup:
    models: str
    region: str
    workloads: int = 0
    gpu_milli: int = 0
    oldest: datetime | None = None
    tenants: set[int] = field(default_factory=set)

    @property
    def gpus(self) -> Decimal:
        return Decimal(self.gpu_milli) / MILLI


@dataclass
class ReasonCount:
    reason: str
    workloads: int = 0
    gpu_milli: int = 0
    oldest: datetime | None = None
    example: str = ""

    @property
    def gpus(self) -> Decimal:
        return Decimal(self.gpu_milli) / MILLI


@dataclass
class TenantStanding:
    tenant_id: int
    name: str
    slug: str
    weight: Decimal
    share: float  # weighted dominant share: the engine's ordering key, aging aside
    dominant: float  # the dominant share itself (before the weight)
    gpu_share: float  # compute-weighted GPU share of the schedulable fleet
    gpu_milli_held: int = 0
    pending: int = 0
    pending_gpu_milli: int = 0
    rank: int | None = None  # among tenants with pending work: 1 is served first

    @property
    def gpus_held(self) -> Decimal:
        return Decimal(self.gpu_milli_held) / MILLI

    @property
    def pending_gpus(self) -> Decimal:
        return Decimal(self.pending_gpu_milli) / MILLI


@dataclass
class QueueOverview:
    demand: list[DemandGroup]
    reasons: list[ReasonCount]
    standings: list[TenantStanding]
    waiting: int
    waiting_gpu_milli: int
    oldest: datetime | None

    @property
    def waiting_gpus(self) -> Decimal:
        return Decimal(self.waiting_gpu_milli) / MILLI


def _older(a: datetime | None, b: datetime) -> datetime:
    return b if a is None or b < a else a


def _fair_share(weights: dict[str, float]) -> FairShare:
    """The engine's FairShare over the fleet and the GPUs held now (three queries)."""
    catalog = {
        m.name: E.GpuModelInfo(name=m.name, compute_weight=float(m.compute_weight))
        for m in GpuModel.objects.filter(vendor__in=ENGINE_VENDORS).only("name", "compute_weight")
    }
    nodes = []
    for row in (
        Gpu.objects.filter(node__state__in=SCHEDULABLE_NODE_STATES, removed_at__isnull=True)
        .values("node_id", "node__cpu_cores", "node__ram_mib")
        .annotate(n=Count("id"), model=Min("model__name"))
        .order_by()
    ):
        if row["model"] not in catalog:
            continue
        nodes.append(
            E.Node(
                id=str(row["node_id"]),
                model=row["model"],
                gpus=[E.Gpu(index=i) for i in range(row["n"])],
                cpu_milli=row["node__cpu_cores"] * 1000,
                memory_mib=row["node__ram_mib"],
            )
        )
    held: dict[tuple[int, int], E.Running] = {}
    for a in (
        Allocation.objects.active()
        .filter(workload__state__in=PREEMPTIBLE_STATES)
        .values(
            "workload_id",
            "tenant_id",
            "node_id",
            "gpu_id",
            "fraction_milli",
            "span_milli",
            "workload__cpu_millicores",
            "workload__ram_mib",
        )
    ):
        key = (a["workload_id"], a["node_id"])
        r = held.get(key)
        if r is None:
            held[key] = E.Running(
                id=str(a["workload_id"]),
                tenant=str(a["tenant_id"]),
                node_id=str(a["node_id"]),
                gpu_indices=(a["gpu_id"],),  # FairShare counts them; which ones does not matter
                milli=a["span_milli"] or a["fraction_milli"],
                cpu_milli=a["workload__cpu_millicores"],
                memory_mib=a["workload__ram_mib"],
            )
        else:
            r.gpu_indices = (*r.gpu_indices, a["gpu_id"])
    return FairShare(nodes, catalog, list(held.values()), weights)


def queue_overview() -> QueueOverview:
    """Everything the queue page shows. Eight queries whatever the queue's and the fleet's size."""
    waiting = list(
        Workload.objects.filter(state__in=WAITING_STATES)
        .order_by("submitted_at", "id")
        .values_list(
            "id",
            "tenant_id",
            "region__code",
            "gpu_count",
            "gpu_fraction_milli",
            "submitted_at",
            "pending_reason",
            "pending_message",
        )
    )
    names: dict[int, list[str]] = defaultdict(list)
    for wid, name in (
        Workload.gpu_models.through.objects.filter(workload__state__in=WAITING_STATES)
        .order_by("gpumodel__name")
        .values_list("workload_id", "gpumodel__name")
    ):
        names[wid].append(name)

    groups: dict[tuple[str, str], DemandGroup] = {}
    reasons: dict[str, ReasonCount] = {}
    pending: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    total_milli, oldest = 0, None
    for wid, tenant_id, region, count, fraction, submitted, reason, message in waiting:
        milli = count * fraction
        total_milli += milli
        oldest = _older(oldest, submitted)
        models = " / ".join(names.get(wid, ())) or ANY_MODEL
        g = groups.get((models, region or ANY_REGION))
        if g is None:
            g = groups[(models, region or ANY_REGION)] = DemandGroup(
                models=models, region=region or ANY_REGION
            )
        g.workloads += 1
        g.gpu_milli += milli
        g.oldest = _older(g.oldest, submitted)
        g.tenants.add(tenant_id)
        # As the API shows it: no reason recorded yet reads "queued".
        rc = reasons.get(reason or "queued")
        if rc is None:
            rc = reasons[reason or "queued"] = ReasonCount(reason=reason or "queued", example=message)
        rc.workloads += 1
        rc.gpu_milli += milli
        rc.oldest = _older(rc.oldest, submitted)
        rc.example = rc.example or message
        pending[tenant_id][0] += 1
        pending[tenant_id][1] += milli

    weights_dec = dict(Quota.objects.values_list("tenant_id", "fair_share_weight"))
    fair = _fair_share({str(t): float(w) for t, w in weights_dec.items()})
    held_milli: dict[int, int] = defaultdict(int)
    for tenant_id, m in (
        Allocation.objects.active()
        .values("tenant_id")
        .annotate(m=Sum("fraction_milli"))
        .values_list("tenant_id", "m")
        .order_by()
    ):
        held_milli[tenant_id] = m
    tenant_ids = set(pending) | set(held_milli) | {int(t) for t in fair.use}
    tenants = {t.pk: t for t in Tenant.objects.filter(pk__in=tenant_ids).only("name", "slug")}
    standings = []
    for tid in tenant_ids:
        t = tenants.get(tid)
        if t is None:
            continue
        weight = weights_dec.get(tid, Decimal(1))
        share = fair.share(str(tid))
        u = fair.use.get(str(tid))
        standings.append(
            TenantStanding(
                tenant_id=tid,
                name=t.name,
                slug=t.slug,
                weight=weight,
                share=share,
                dominant=share * float(weight),
                gpu_share=(u[0] / fair.total_gpu) if u else 0.0,
                gpu_milli_held=held_milli.get(tid, 0),
                pending=pending[tid][0] if tid in pending else 0,
                pending_gpu_milli=pending[tid][1] if tid in pending else 0,
            )
        )
    standings.sort(key=lambda s: (s.share, s.name))
    rank = 0
    for s in standings:
        if s.pending:
            rank += 1
            s.rank = rank
    return QueueOverview(
        demand=sorted(groups.values(), key=lambda g: (-g.gpu_milli, g.models, g.region)),
        reasons=sorted(reasons.values(), key=lambda r: (-r.workloads, r.reason)),
        standings=standings,
        waiting=len(waiting),
        waiting_gpu_milli=total_milli,
        oldest=oldest,
    )
