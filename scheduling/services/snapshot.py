"""The scheduling cycle's snapshot: the fleet, the queue and what the commit step needs, loaded from
the database with a fixed number of queries whatever the fleet and queue size (catalog, READY nodes,
their GPUs, open allocations with their workloads' fields, the queue, the queue's GPU-model choices,
reservations in force, per-model quota limits and preemptions in progress).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nodes.mig_profiles import layout_from_json
from nodes.models import SCHEDULABLE_NODE_STATES, Gpu, GpuHealth, GpuModel, Node, Region, RegionBackend
from scheduling.engine import types as E
from scheduling.engine.queueing import QueuePolicy as EnginePolicy
from scheduling.engine.spec import allowed_models, version_key
from scheduling.locks import lock_workloads_where
from scheduling.models import (
    MILLI,
    Allocation,
    Quota,
    QuotaModelLimit,
    Reservation,
    ReservationStatus,
    Workload,
    WorkloadEvent,
    WorkloadKind,
    WorkloadState,
)
from scheduling.pricing import gpu_price_table
from scheduling.services.lifecycle import PREEMPTIBLE_STATES
from scheduling.services.placement import placement_constraints, placement_prices
from scheduling.services.warm_pools import WarmBinding

ENGINE_VENDORS = {v.value for v in E.Vendor}


@functools.lru_cache(maxsize=256)
def node_versions(driver: str, cuda: str, rocm: str) -> E.SoftwareVersions:
    """A node's reported versions as the engine compares them (a fleet has few distinct ones)."""
    return E.SoftwareVersions(driver=version_key(driver), cuda=version_key(cuda), rocm=version_key(rocm))


ENGINE_POLICIES = frozenset(p.value for p in EnginePolicy)


