"""The scheduling cycle: snapshot -> engine decisions -> one transaction of allocations, state changes
and NodeCommands.

Single flight: the cycle runs inside one transaction that first takes a PostgreSQL advisory lock
(``scheduling.locks.try_cycle_lock``); a second cycle that finds it taken returns at once (the one
running sees its work, or the next beat does). On SQLite the IMMEDIATE transaction mode already
serialises writers. A worker killed mid-cycle rolls the whole transaction back: no allocation
without its state change or its start command, and the next cycle starts from the database.

The snapshot is loaded with a fixed number of queries whatever the fleet and queue size: catalog,
READY nodes, their GPUs, open allocations (with their workloads' fields), the queue, the queue's
GPU-model choices, reservations in force, per-model quota limits and preemptions in progress.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from nodes.models import SCHEDULABLE_NODE_STATES, CommandKind, Gpu, GpuHealth, GpuModel, Node, Region
from nodes.services.commands import CommandRequest, node_commands_enqueue_many
from portal.actors import Actor
from portal.bulk import bulk_insert
from scheduling.engine import types as E
from scheduling.engine.cycle import CycleConfig, schedule
from scheduling.engine.spec import allowed_models
from scheduling.locks import lock_workloads, lock_workloads_where, try_cycle_lock
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
from scheduling.services.allocations import allocation_ranges_move, gpu_range_choose
from scheduling.services.lifecycle import PREEMPTIBLE_STATES, preempt_begin
from scheduling.services.states import workloads_transition
from scheduling.services.warm_pools import WarmBinding, bind_warm_slots, warm_slots_bind

logger = logging.getLogger(__name__)

SYSTEM = Actor.system()
ENGINE_VENDORS = {v.value for v in E.Vendor}


@dataclass
class CycleResult:
    ran: bool = False
    admitted: int = 0
    placed: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    pending: int = 0
    seconds: float = 0.0


def _epoch(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


def _from_epoch(t: float | None) -> datetime | None:
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
class _Context:
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
    mig_gpus: set[int] = field(default_factory=set)  # GPUs holding MIG slices
    model_info: dict[int, E.GpuModelInfo] = field(default_factory=dict)  # model id -> catalog entry


def _priority(workload_pc: str, plan: str) -> E.PriorityClass | None:
    if not workload_pc:
        return None
    return E.PriorityClass[workload_pc.upper()]


def _load(now: datetime) -> tuple[E.Snapshot, list[E.Request], _Context]:
    catalog_rows = list(GpuModel.objects.all())
    catalog = {m.name: _model_info(m) for m in catalog_rows if m.vendor in ENGINE_VENDORS}
    model_ids = {m.name: m.pk for m in catalog_rows}
    model_names = {m.pk: m.name for m in catalog_rows}

    node_rows = {
        n["id"]: n
        for n in Node.objects.filter(state__in=SCHEDULABLE_NODE_STATES).values(
            "id", "region__code", "cpu_cores", "ram_mib"
        )
    }
    gpu_rows = list(
        Gpu.objects.filter(node_id__in=list(node_rows), removed_at__isnull=True)
        .order_by("node_id", "index")
        .values(
            "id", "node_id", "index", "uuid", "model_id", "health", "isolated", "nvlink_island", "numa_node"
        )
    )
    gpus = {(g["node_id"], g["index"]): g for g in gpu_rows}

    allocs = list(
        Allocation.objects.active().values(
            "id",
            "workload_id",
            "node_id",
            "gpu_id",
            "gpu__index",
            "gpu_model_id",
            "fraction_milli",
            "span_milli",
            "milli_offset",
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
        )
    )
    used: dict[int, int] = defaultdict(int)
    ranges: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    holders: dict[int, list[dict[str, Any]]] = defaultdict(list)
    model_use: dict[tuple[int, int], int] = defaultdict(int)
    node_load: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)  # node -> workload -> (cpu, ram)
    mig_gpus: set[int] = set()
    for a in allocs:
        # Capacity is counted in what each row spans (less than its fraction on an over-subscribed
        # GPU); quotas count the fractions asked for.
        a["span"] = a["span_milli"] or a["fraction_milli"]
        used[a["gpu_id"]] += a["span"]
        ranges[a["gpu_id"]].append((a["milli_offset"], a["span"], a["id"]))
        if a["workload__mig_profile"] and a["span"] < MILLI:
            mig_gpus.add(a["gpu_id"])
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
                reserved_for=reserved_for.get(nid),
                reserved_gpus=reserved_gpus.get(nid),
            )
        )
    node_by_id = {int(n.id): n for n in nodes}
    for g in gpu_rows:
        en = node_by_id.get(g["node_id"])
        if en is None:
            continue
        ok = (
            g["health"] == GpuHealth.HEALTHY
            and not g["isolated"]
            and g["model_id"] == node_model[g["node_id"]]
        )
        island = g["nvlink_island"] if g["nvlink_island"] is not None else (g["numa_node"] or 0)
        en.gpus.append(
            E.Gpu(
                index=g["index"],
                healthy=ok,
                island=island,
                free_milli=max(MILLI - used[g["id"]], 0),
                mig=g["id"] in mig_gpus,
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
                    gang_id=str(wid) if a0["workload__gang"] else None,
                )
            )

    queue = {w.pk: w for w in lock_workloads_where(state=WorkloadState.QUEUED)}
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
    region_codes = dict(Region.objects.values_list("id", "code"))
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
                other_regions_ok=w.other_regions_ok,
                plan=E.Plan(w.plan),
                priority=_priority(w.priority_class, w.plan),
                submit_time=w.submitted_at.timestamp(),
                est_runtime=float(w.estimated_runtime_s) if w.estimated_runtime_s else None,
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
    ctx = _Context(
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
        model_info={model_ids[name]: info for name, info in catalog.items()},
    )
    return snapshot, requests, ctx


def _share_payload(w: Workload, assignment: E.Assignment, info: E.GpuModelInfo | None) -> dict[str, Any]:
    """What the agent needs to isolate a share that is not a MIG slice (MPS or time-slicing): the GPU
    memory it may use, ``span / 1000`` of the model's memory (its fraction divided by the model's
    over-subscription factor, so that every share of an over-subscribed GPU fits at once)."""
    if w.mig_profile or w.gpu_fraction_milli >= MILLI or info is None:
        return {}
    return {
        "gpu_memory_limit_mib": assignment.milli * info.memory_mib // MILLI,
        "gpu_vendor": str(info.vendor),
    }


def _start_payload(w: Workload, gpu_uuids: list[str], assignment: E.Assignment) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "workload_id": str(w.pk),
        "image": w.image,
        "command": list(w.command),
        "env": dict(w.env),
        "gpu_uuids": gpu_uuids,
        "gpu_fraction_milli": w.gpu_fraction_milli,
        "cpu_millicores": assignment.cpu_milli,
        "ram_mib": assignment.memory_mib,
        "ports": list(w.ports),
        "max_runtime_s": w.max_runtime_s,
        # Optional fields (agents ignore what they do not know).
        "kind": w.kind,
        "attempt": w.attempt,
    }
    if w.template:
        payload["template"] = w.template
    if w.ssh_public_key:
        payload["ssh_public_key"] = w.ssh_public_key
    if w.mig_profile:
        payload["mig_profile"] = w.mig_profile
    if w.kind == WorkloadKind.JOB and w.checkpoint_resume:
        payload["resume_from_checkpoint"] = w.retries > 0 or w.attempt > 1
    return payload


@dataclass
class _Batch:
    """Placements of one cycle, written together at the end (a fixed number of statements per
    kind of row, start commands included)."""

    placed: dict[str, list[Workload]] = field(default_factory=lambda: defaultdict(list))
    messages: dict[int, str] = field(default_factory=dict)
    allocations: dict[int, Allocation] = field(default_factory=dict)  # negative key: not yet inserted
    commands: list[CommandRequest] = field(default_factory=list)  # start and preempt commands


def _plan_place(ctx: _Context, batch: _Batch, w: Workload, decision: E.Place) -> tuple[str, str] | None:
    """Prepare the allocation rows, state change and start commands of one placement, or say why
    it cannot be committed: a per-model quota passed by an earlier placement of this cycle, or
    capacity the engine counted free that is still held (work being preempted)."""
    rows: list[tuple[dict[str, Any], int]] = []
    need: dict[int, int] = defaultdict(int)
    for a in decision.assignments:
        if int(a.node_id) in ctx.draining_nodes:
            return "capacity", "Capacity on the chosen node is still being freed by preemption."
        for index in a.gpu_indices:
            g = ctx.gpus[(int(a.node_id), index)]
            rows.append((g, a.milli))
            need[g["model_id"]] += w.gpu_fraction_milli
    for mid, milli in need.items():
        limit = ctx.model_limits.get((w.tenant_id, mid))
        if limit is not None and ctx.model_use[(w.tenant_id, mid)] + milli > limit * MILLI:
            return "quota", "Waiting for the per-model GPU quota."
    for g, milli in rows:
        if sum(f for _, f, _ in ctx.ranges[g["id"]]) + milli > MILLI:
            logger.error("Engine placed %s milli on GPU %s, which has no room; skipped", milli, g["id"])
            return "capacity", "Waiting for capacity."
        if ctx.ranges[g["id"]] and (g["id"] in ctx.mig_gpus) != bool(w.mig_profile):
            logger.error("Engine mixed MIG and other shares on GPU %s; skipped", g["id"])
            return "capacity", "Waiting for capacity."
    for g, milli in rows:
        choice = gpu_range_choose(ctx.ranges[g["id"]], milli)
        assert choice is not None  # room checked above
        offset, moves = choice
        if moves:
            # Existing rows move in the database now (leftwards, in order: never overlapping);
            # rows of this cycle are still in memory.
            allocation_ranges_move(moves=[(i, o) for i, o in moves if i > 0])
            for i, o in moves:
                if i < 0:
                    batch.allocations[i].milli_offset = o
            moved = dict(moves)
            ctx.ranges[g["id"]] = [(moved.get(i, o), f, i) for o, f, i in ctx.ranges[g["id"]]]
        key = -(len(batch.allocations) + 1)
        batch.allocations[key] = Allocation(
            tenant_id=w.tenant_id,
            workload=w,
            node_id=g["node_id"],
            gpu_id=g["id"],
            gpu_model_id=g["model_id"],
            plan=w.plan,
            fraction_milli=w.gpu_fraction_milli,
            span_milli=milli if milli != w.gpu_fraction_milli else None,
            milli_offset=offset,
            started_at=ctx.now,
        )
        ctx.ranges[g["id"]].append((offset, milli, key))
        ctx.model_use[(w.tenant_id, g["model_id"])] += w.gpu_fraction_milli
        if w.mig_profile and milli < MILLI:
            ctx.mig_gpus.add(g["id"])
    w.attempt += 1
    warm = ctx.warm_hits.get(w.pk)
    reason = warm.reason if warm else "backfilled" if decision.backfill else "placed"
    batch.placed[reason].append(w)
    where = ", ".join(sorted({a.node_id for a in decision.assignments}))
    batch.messages[w.pk] = f"Placed on {where}{warm.note if warm else ''}."
    for a in decision.assignments:
        uuids = [ctx.gpus[(int(a.node_id), i)]["uuid"] for i in a.gpu_indices]
        model_id = ctx.gpus[(int(a.node_id), a.gpu_indices[0])]["model_id"] if a.gpu_indices else None
        batch.commands.append(
            CommandRequest(
                node_id=int(a.node_id),
                kind=CommandKind.START_WORKLOAD,
                payload=_start_payload(w, uuids, a) | _share_payload(w, a, ctx.model_info.get(model_id)),
                idempotency_key=f"start:{w.pk}:{w.attempt}",
            )
        )
    return None


def _flush(ctx: _Context, batch: _Batch) -> None:
    for reason, workloads in batch.placed.items():
        workloads_transition(
            workloads=workloads,
            to=WorkloadState.SCHEDULED,
            reason=reason,
            actor=SYSTEM,
            messages=batch.messages,
            extra_updates={"attempt": F("attempt") + 1} if len(workloads) > 1 else {"attempt": None},
            now=ctx.now,
        )
    bulk_insert(list(batch.allocations.values()))
    node_commands_enqueue_many(commands=batch.commands, now=ctx.now)


def _commit_preempt(ctx: _Context, batch: _Batch, preemptor: Workload, victim_ids: list[int]) -> list[int]:
    done = []
    for v in lock_workloads(ids=victim_ids, states=PREEMPTIBLE_STATES).values():
        # Until the victim stops, its node keeps the GPUs, CPU and RAM the engine now counts free:
        # nothing else is placed there in this cycle.
        nodes = sorted({a["node_id"] for a in ctx.holders.get(v.pk, [])})
        ctx.draining_nodes.update(nodes)
        data: dict[str, Any] = {"preempted_for": preemptor.pk}
        if preemptor.reservation_id is not None:
            data["reservation"] = preemptor.reservation_id
        batch.commands += preempt_begin(
            workload=v,
            node_ids=nodes,
            reason="preempted",
            message=f"Making room for higher-priority {preemptor.kind} {preemptor.pk}; stopping in "
            + "{notice} s.",
            actor=SYSTEM,
            now=ctx.now,
            preemptor=preemptor,
            data=data,
        )
        done.append(v.pk)
    return done


def _set_pending(w: Workload, reason: str, message: str, expected: datetime | None) -> bool:
    if (w.pending_reason, w.pending_message, w.expected_start_at) == (reason, message[:255], expected):
        return False
    w.pending_reason, w.pending_message, w.expected_start_at = reason, message[:255], expected
    return True


def _save_pending(changed: list[Workload]) -> None:
    """Write the pending reasons: one UPDATE per distinct (reason, message, expected start)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for w in changed:
        groups[(w.pending_reason, w.pending_message, w.expected_start_at)].append(w.pk)
    for (reason, message, expected), ids in groups.items():
        Workload.objects.filter(pk__in=ids).update(
            pending_reason=reason, pending_message=message, expected_start_at=expected
        )


