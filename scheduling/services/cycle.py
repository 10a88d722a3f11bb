"""The scheduling cycle: snapshot -> engine decisions -> one transaction of allocations, state changes
and NodeCommands.

Single flight: the cycle runs inside one transaction that first takes a PostgreSQL advisory lock
(``scheduling.locks.try_cycle_lock``); a second cycle that finds it taken returns at once (the one
running sees its work, or the next beat does). On SQLite the IMMEDIATE transaction mode already
serialises writers. A worker killed mid-cycle rolls the whole transaction back: no allocation
without its state change or its start command, and the next cycle starts from the database.

The snapshot (``scheduling.services.snapshot``) is loaded with a fixed number of queries whatever
the fleet and queue size.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from nodes.mig_profiles import fit_starts, layout_from_json, table_for
from nodes.models import CommandKind
from nodes.services.commands import CommandRequest, node_commands_enqueue_many
from portal.actors import Actor
from portal.bulk import bulk_insert
from scheduling.engine import types as E
from scheduling.engine.cycle import CycleConfig, schedule
from scheduling.locks import lock_workloads, lock_workloads_where, try_cycle_lock
from scheduling.models import (
    MILLI,
    Allocation,
    GangAddress,
    Workload,
    WorkloadKind,
    WorkloadState,
)
from scheduling.services.allocations import allocation_ranges_move, gpu_range_choose
from scheduling.services.arrays import arrays_advance
from scheduling.services.dependencies import dependencies_gate
from scheduling.services.elastic import resize_apply
from scheduling.services.gangs import (
    GangMember,
    gang_addresses_choose,
    gang_addresses_used,
    gang_members,
    gang_network_of,
    gang_network_payload,
    gang_port_choose,
    gang_ports_used,
    is_gang,
    node_addresses,
)
from scheduling.services.lifecycle import PREEMPTIBLE_STATES, preempt_begin
from scheduling.services.slurm_route import slurm_route
from scheduling.services.snapshot import CycleContext, cycle_snapshot_load, from_epoch
from scheduling.services.states import workloads_transition
from scheduling.services.volumes import workload_volume_payloads
from scheduling.services.warm_pools import bind_warm_slots, warm_slots_bind
from scheduling.services.work import work_url

logger = logging.getLogger(__name__)

SYSTEM = Actor.system()


@dataclass
class CycleResult:
    ran: bool = False
    admitted: int = 0
    placed: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    pending: int = 0
    resized: list[int] = field(default_factory=list)
    sent_to_slurm: list[int] = field(default_factory=list)  # region-less jobs (arrays) given a Slurm region
    seconds: float = 0.0


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


def _resumes(w: Workload) -> bool:
    """A checkpointing job placed again after it ran (preempted or requeued): it resumes."""
    return w.kind == WorkloadKind.JOB and w.checkpoint_resume and w.started_at is not None


def _platform_env(
    w: Workload, arrays: dict[int, tuple[int, bool]], gang: GangMember | None = None
) -> dict[str, str]:
    """The variables the platform sets for this placement (the start payload's ``platform_env``,
    names in ``workload_rules.PLATFORM_ENV_NAMES``): an array task's index and its array's size,
    a work-queue worker's endpoint (its token is added on the way to the node,
    ``scheduling.services.env.start_payload_for_node``), and a gang member's rank and rendezvous
    (``gang``: this node's member when the placement spans nodes, or is a gang; torchrun's and
    NCCL's names). ``arrays``: array job -> (count, work)."""
    env: dict[str, str] = {}
    if gang is not None:
        env.update(
            WORLD_SIZE=str(gang.world_size),
            NODE_RANK=str(gang.rank),
            NNODES=str(gang.nnodes),
            LOCAL_WORLD_SIZE=str(gang.local_gpus),
            MASTER_ADDR=gang.master_addr,
            MASTER_PORT=str(gang.master_port),
            GPUPOOL_PEERS=",".join(gang.peers),
        )
    elif w.elastic_min_gpus is not None:
        # An elastic job starts as a world of its GPUs; a resize tells it the new size.
        env.update(WORLD_SIZE=str(w.gpu_count), LOCAL_WORLD_SIZE=str(w.gpu_count))
    if w.array_parent_id is not None:
        if w.array_parent_id not in arrays:
            arrays.update(
                (pk, (count, lease is not None))
                for pk, count, lease in Workload.objects.filter(pk=w.array_parent_id).values_list(
                    "pk", "array_count", "work_lease_s"
                )
            )
        count, work = arrays[w.array_parent_id]
        env["GPUPOOL_ARRAY_INDEX"] = str(w.array_index)
        env["GPUPOOL_ARRAY_COUNT"] = str(count)
        if work:
            env["GPUPOOL_WORK_URL"] = work_url()
    return env


def _start_payload(
    w: Workload,
    gpu_uuids: list[str],
    assignment: E.Assignment,
    volumes: list[dict[str, Any]],
    arrays: dict[int, tuple[int, bool]],
    gang: GangMember | None = None,
) -> dict[str, Any]:
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
    platform_env = _platform_env(w, arrays, gang)
    if platform_env:
        payload["platform_env"] = platform_env
    if gang is not None and gang.network is not None:
        payload["gang_network"] = dict(gang.network)
    if w.template:
        payload["template"] = w.template
    if w.mig_profile:
        payload["mig_profile"] = w.mig_profile
        if assignment.mig_start is not None:
            payload["mig_start"] = assignment.mig_start
    if volumes:
        payload["volumes"] = volumes
    if w.kind == WorkloadKind.JOB and w.checkpoint_resume and volumes:
        # Checkpoints go to the first volume, in a directory of this workload's own.
        payload["checkpoint"] = {"volume_id": volumes[0]["volume_id"], "resume": _resumes(w)}
    return payload


def _mig_fits(ctx: CycleContext, g: dict[str, Any], profile: str, start: int | None) -> bool:
    """Whether the hardware can make ``profile`` at ``start`` on GPU ``g`` beside the instances its
    allocations hold (and, on a GPU with a staff layout, whether the layout has that instance): the
    engine's placement checked again against the rows read, before it is written."""
    info = ctx.model_info.get(g["model_id"])
    table = table_for(info.name) if info is not None else None
    if table is None or start is None:
        return False
    used = ctx.mig_used.get(g["id"], [])
    layout = layout_from_json(g["mig_layout"])
    if layout and (profile, start) not in layout:
        return False
    return start in fit_starts(table, used, profile)


@dataclass
class _Batch:
    """Placements of one cycle, written together at the end (a fixed number of statements per
    kind of row, start commands included)."""

    placed: dict[str, list[Workload]] = field(default_factory=lambda: defaultdict(list))
    messages: dict[int, str] = field(default_factory=dict)
    allocations: dict[int, Allocation] = field(default_factory=dict)  # negative key: not yet inserted
    commands: list[CommandRequest] = field(default_factory=list)  # start and preempt commands
    volumes: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # start payloads' volumes
    gang_ports: dict[int, int | None] = field(default_factory=dict)  # workload -> its new rendezvous port
    ports_used: set[int] | None = None  # rendezvous ports of placed gangs (loaded at the first gang)
    addresses_used: dict[int, set[str]] = field(default_factory=dict)  # region -> gang addresses held
    gang_addresses: list[GangAddress] = field(default_factory=list)  # new rows, written at the end
    arrays: dict[int, tuple[int, bool]] = field(default_factory=dict)  # array job -> (count, work)


def _plan_place(ctx: CycleContext, batch: _Batch, w: Workload, decision: E.Place) -> tuple[str, str] | None:
    """Prepare the allocation rows, state change and start commands of one placement, or say why
    it cannot be committed: a per-model quota passed by an earlier placement of this cycle, or
    capacity the engine counted free that is still held (work being preempted)."""
    rows: list[tuple[dict[str, Any], int, int | None]] = []
    need: dict[int, int] = defaultdict(int)
    for a in decision.assignments:
        if int(a.node_id) in ctx.draining_nodes:
            return "capacity", "Capacity on the chosen node is still being freed by preemption."
        for index in a.gpu_indices:
            g = ctx.gpus[(int(a.node_id), index)]
            rows.append((g, a.milli, a.mig_start))
            need[g["model_id"]] += w.gpu_fraction_milli
    for mid, milli in need.items():
        limit = ctx.model_limits.get((w.tenant_id, mid))
        if limit is not None and ctx.model_use[(w.tenant_id, mid)] + milli > limit * MILLI:
            return "quota", "Waiting for the per-model GPU quota."
    for g, milli, mig_start in rows:
        if sum(f for _, f, _ in ctx.ranges[g["id"]]) + milli > MILLI:
            logger.error("Engine placed %s milli on GPU %s, which has no room; skipped", milli, g["id"])
            return "capacity", "Waiting for capacity."
        if (g["id"] in ctx.mig_gpus) != bool(w.mig_profile):
            logger.error("Engine put MIG work off a GPU in MIG mode, or other work on one: GPU %s", g["id"])
            return "capacity", "Waiting for capacity."
        if w.mig_profile and not _mig_fits(ctx, g, w.mig_profile, mig_start):
            logger.error(
                "Engine placed a %s instance where GPU %s cannot make it; skipped", w.mig_profile, g["id"]
            )
            return "capacity", "Waiting for capacity."
    for g, milli, mig_start in rows:
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
            mig_start=mig_start if w.mig_profile else None,
            started_at=ctx.now,
        )
        ctx.ranges[g["id"]].append((offset, milli, key))
        ctx.model_use[(w.tenant_id, g["model_id"])] += w.gpu_fraction_milli
        if w.mig_profile and mig_start is not None:
            ctx.mig_used.setdefault(g["id"], []).append((w.mig_profile, mig_start))
    w.attempt += 1
    warm = ctx.warm_hits.get(w.pk)
    reason = warm.reason if warm else "backfilled" if decision.backfill else "placed"
    batch.placed[reason].append(w)
    where = ", ".join(sorted({a.node_id for a in decision.assignments}))
    resumed = " It resumes from its checkpoint (GPUPOOL_RESUME=1)." if _resumes(w) else ""
    batch.messages[w.pk] = f"Placed on {where}{warm.note if warm else ''}.{resumed}"
    members = _gang_plan(batch, w, decision)
    for rank, a in enumerate(decision.assignments):
        uuids = [ctx.gpus[(int(a.node_id), i)]["uuid"] for i in a.gpu_indices]
        model_id = ctx.gpus[(int(a.node_id), a.gpu_indices[0])]["model_id"] if a.gpu_indices else None
        batch.commands.append(
            CommandRequest(
                node_id=int(a.node_id),
                kind=CommandKind.START_WORKLOAD,
                payload=_start_payload(
                    w, uuids, a, batch.volumes.get(w.pk, []), batch.arrays, members[rank] if members else None
                )
                | _share_payload(w, a, ctx.model_info.get(model_id)),
                idempotency_key=f"start:{w.pk}:{w.attempt}",
            )
        )
    return None


