"""Warm pools: keep GPUs prewarmed with a pool's image so that a matching request starts at once.

- **Target**: an exponentially weighted arrival rate of matching GPU demand (GPUs per second, time
  constant ``SCHEDULING_WARM_POOL_TAU_S``) times the pool's cold-start time, rounded up, kept
  between the pool's ``min_size`` and ``max_size``. It grows with demand and decays when it falls.
- **Slots**: one GPU each, prewarmed through the agent's ``prewarm`` command on a free GPU of the
  pool's model in its region (packing slots onto nodes that already have some). A slot holds no
  allocation, so it never keeps a GPU from real work: when other work is placed on its GPU, or the
  GPU or node is lost, the slot ends and another free GPU is prewarmed.
- **Readiness**: a slot is *prewarming* until the agent reports its ``prewarm`` command finished
  (``command_finished``, see ``scheduling.receivers``): succeeded makes it *ready* (``ready_at``);
  failed or expired ends it (``prewarm_failed``) and the reconciler prewarms another free GPU, on
  another node if it can. The reconciler also picks up results a lost signal left behind.
- **Binding**: before the engine runs, each queued request that matches a pool (its model, region,
  image or template) takes free warm slots on one node if they fit it whole, and is placed there at
  once: on ready slots (``warm_hit``) if any node has enough, else on slots still prewarming
  (``warm_hit_prewarming``, said so in its event: the image may still be pulling). Nodes that
  failed to start the request are skipped. ``bind_warm_slots`` is called by the cycle.

``warm_pools_reconcile`` (beat) runs under the cycle's lock, so it never races a placement.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from nodes.models import SCHEDULABLE_NODE_STATES, CommandKind, CommandState, Gpu, GpuHealth, Node, NodeCommand
from nodes.services.commands import node_command_enqueue
from scheduling.engine import types as E
from scheduling.locks import try_cycle_lock
from scheduling.models import MILLI, Allocation, WarmPool, WarmSlot, Workload, WorkloadTemplate


def _matching(pool: WarmPool):
    q = Workload.objects.filter(gpu_models=pool.gpu_model).filter(
        Q(region=pool.region) | Q(region__isnull=True)
    )
    return q.filter(image=pool.image) if pool.image else q.filter(template=pool.template)


def warm_pool_target_update(*, pool: WarmPool, now: datetime) -> WarmPool:
    """Fold the GPUs matching requests asked for since the last update into the pool's arrival
    rate and derive its target size."""
    tau = settings.SCHEDULING_WARM_POOL_TAU_S
    since = pool.rate_updated_at or now - timedelta(seconds=tau)
    dt = max((now - since).total_seconds(), 1.0)
    gpus = (
        _matching(pool)
        .filter(submitted_at__gte=since, submitted_at__lt=now)
        .aggregate(n=Sum("gpu_count"))["n"]
        or 0
    )
    alpha = 1.0 - math.exp(-dt / tau)
    pool.arrival_rate_per_s = alpha * (gpus / dt) + (1.0 - alpha) * pool.arrival_rate_per_s
    pool.rate_updated_at = now
    wanted = math.ceil(pool.arrival_rate_per_s * pool.cold_start_s - 1e-9)
    pool.target_size = min(max(wanted, pool.min_size), pool.max_size)
    pool.save(update_fields=["arrival_rate_per_s", "rate_updated_at", "target_size"])
    return pool


@dataclass
class WarmResult:
    ran: bool = False
    targets: dict[int, int] = field(default_factory=dict)
    prewarmed: int = 0
    ended: int = 0


def _end(slot_ids: list[int], reason: str, now: datetime) -> int:
    if not slot_ids:
        return 0
    return WarmSlot.objects.filter(pk__in=slot_ids, ended_at__isnull=True).update(
        ended_at=now, end_reason=reason
    )


PREWARM_FAILED = "prewarm_failed"
FAILED_NODE_COOLDOWN_S = 600
"""A node whose prewarm failed is the last choice for new slots for this long."""


def warm_slots_on_prewarm_finished(*, command_id, state: str, now: datetime | None = None) -> int:
    """The agent finished a prewarm command: its slots are ready, or (failed, expired) ended so that
    the reconciler prewarms other GPUs. Returns how many slots changed; replays change nothing."""
    now = now or timezone.now()
    open_slots = WarmSlot.objects.filter(command_id=command_id, ended_at__isnull=True)
    if state == CommandState.SUCCEEDED:
        return open_slots.filter(ready_at__isnull=True).update(ready_at=now)
    return open_slots.update(ended_at=now, end_reason=PREWARM_FAILED)


def _finish_prewarms(now: datetime) -> int:
    """Slots still prewarming whose command has finished (a lost or failed signal): settle them."""
    changed = 0
    waiting = WarmSlot.objects.filter(ended_at__isnull=True, ready_at__isnull=True, command_id__isnull=False)
    finished = NodeCommand.objects.filter(
        pk__in=waiting.values("command_id"),
        state__in=[CommandState.SUCCEEDED, CommandState.FAILED, CommandState.EXPIRED],
    ).values_list("pk", "state")
    for command_id, state in finished:
        changed += warm_slots_on_prewarm_finished(command_id=command_id, state=state, now=now)
    return changed


def warm_pools_reconcile(*, now: datetime | None = None) -> WarmResult:
    now = now or timezone.now()
    result = WarmResult()
    with transaction.atomic():
        if not try_cycle_lock():
            return result
        result.ran = True
        _finish_prewarms(now)
        busy = set(Allocation.objects.active().values_list("gpu_id", flat=True))
        # Slots whose GPU was taken by work, or whose GPU or node is gone.
        lost, taken = [], []
        for sid, gpu_id, node_state, health, isolated, removed, mig_change in WarmSlot.objects.filter(
            ended_at__isnull=True
        ).values_list(
            "pk",
            "gpu_id",
            "node__state",
            "gpu__health",
            "gpu__isolated",
            "gpu__removed_at",
            "gpu__mig_configuring",
        ):
            if (
                node_state not in SCHEDULABLE_NODE_STATES
                or health != GpuHealth.HEALTHY
                or isolated
                or removed
                or mig_change  # staff change its MIG mode: no prewarmed container in the way
            ):
                lost.append(sid)
            elif gpu_id in busy:
                taken.append(sid)
        result.ended += _end(lost, "unavailable", now) + _end(taken, "taken", now)

        warm_gpus = set(WarmSlot.objects.filter(ended_at__isnull=True).values_list("gpu_id", flat=True))
        failed_nodes = set(
            WarmSlot.objects.filter(
                end_reason=PREWARM_FAILED, ended_at__gte=now - timedelta(seconds=FAILED_NODE_COOLDOWN_S)
            ).values_list("node_id", flat=True)
        )
        # A template pool prewarms its catalog template's image (the template's name when the
        # catalog has none by that name).
        catalog_images = dict(WorkloadTemplate.objects.catalog().values_list("name", "image"))
        for pool in WarmPool.objects.filter(enabled=True).select_related("gpu_model", "region"):
            warm_pool_target_update(pool=pool, now=now)
            result.targets[pool.pk] = pool.target_size
            active = list(
                WarmSlot.objects.filter(pool=pool, ended_at__isnull=True).order_by("-created_at", "-pk")
            )
            if len(active) > pool.target_size:
                result.ended += _end([s.pk for s in active[: len(active) - pool.target_size]], "shrunk", now)
                continue
            missing = pool.target_size - len(active)
            if missing <= 0:
                continue
            warm_nodes = {s.node_id for s in active}
            free = [
                g
                for g in Gpu.objects.filter(
                    model=pool.gpu_model,
                    node__region=pool.region,
                    node__state__in=SCHEDULABLE_NODE_STATES,
                    health=GpuHealth.HEALTHY,
                    isolated=False,
                    mig_configuring=False,
                    removed_at__isnull=True,
                ).values("pk", "node_id", "uuid", "index")
                if g["pk"] not in busy and g["pk"] not in warm_gpus
            ]
            free.sort(
                key=lambda g: (
                    g["node_id"] in failed_nodes,
                    g["node_id"] not in warm_nodes,
                    g["node_id"],
                    g["index"],
                )
            )
            chosen = free[:missing]
            by_node: dict[int, list[dict]] = defaultdict(list)
            for g in chosen:
                by_node[g["node_id"]].append(g)
            for node_id, gpus in by_node.items():
                command = node_command_enqueue(
                    node=Node(pk=node_id),
                    kind=CommandKind.PREWARM,
                    payload={
                        "image": pool.image or catalog_images.get(pool.template, pool.template),
                        "gpu_uuids": [g["uuid"] for g in gpus],
                        "warm_pool": pool.pk,
                    },
                    idempotency_key=f"prewarm:{pool.pk}:{node_id}:{now.timestamp():.3f}",
                    now=now,
                )
                WarmSlot.objects.bulk_create(
                    WarmSlot(
                        pool=pool, node_id=node_id, gpu_id=g["pk"], command_id=command.pk, created_at=now
                    )
                    for g in gpus
                )
                warm_gpus.update(g["pk"] for g in gpus)
                result.prewarmed += len(gpus)
    return result


def _pool_matches(pool: WarmPool, w: Workload, models: list[str]) -> bool:
    # Requests that name the pool's model (constraint-only requests are not bound), in its region
    # (or with no region preference), with its image or template.
    if pool.gpu_model.name not in models:
        return False
    if w.region_id is not None and w.region_id != pool.region_id:
        return False
    return bool((pool.image and w.image == pool.image) or (pool.template and w.template == pool.template))


@dataclass
class WarmBinding:
    """A queued workload placed on warm slots (one node)."""

    place: E.Place
    slots: list[int]
    ready: bool
    """Every slot's prewarm had finished; False: bound to slots still prewarming (none was ready)."""

    @property
    def reason(self) -> str:
        return "warm_hit" if self.ready else "warm_hit_prewarming"

    @property
    def note(self) -> str:
        if self.ready:
            return f" on {len(self.slots)} prewarmed warm slot(s)"
        return f" on {len(self.slots)} warm slot(s) still prewarming (its image may still be pulling)"