def _epoch(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


def from_epoch(t: float | None) -> datetime | None:
    return datetime.fromtimestamp(t, tz=UTC) if t is not None else None


def _model_info(m: GpuModel) -> E.GpuModelInfo:
    return E.GpuModelInfo(
        name=m.name,
        vendor=E.Vendor(m.vendor),
        memory_mib=m.memory_gib * 1024,
        compute_weight=float(m.compute_weight),
        cuda_capability=m.cuda_cc_tuple,
        rocm_target=m.gfx_target or None if m.vendor == "amd" else None,
        mig_profiles=tuple(m.mig_profiles or ()),
        oversubscription=float(m.oversubscription),
    )


@dataclass
class CycleContext:
    """What the commit step needs besides the decisions."""

    now: datetime
    workloads: dict[int, Workload]
    gpus: dict[tuple[int, int], dict[str, Any]]  # (node id, gpu index) -> gpu row
    ranges: dict[int, list[tuple[int, int, int]]]  # gpu id -> open (offset, fraction, alloc id)
    holders: dict[int, list[dict[str, Any]]]  # workload id -> its open allocation rows
    model_use: dict[tuple[int, int], int]  # (tenant id, model id) -> milli held
    model_limits: dict[tuple[int, int], int]  # (tenant id, model id) -> max GPUs
    model_ids: dict[str, int]
    waiting_for_victims: dict[int, int]  # preemptor id -> victims still holding
    quota_blocked: set[int]  # queued workloads whose every acceptable model is at its quota
    chosen_models: dict[int, list[str]] = field(default_factory=dict)  # workload -> model names
    warm_hits: dict[int, WarmBinding] = field(default_factory=dict)  # workload -> warm slots it binds
    draining_nodes: set[int] = field(default_factory=set)  # nodes whose victims are stopping
    mig_gpus: set[int] = field(default_factory=set)  # GPUs in MIG mode
    mig_used: dict[int, list[tuple[str, int]]] = field(default_factory=dict)  # gpu id -> (profile, start)
    model_info: dict[int, E.GpuModelInfo] = field(default_factory=dict)  # model id -> catalog entry


def _priority(workload_pc: str, plan: str) -> E.PriorityClass | None:
    if not workload_pc:
        return None
    return E.PriorityClass[workload_pc.upper()]


def _spot_excluded(
    queue: dict[int, Workload], catalog_rows: list[GpuModel], pairs: set[tuple[str, str]]
) -> dict[int, frozenset[tuple[str, str]]]:
    """Per queued spot workload with a maximum price: the (model, region) pairs of the fleet where the
    spot price (``scheduling.pricing``, the market price metering keeps) is above it. Without this a
    workload preempted at its maximum price would be placed again at once and preempted again."""
    capped = [w for w in queue.values() if w.plan == E.Plan.SPOT and w.spot_max_price is not None]
    if not capped or not pairs:
        return {}
    models = {m.name: m for m in catalog_rows}
    regions = {r.code: r for r in Region.objects.filter(code__in={code for _, code in pairs})}
    known = [(name, code) for name, code in pairs if name in models and code in regions]
    table = gpu_price_table(pairs=[(models[name], regions[code]) for name, code in known])
    prices = {(name, code): table[(models[name].pk, regions[code].pk)]["spot"] for name, code in known}
    out: dict[int, frozenset[tuple[str, str]]] = {}
    for w in capped:
        over = frozenset(k for k, price in prices.items() if price is not None and price > w.spot_max_price)
        if over:
            out[w.pk] = over
    return out


def cycle_snapshot_load(now: datetime) -> tuple[E.Snapshot, list[E.Request], CycleContext]:
    catalog_rows = list(GpuModel.objects.all())
    catalog = {m.name: _model_info(m) for m in catalog_rows if m.vendor in ENGINE_VENDORS}
    model_ids = {m.name: m.pk for m in catalog_rows}
    model_names = {m.pk: m.name for m in catalog_rows}

    node_rows = {
        n["id"]: n
        for n in Node.objects.filter(state__in=SCHEDULABLE_NODE_STATES).values(
            "id",
            "region__code",
            "domain",
            "cpu_cores",
            "ram_mib",
            "labels",
            "driver_version",
            "cuda_version",
            "rocm_version",
        )
    }
    gpu_rows = list(
        # The nodes' filter again, not their ids: a statement that does not grow with the fleet
        # (500 parameters at 500 nodes) is prepared once and planned once.
        Gpu.objects.filter(node__state__in=SCHEDULABLE_NODE_STATES, removed_at__isnull=True)
        .order_by("node_id", "index")
        .values(
            "id",
            "node_id",
            "index",
            "uuid",
            "model_id",
            "health",
            "isolated",
            "nvlink_island",
            "numa_node",
            "mig_mode",
            "mig_layout",
            "mig_configuring",
        )
    )
    # (A node that became schedulable between the two statements waits for the next cycle.)
    gpu_rows = [g for g in gpu_rows if g["node_id"] in node_rows]
    gpus = {(g["node_id"], g["index"]): g for g in gpu_rows}

    allocs = list(
        Allocation.objects.active().values(
            "id",
            "workload_id",
            "node_id",
            "gpu_id",
            "gpu_model_id",
            "fraction_milli",
            "span_milli",
            "milli_offset",
            "mig_start",
            "tenant_id",
            "workload__state",
            "workload__kind",
            "workload__plan",
            "workload__priority_class",
            "workload__cpu_millicores",
            "workload__ram_mib",
            "workload__gang",
            "workload__scheduled_at",
            "workload__started_at",
            "workload__estimated_runtime_s",
            "workload__max_runtime_s",
            "workload__checkpoint_resume",
            "workload__requeue_on_preemption",
            "workload__mig_profile",
            "workload__array_parent_id",
            "workload__elastic_min_gpus",
            "workload__elastic_target_gpus",
        )
    )
    # Each allocation's GPU index from the GPUs just read, rather than a join that reads every GPU
    # row again (a sequential scan of the fleet's GPUs: two thirds of the statement's time at 4,000
    # GPUs); GPUs of nodes outside the snapshot (draining, offline) are asked for by id.
    gpu_index = {g["id"]: g["index"] for g in gpu_rows}
    missing = {a["gpu_id"] for a in allocs} - gpu_index.keys()
    if missing:
        gpu_index.update(Gpu.objects.filter(pk__in=missing).values_list("id", "index"))
    used: dict[int, int] = defaultdict(int)
    ranges: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    holders: dict[int, list[dict[str, Any]]] = defaultdict(list)
    model_use: dict[tuple[int, int], int] = defaultdict(int)
    node_load: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)  # node -> workload -> (cpu, ram)
    mig_gpus = {g["id"] for g in gpu_rows if g["mig_mode"]}
    mig_used: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for a in allocs:
        # Capacity is counted in what each row spans (less than its fraction on an over-subscribed
        # GPU); quotas count the fractions asked for.
        a["span"] = a["span_milli"] or a["fraction_milli"]
        a["gpu__index"] = gpu_index[a["gpu_id"]]
        used[a["gpu_id"]] += a["span"]
        ranges[a["gpu_id"]].append((a["milli_offset"], a["span"], a["id"]))
        if a["workload__mig_profile"] and a["mig_start"] is not None:
            mig_used[a["gpu_id"]].append((a["workload__mig_profile"], a["mig_start"]))
        holders[a["workload_id"]].append(a)
        model_use[(a["tenant_id"], a["gpu_model_id"])] += a["fraction_milli"]
        node_load[a["node_id"]][a["workload_id"]] = (a["workload__cpu_millicores"], a["workload__ram_mib"])

    # Reservations in force: nodes of the model in the region, enough to cover the count, preferring
    # nodes that already run the owner's work, then by id (stable). A count that ends inside a node
    # reserves that node in part: the engine keeps the owner's unused share of it free (or lent).
    reserved_for: dict[int, str] = {}
    reserved_gpus: dict[int, int] = {}  # partly reserved node -> the owner's unused share there
    reservation_nodes: dict[int, list[int]] = defaultdict(list)  # reservation -> its nodes
    by_model_region: dict[tuple[int, str], list[int]] = defaultdict(list)
    node_model: dict[int, int | None] = {}
    node_gpu_count: dict[int, int] = defaultdict(int)
    for g in gpu_rows:
        node_gpu_count[g["node_id"]] += 1
        node_model.setdefault(g["node_id"], g["model_id"])
    for nid, mid in node_model.items():
        if mid is not None:
            by_model_region[(mid, node_rows[nid]["region__code"])].append(nid)
    reservations = list(
        Reservation.objects.filter(status=ReservationStatus.ACTIVE, starts_at__lte=now, ends_at__gt=now)
        .order_by("starts_at", "id")
        .values("id", "tenant_id", "gpu_model_id", "region__code", "count")
    )
    for res in reservations:
        owner_nodes = {
            a["node_id"] for ws in holders.values() for a in ws if a["tenant_id"] == res["tenant_id"]
        }
        cands = sorted(
            (
                n
                for n in by_model_region.get((res["gpu_model_id"], res["region__code"]), [])
                if n not in reserved_for
            ),
            key=lambda n: (n not in owner_nodes, n),
        )
        owner_gpus: dict[int, set[int]] = defaultdict(set)
        for ws in holders.values():
            for a in ws:
                if a["tenant_id"] == res["tenant_id"] and a["workload__plan"] == E.Plan.RESERVED:
                    owner_gpus[a["node_id"]].add(a["gpu_id"])
        covered = 0
        for n in cands:
            if covered >= res["count"]:
                break
            take = min(node_gpu_count[n], res["count"] - covered)
            reserved_for[n] = str(res["tenant_id"])
            reservation_nodes[res["id"]].append(n)
            if take < node_gpu_count[n]:
                reserved_gpus[n] = max(0, take - len(owner_gpus[n]))
            covered += take

    nodes: list[E.Node] = []
    for nid, n in node_rows.items():
        mid = node_model.get(nid)
        if mid is None or model_names[mid] not in catalog:
            continue
        nodes.append(
            E.Node(
                id=str(nid),
                model=model_names[mid],
                gpus=[],
                cpu_milli=n["cpu_cores"] * 1000,
                memory_mib=n["ram_mib"],
                cpu_used=sum(c for c, _ in node_load[nid].values()),
                memory_used=sum(m for _, m in node_load[nid].values()),
                region=n["region__code"],
                domain=n["domain"],
                reserved_for=reserved_for.get(nid),
                reserved_gpus=reserved_gpus.get(nid),
                software=node_versions(n["driver_version"], n["cuda_version"], n["rocm_version"]),
                labels=n["labels"] if isinstance(n["labels"], dict) else {},
            )
        )
    node_by_id = {int(n.id): n for n in nodes}
    # A GPU released without its node's word may still run that work: no new work on it until the
    # node reports it gone (``scheduling.services.lifecycle``). Few rows, by a partial index.
    unconfirmed = set(
        Allocation.objects.filter(
            stop_forced_at__isnull=False,
            stop_confirmed_at__isnull=True,
            node__state__in=SCHEDULABLE_NODE_STATES,
        ).values_list("gpu_id", flat=True)
    )
    for g in gpu_rows:
        en = node_by_id.get(g["node_id"])
        if en is None:
            continue
        ok = (
            g["health"] == GpuHealth.HEALTHY
            and not g["isolated"]
            and not g["mig_configuring"]  # staff are changing its MIG mode or layout
            and g["model_id"] == node_model[g["node_id"]]
            and g["id"] not in unconfirmed
        )
        island = g["nvlink_island"] if g["nvlink_island"] is not None else (g["numa_node"] or 0)
        en.gpus.append(
            E.Gpu(
                index=g["index"],
                healthy=ok,
                island=island,
                free_milli=max(MILLI - used[g["id"]], 0),
                mig=g["mig_mode"],
                mig_layout=layout_from_json(g["mig_layout"]),
                mig_used=tuple(mig_used.get(g["id"], ())),
            )
        )

    running: list[E.Running] = []
    for wid, rows in holders.items():
        a0 = rows[0]
        if a0["workload__state"] not in PREEMPTIBLE_STATES:
            continue
        start = a0["workload__started_at"] or a0["workload__scheduled_at"] or now
        est = a0["workload__estimated_runtime_s"] or a0["workload__max_runtime_s"]
        per_node: dict[int, list[int]] = defaultdict(list)
        for a in rows:
            per_node[a["node_id"]].append(a["gpu__index"])
        # A running elastic job on one node may be resized by the engine (scheduling.engine.elastic).
        elastic = (
            a0["workload__elastic_min_gpus"] is not None
            and a0["workload__state"] == WorkloadState.RUNNING
            and len(per_node) == 1
        )
        for nid, indices in per_node.items():
            running.append(
                E.Running(
                    id=str(wid),
                    tenant=str(a0["tenant_id"]),
                    node_id=str(nid),
                    gpu_indices=tuple(sorted(indices)),
                    milli=a0["span"],
                    cpu_milli=a0["workload__cpu_millicores"],
                    memory_mib=a0["workload__ram_mib"],
                    plan=E.Plan(a0["workload__plan"]),
                    priority=_priority(a0["workload__priority_class"], a0["workload__plan"]),
                    start_time=start.timestamp(),
                    est_end=start.timestamp() + est if est else None,
                    checkpointable=a0["workload__kind"] == WorkloadKind.JOB
                    and a0["workload__checkpoint_resume"]
                    and a0["workload__requeue_on_preemption"],
                    # Members across nodes (a gang or pooled GPUs) are preempted together.
                    gang_id=str(wid) if a0["workload__gang"] or len(per_node) > 1 else None,
                    mig_profile=a0["workload__mig_profile"] or None,
                    mig_start=a0["mig_start"],
                    elastic_min=a0["workload__elastic_min_gpus"] if elastic else 0,
                    elastic_max=a0["workload__elastic_target_gpus"] if elastic else 0,
                    group=str(a0["workload__array_parent_id"] or ""),
                )
            )

    # A Slurm region's jobs are placed by its Slurm (scheduling.services.slurm), never by the engine.
    queue = {
        w.pk: w
        for w in lock_workloads_where(state=WorkloadState.QUEUED).exclude(region__backend=RegionBackend.SLURM)
    }
    # Work a reservation took its capacity back from does not borrow that reservation's nodes again
    # (no preemption loop between a borrower and one reservation), unless nothing else can take it.
    reclaimed: dict[int, set[int]] = defaultdict(set)
    if reservation_nodes:
        lending = [w.pk for w in queue.values() if w.plan == E.Plan.SPOT or w.priority_class == "warm_pool"]
        for wid, data in WorkloadEvent.objects.filter(
            workload_id__in=lending, to_state=WorkloadState.PREEMPTED
        ).values_list("workload_id", "data"):
            if isinstance(data, dict) and data.get("reservation") in reservation_nodes:
                reclaimed[wid].add(data["reservation"])
    region_codes: dict[int, str] = {}
    region_policies: dict[tuple[int, str | None], str] = {}
    for rid, code, policy, by_plan in Region.objects.values_list(
        "id", "code", "queue_policy", "queue_policy_by_plan"
    ):
        region_codes[rid] = code
        # Checked again here: a value outside the engine's set keeps the default order.
        if policy in ENGINE_POLICIES:
            region_policies[(rid, None)] = policy
        for plan, p in (by_plan if isinstance(by_plan, dict) else {}).items():
            if p in ENGINE_POLICIES:
                region_policies[(rid, plan)] = p
    chosen: dict[int, list[str]] = defaultdict(list)
    for wid, name in Workload.gpu_models.through.objects.filter(workload_id__in=list(queue)).values_list(
        "workload_id", "gpumodel__name"
    ):
        chosen[wid].append(name)
    tenants = {w.tenant_id for w in queue.values()}
    model_limits = {
        (q["quota__tenant_id"], q["gpu_model_id"]): q["max_gpus"]
        for q in QuotaModelLimit.objects.filter(quota__tenant_id__in=tenants).values(
            "quota__tenant_id", "gpu_model_id", "max_gpus"
        )
    }
    waiting_for_victims: dict[int, int] = defaultdict(int)
    for pid in Workload.objects.filter(
        state=WorkloadState.PREEMPTED, preempted_for__isnull=False
    ).values_list("preempted_for_id", flat=True):
        waiting_for_victims[pid] += 1

    excluded = _spot_excluded(queue, catalog_rows, {(n.model, n.region) for n in nodes})
    requests: list[E.Request] = []
    ctx_quota_blocked: set[int] = set()
    for w in queue.values():
        spec = E.GpuSpec(
            models=tuple(sorted(chosen.get(w.pk, ()))),
            min_memory_mib=w.min_gpu_memory_gib * 1024,
            min_compute_weight=float(w.min_compute_weight),
            vendor=E.Vendor(w.gpu_vendor) if w.gpu_vendor in ENGINE_VENDORS else None,
            cuda_capability=tuple(int(x) for x in w.cuda_capability.split("."))
            if w.cuda_capability
            else None,
            rocm_target=w.rocm_target or None,
            mig_profile=w.mig_profile or None,
        )
        limited = [m for (t, m) in model_limits if t == w.tenant_id]
        if limited:
            need = w.gpu_count * w.gpu_fraction_milli
            allowed = allowed_models(spec, catalog)
            room = tuple(
                sorted(
                    name
                    for name in allowed
                    if (w.tenant_id, model_ids[name]) not in model_limits
                    or model_use[(w.tenant_id, model_ids[name])] + need
                    <= model_limits[(w.tenant_id, model_ids[name])] * MILLI
                )
            )
            if not room:
                ctx_quota_blocked.add(w.pk)
                continue
            spec = E.GpuSpec(models=room, mig_profile=spec.mig_profile)
        constraints = None
        if w.node_selector or w.affinity or w.anti_affinity or w.spread or w.preference:
            allowed_names = sorted(allowed_models(spec, catalog))
            prices = None
            if w.preference == "cheapest":
                rows = [m for m in catalog_rows if m.name in allowed_names]
                prices = placement_prices(models=rows, region=w.region, plan=w.plan)
            constraints = placement_constraints(
                workload=w, allowed=allowed_names, catalog=catalog, prices=prices
            )
        requests.append(
            E.Request(
                id=str(w.pk),
                tenant=str(w.tenant_id),
                gpu=spec,
                gpus=w.gpu_count,
                milli=w.gpu_fraction_milli,
                gang=w.gang,
                cpu_milli=w.cpu_millicores,
                memory_mib=w.ram_mib,
                region=region_codes.get(w.region_id),
                queue_policy=region_policies.get((w.region_id, w.plan))
                or region_policies.get((w.region_id, None)),
                other_regions_ok=w.other_regions_ok,
                gpus_per_node=tuple(w.gpus_per_node),
                split_regions_ok=w.split_regions_ok,
                plan=E.Plan(w.plan),
                priority=_priority(w.priority_class, w.plan),
                submit_time=w.submitted_at.timestamp(),
                est_runtime=float(w.estimated_runtime_s) if w.estimated_runtime_s else None,
                excluded=excluded.get(w.pk, frozenset()),
                min_versions=E.SoftwareVersions(
                    driver=version_key(w.min_driver) if w.min_driver else None,
                    cuda=version_key(w.min_cuda) if w.min_cuda else None,
                    rocm=version_key(w.min_rocm) if w.min_rocm else None,
                ),
                constraints=constraints,
                avoid_nodes=tuple(
                    str(n)
                    for n in [
                        *w.avoid_nodes,
                        *(n for r in reclaimed.get(w.pk, ()) for n in reservation_nodes[r]),
                    ]
                ),
            )
        )
    weights = {
        str(t): float(w)
        for t, w in Quota.objects.exclude(fair_share_weight=1).values_list("tenant_id", "fair_share_weight")
    }
    snapshot = E.Snapshot(
        nodes=nodes, models=catalog, running=running, tenant_weights=weights, now=now.timestamp()
    )
    ctx = CycleContext(
        now=now,
        workloads=queue,
        gpus=gpus,
        ranges=ranges,
        holders=holders,
        model_use=model_use,
        model_limits=model_limits,
        model_ids=model_ids,
        waiting_for_victims=waiting_for_victims,
        quota_blocked=ctx_quota_blocked,
        chosen_models=dict(chosen),
        mig_gpus=mig_gpus,
        mig_used=dict(mig_used),
        model_info={model_ids[name]: info for name, info in catalog.items()},
    )
    return snapshot, requests, ctx