def _gang_plan(batch: _Batch, w: Workload, decision: E.Place) -> list[GangMember] | None:
    """The members of a placement across nodes, in the engine's order of its nodes (rank 0 first),
    with a rendezvous port of their own; None for a placement on one node (unless a gang)."""
    node_ids = [int(a.node_id) for a in decision.assignments]
    if not is_gang(w, len(node_ids)):
        if w.gang_port is not None:
            batch.gang_ports[w.pk] = None
        return None
    if batch.ports_used is None:
        batch.ports_used = gang_ports_used()
    port = gang_port_choose(workload_id=w.pk, used=batch.ports_used)
    batch.ports_used.add(port)
    batch.gang_ports[w.pk] = w.gang_port = port
    network, own = None, None
    # A member on the gang network is its own address there, reached by its peers only: ports
    # published for the tenant need a bridge, so a gang with ports keeps the node-address rendezvous.
    routed = None if w.ports else gang_network_of(node_ids)
    if routed is not None:
        region_id, net = routed
        if region_id not in batch.addresses_used:
            batch.addresses_used[region_id] = gang_addresses_used(region_id)
        used = batch.addresses_used[region_id]
        own = gang_addresses_choose(network=net, workload_id=w.pk, count=len(node_ids), used=used)
        if own is not None:
            network = gang_network_payload(net)
            used.update(own)
            batch.gang_addresses += [
                GangAddress(
                    region_id=region_id,
                    address=address,
                    workload_id=w.pk,
                    node_id=n,
                    rank=rank,
                    attempt=w.attempt,
                )
                for rank, (n, address) in enumerate(zip(node_ids, own, strict=True))
            ]
        else:
            logger.warning(
                "Region %s's gang range is full: gang %s goes through rank 0's node", region_id, w.pk
            )
    return gang_members(
        node_ids=node_ids,
        gpus_per_node=[len(a.gpu_indices) for a in decision.assignments],
        port=port,
        addresses=node_addresses(node_ids),
        network=network,
        own=own,
    )