def scheduling_cycle_run(*, now: datetime | None = None, config: CycleConfig | None = None) -> CycleResult:
    """Run one cycle; returns ``ran=False`` when another cycle holds the lock."""
    started = time.perf_counter()
    now = now or timezone.now()
    result = CycleResult()
    with transaction.atomic():
        if not try_cycle_lock():
            return result
        result.ran = True
        admitted = list(lock_workloads_where(state=WorkloadState.PENDING))
        workloads_transition(
            workloads=admitted, to=WorkloadState.QUEUED, reason="admitted", actor=SYSTEM, now=now
        )
        result.admitted = len(admitted)
        snapshot, requests, ctx = _load(now)
        # A request whose victims are still stopping sits this cycle out: the victims' GPUs stay
        # allocated until they stop, and it must not pick more victims meanwhile.
        requests = [r for r in requests if int(r.id) not in ctx.waiting_for_victims]
        # Requests matching a warm pool take its prewarmed GPUs first; the engine places the rest.
        warm = bind_warm_slots(
            now=now,
            queue=[ctx.workloads[int(r.id)] for r in requests],
            chosen_models=ctx.chosen_models,
            nodes=snapshot.nodes,
        )
        ctx.warm_hits = warm
        requests = [r for r in requests if int(r.id) not in warm]
        decisions: list[E.Decision] = [b.place for b in warm.values()]
        decisions += schedule(snapshot, requests, config or CycleConfig(policy=settings.SCHEDULING_POLICY))
        changed: list[Workload] = []
        batch = _Batch()
        for d in decisions:
            w = ctx.workloads[int(d.request_id)]
            if isinstance(d, E.Place) and d.preempt:
                victims = [int(v) for v in d.preempt]
                result.preempted += _commit_preempt(ctx, batch, w, victims)
                msg = f"Waiting for {len(victims)} preempted workload(s) to stop."
                if _set_pending(w, "preempting", msg, None):
                    changed.append(w)
            elif isinstance(d, E.Place):
                why = _plan_place(ctx, batch, w, d)
                if why is None:
                    result.placed.append(w.pk)
                elif _set_pending(w, *why, None):
                    changed.append(w)
            else:
                reason, message = str(d.reason), d.message
                if _set_pending(w, reason, message, _from_epoch(d.expected_start)):
                    changed.append(w)
        _flush(ctx, batch)
        placed = set(result.placed)
        warm_slots_bind(bindings={w: b.slots for w, b in ctx.warm_hits.items() if w in placed}, now=now)
        for wid in ctx.waiting_for_victims:
            w = ctx.workloads.get(wid)
            if w is not None and _set_pending(w, "preempting", "Waiting for preempted work to stop.", None):
                changed.append(w)
        for wid in ctx.quota_blocked:
            w = ctx.workloads[wid]
            if _set_pending(w, "quota", "Every acceptable GPU model is at your per-model GPU quota.", None):
                changed.append(w)
        _save_pending(changed)
        result.pending = len(ctx.workloads) - len(result.placed)
    result.seconds = time.perf_counter() - started
    if result.placed or result.preempted:
        logger.info(
            "Scheduling cycle: %d placed, %d preempted, %d waiting, %.3f s",
            len(result.placed),
            len(result.preempted),
            result.pending,
            result.seconds,
        )
    return result