def bind_warm_slots(
    *,
    now: datetime,
    queue: list[Workload],
    chosen_models: dict[int, list[str]],
    nodes: list[E.Node],
) -> dict[int, WarmBinding]:
    """Place queued requests that match a pool on its free warm slots (whole on one node): on ready
    slots if some node has enough of them, else on slots still prewarming. Updates the engine's
    ``nodes`` so the engine does not hand the same capacity out again. Returns, per workload id, its
    binding. Called inside the cycle's transaction."""
    slots = list(
        WarmSlot.objects.filter(ended_at__isnull=True, pool__enabled=True)
        .values_list("pk", "pool_id", "node_id", "gpu__index", "ready_at")
        .order_by("node_id", "gpu__index")
    )
    if not slots:
        return {}
    pools = {p.pk: p for p in WarmPool.objects.filter(enabled=True).select_related("gpu_model")}
    by_node = {int(n.id): n for n in nodes}
    # (pool, node) -> free slots as (ready first, slot, GPU index)
    free: dict[tuple[int, int], list[tuple[bool, int, int]]] = defaultdict(list)
    for sid, pool_id, node_id, index, ready_at in slots:
        n = by_node.get(node_id)
        if n is None:
            continue
        g = next((g for g in n.gpus if g.index == index), None)
        if g is not None and g.healthy and g.free_milli == MILLI:
            free[(pool_id, node_id)].append((ready_at is None, sid, index))
    for avail in free.values():
        avail.sort()
    out: dict[int, WarmBinding] = {}
    for w in sorted(queue, key=lambda w: (w.submitted_at, w.pk)):
        if w.gang or w.gpu_count > len(max(free.values(), key=len, default=[])):
            continue
        avoid = {int(n) for n in w.avoid_nodes}
        fits = []
        for (pool_id, node_id), avail in free.items():
            pool = pools.get(pool_id)
            if (
                pool is None
                or node_id in avoid
                or len(avail) < w.gpu_count
                or not _pool_matches(pool, w, chosen_models.get(w.pk, []))
            ):
                continue
            n = by_node[node_id]
            if n.cpu_milli - n.cpu_used < w.cpu_millicores or n.memory_mib - n.memory_used < w.ram_mib:
                continue
            ready = not any(prewarming for prewarming, _, _ in avail[: w.gpu_count])
            fits.append((not ready, node_id, pool_id))
        if not fits:
            continue
        prewarming, node_id, pool_id = min(fits)
        avail = free[(pool_id, node_id)]
        take = avail[: w.gpu_count]
        del avail[: w.gpu_count]
        n = by_node[node_id]
        for _, _, index in take:
            g = next(g for g in n.gpus if g.index == index)
            g.free_milli -= w.gpu_fraction_milli
        n.cpu_used += w.cpu_millicores
        n.memory_used += w.ram_mib
        assignment = E.Assignment(
            node_id=str(node_id),
            gpu_indices=tuple(i for _, _, i in take),
            milli=w.gpu_fraction_milli,
            cpu_milli=w.cpu_millicores,
            memory_mib=w.ram_mib,
        )
        out[w.pk] = WarmBinding(
            E.Place(str(w.pk), (assignment,)), [sid for _, sid, _ in take], ready=not prewarming
        )
    return out


def warm_slots_bind(*, bindings: dict[int, list[int]], now: datetime) -> None:
    for wid, slot_ids in bindings.items():
        WarmSlot.objects.filter(pk__in=slot_ids, ended_at__isnull=True).update(
            ended_at=now, end_reason="bound", bound_to_id=wid
        )