def _flush(ctx: CycleContext, batch: _Batch) -> None:
    for port, ids in _group(batch.gang_ports).items():
        Workload.objects.filter(pk__in=ids).update(gang_port=port)
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
    if batch.gang_addresses:
        # A requeued gang's earlier addresses went with its release; these are unique per region
        # (the database refuses a second holder, whatever placed it).
        GangAddress.objects.bulk_create(batch.gang_addresses)
    node_commands_enqueue_many(commands=batch.commands, now=ctx.now)


def _group(values: dict[int, Any]) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = defaultdict(list)
    for key, value in values.items():
        out[value].append(key)
    return out


def _commit_preempt(
    ctx: CycleContext, batch: _Batch, preemptor: Workload, victim_ids: list[int]
) -> list[int]:
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


def _commit_resizes(ctx: CycleContext, batch: _Batch, resizes: list[E.Resize]) -> list[int]:
    """Apply the engine's resizes of running elastic jobs (before the placements they make room
    for): their allocation rows change now, and the capacity bookkeeping of this cycle with them."""
    locked = lock_workloads(ids={int(r.request_id) for r in resizes}, states=[WorkloadState.RUNNING])
    # One resize per job, to its last set: several placements may take a job's borrowed GPUs in
    # one cycle, and each command is a signal to the job, or a restart of it.
    shrunk = {r.request_id for r in resizes if r.for_request}
    last = {r.request_id: r for r in resizes}
    done = []
    for r in last.values():
        w = locked.get(int(r.request_id))
        if w is None or not w.is_elastic:
            continue
        command, ended, made = resize_apply(
            workload=w,
            node_id=int(r.node_id),
            indices=r.gpu_indices,
            now=ctx.now,
            reason="shrunk" if r.request_id in shrunk else "grown",
        )
        if command is None:
            continue
        gone = set(ended)
        for a in ctx.holders.get(w.pk, []):
            if a["id"] in gone:
                ctx.ranges[a["gpu_id"]] = [x for x in ctx.ranges[a["gpu_id"]] if x[2] not in gone]
                ctx.model_use[(w.tenant_id, a["gpu_model_id"])] -= a["fraction_milli"]
        for a in made:
            ctx.ranges[a.gpu_id].append((0, MILLI, a.pk))
            ctx.model_use[(w.tenant_id, a.gpu_model_id)] += MILLI
        batch.commands.append(command)
        done.append(w.pk)
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
    clock = now is None  # a caller's ``now`` (tests, replays) is kept throughout
    now = now or timezone.now()
    result = CycleResult()
    with transaction.atomic():
        if not try_cycle_lock():
            return result
        result.ran = True
        # Dependencies first (jobs whose dependencies are not met wait, or fail when they never
        # can be), then arrays make the tasks their parallelism allows; array jobs never queue.
        blocked = dependencies_gate(now=now)
        arrays_advance(now=now, blocked=blocked)
        admitted = list(
            lock_workloads_where(state=WorkloadState.PENDING, array_count__isnull=True).exclude(
                pk__in=blocked
            )
        )
        workloads_transition(
            workloads=admitted, to=WorkloadState.QUEUED, reason="admitted", actor=SYSTEM, now=now
        )
        result.admitted = len(admitted)
        snapshot, requests, ctx = cycle_snapshot_load(now)
        if clock:
            # Placements are stamped after the snapshot was read: a GPU freed by a release that
            # committed after the cycle began (its ``ended_at`` later than the cycle's start) was
            # read free, and the allocation made on it must not start before that end.
            now = ctx.now = max(now, timezone.now())
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
        batch.volumes = workload_volume_payloads(
            workload_ids=[int(d.request_id) for d in decisions if isinstance(d, E.Place) and not d.preempt]
        )
        resizes = [d for d in decisions if isinstance(d, E.Resize)]
        if resizes:
            result.resized = _commit_resizes(ctx, batch, resizes)
        for d in decisions:
            if isinstance(d, E.Resize):
                continue
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
                if _set_pending(w, reason, message, from_epoch(d.expected_start)):
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
        # Region-less jobs the engine left waiting go to a Slurm region that can run them now.
        result.sent_to_slurm = slurm_route(
            workloads=[
                ctx.workloads[int(d.request_id)]
                for d in decisions
                if not isinstance(d, E.Place | E.Resize) and int(d.request_id) not in ctx.quota_blocked
            ]
        )
        result.pending = len(ctx.workloads) - len(result.placed)  # (those sent to Slurm still wait)
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
