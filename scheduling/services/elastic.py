"""Elastic jobs: changing the GPUs a running job holds on its node.

One write path for every resize: the scheduling cycle's (growth into idle GPUs, shrinking to make
room, ``scheduling.engine.elastic``) and the tenant's (``workload_resize``). Each GPU is an
allocation row, so a resize ends the rows of the GPUs taken away (``end_reason`` "resized") and
opens rows for the GPUs given (``resized``), at the same instant: metering bills each GPU for the
seconds it was held (``metering.services.usage``). The job is told by a ``resize_workload`` command
to its node: its new GPU list in ``GPUPOOL_RESIZE_FILE`` and SIGUSR1, or a restart from its
checkpoint with the new ``WORLD_SIZE`` (``elastic_on_resize`` "restart"); nodes/PROTOCOL.md.

A tenant's resize sets the job's target (``elastic_target_gpus``): a shrink happens at once; a growth
waits for the next cycle to find free GPUs on its node. The scheduler grows the job only up to the
target, and may shrink it toward its minimum for other work.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from nodes.models import CommandKind, Gpu
from nodes.services.commands import CommandRequest, node_commands_enqueue_many
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.services.audit import audit_record
from scheduling.locks import lock_workloads
from scheduling.models import MILLI, Allocation, Quota, Workload, WorkloadState
from scheduling.selectors.shared import quota_usage

logger = logging.getLogger(__name__)

RESIZED = "resized"
ON_RESIZE = ("signal", "restart")


def _room(w: Workload, model_id: int) -> int:
    """How many more whole GPUs of ``model_id`` the tenant's quota lets ``w`` take now."""
    quota = Quota.objects.for_tenant(w.tenant).prefetch_related("model_limits").first()
    if quota is None:
        return 1 << 16
    usage = quota_usage(tenant=w.tenant)
    room = 1 << 16
    if quota.max_gpus_per_request is not None:
        room = min(room, int(quota.max_gpus_per_request) - w.gpu_count)
    if quota.max_gpus_total is not None:
        room = min(room, (int(quota.max_gpus_total) * MILLI - usage.gpu_milli) // MILLI)
    for lim in quota.model_limits.all():
        if lim.gpu_model_id == model_id:
            room = min(room, (lim.max_gpus * MILLI - usage.model_milli.get(model_id, 0)) // MILLI)
    return max(0, room)


def resize_apply(
    *, workload: Workload, node_id: int, indices: tuple[int, ...], now: datetime, reason: str
) -> tuple[CommandRequest | None, list[int], list[Allocation]]:
    """Give ``workload`` (locked, RUNNING, elastic) exactly the GPUs ``indices`` of node ``node_id``:
    end the rows of GPUs it leaves, open rows for GPUs it joins (free ones only, within its quota and
    bounds). Returns its node's command (None when nothing changed), the ids of the rows ended and
    the rows made."""
    w = workload
    held = {
        a.gpu.index: a
        for a in Allocation.objects.filter(workload=w, node_id=node_id, ended_at__isnull=True).select_related(
            "gpu"
        )
    }
    if not held:
        return None, [], []
    want = set(indices)
    gone = [a for idx, a in held.items() if idx not in want]
    keep = len(held) - len(gone)
    floor = w.elastic_min_gpus or 1
    if keep < floor:
        # Never below its minimum: keep the lowest-indexed of those it would leave.
        gone.sort(key=lambda a: a.gpu.index)
        gone = gone[floor - keep :]
    new_idx = sorted(want - held.keys())
    made: list[Allocation] = []
    if new_idx:
        model_id = next(iter(held.values())).gpu_model_id
        limit = min(
            (w.elastic_target_gpus or w.elastic_max_gpus or 0) - (len(held) - len(gone)),
            _room(w, model_id),
        )
        busy = set(
            Allocation.objects.filter(
                node_id=node_id, gpu__index__in=new_idx, ended_at__isnull=True
            ).values_list("gpu__index", flat=True)
        )
        unconfirmed = set(
            Allocation.objects.filter(
                node_id=node_id,
                gpu__index__in=new_idx,
                stop_forced_at__isnull=False,
                stop_confirmed_at__isnull=True,
            ).values_list("gpu__index", flat=True)
        )
        gpus = [
            g
            for g in Gpu.objects.filter(
                node_id=node_id, index__in=new_idx, model_id=model_id, removed_at__isnull=True
            ).order_by("index")
            if g.index not in busy and g.index not in unconfirmed
        ][: max(0, limit)]
        made = [
            Allocation(
                tenant_id=w.tenant_id,
                workload=w,
                node_id=node_id,
                gpu=g,
                gpu_model_id=g.model_id,
                plan=w.plan,
                fraction_milli=MILLI,
                resized=True,
                started_at=now,
            )
            for g in gpus
        ]
    if not gone and not made:
        return None, [], []
    ended = [a.pk for a in gone]
    Allocation.objects.filter(pk__in=ended).update(ended_at=now, end_reason=RESIZED)
    Allocation.objects.bulk_create(made)
    final = sorted([a for a in held.values() if a.pk not in ended] + made, key=lambda a: a.gpu.index)
    w.gpu_count = len(final)
    Workload.objects.filter(pk=w.pk).update(gpu_count=w.gpu_count)
    uuids = [a.gpu.uuid for a in final]
    logger.info("workload %s resized to %d GPU(s) on node %s (%s)", w.pk, len(final), node_id, reason)
    payload: dict[str, Any] = {
        "workload_id": str(w.pk),
        "gpu_uuids": uuids,
        "gpu_count": len(uuids),
        "world_size": len(uuids),
        "on_resize": w.elastic_on_resize or "signal",
        "reason": reason,
        "added_gpu_uuids": [a.gpu.uuid for a in made],
    }
    command = CommandRequest(
        node_id=node_id,
        kind=CommandKind.RESIZE_WORKLOAD,
        payload=payload,
        idempotency_key=f"resize:{w.pk}:{now.timestamp():.6f}",
    )
    return command, ended, made


def _elastic_node(w: Workload) -> int | None:
    nodes = set(
        Allocation.objects.filter(workload=w, ended_at__isnull=True).values_list("node_id", flat=True)
    )
    return next(iter(nodes)) if len(nodes) == 1 else None


def workload_resize(*, workload: Workload, gpu_count: Any, actor: Actor) -> Workload:
    """The tenant's resize of its running elastic job (``workload``, found in the tenant's scope) to
    ``gpu_count`` GPUs within its bounds. Shrinks at once; a growth is taken by the next cycle as
    GPUs of its node are free. Audited."""
    if isinstance(gpu_count, bool) or not isinstance(gpu_count, int):
        raise ValidationFailed(
            "gpu_count: a whole number of GPUs.", fields={"gpu_count": ["Must be an integer."]}
        )
    workload_id, tenant = workload.pk, workload.tenant
    now = timezone.now()
    with transaction.atomic():
        w = lock_workloads(ids=[workload_id]).get(workload_id)
        if w is None:  # pragma: no cover - deleted meanwhile
            raise Conflict("The job is gone.")
        if not w.is_elastic:
            raise Conflict("Only elastic jobs can be resized (submit with elastic).")
        if w.state != WorkloadState.RUNNING:
            raise Conflict(f"The job is {w.state}; only a running job can be resized.")
        lo, hi = w.elastic_min_gpus or 1, w.elastic_max_gpus or 1
        if not lo <= gpu_count <= hi:
            msg = f"Between the job's elastic bounds, {lo} and {hi}."
            raise ValidationFailed(f"gpu_count: {msg}", fields={"gpu_count": [msg]})
        before = w.gpu_count
        w.elastic_target_gpus = gpu_count
        Workload.objects.filter(pk=w.pk).update(elastic_target_gpus=gpu_count)
        node_id = _elastic_node(w)
        if gpu_count < w.gpu_count and node_id is not None:
            held = sorted(
                Allocation.objects.filter(workload=w, node_id=node_id, ended_at__isnull=True).values_list(
                    "gpu__index", flat=True
                )
            )
            command, _, _ = resize_apply(
                workload=w, node_id=node_id, indices=tuple(held[:gpu_count]), now=now, reason="tenant"
            )
            if command is not None:
                node_commands_enqueue_many(commands=[command], now=now)
        audit_record(
            tenant=tenant,
            actor=actor,
            action="job.resize",
            target=w,
            data={"gpu_count": gpu_count, "held_before": before, "held_after": w.gpu_count},
        )
        if gpu_count > w.gpu_count:
            from scheduling.services.triggers import cycle_request

            cycle_request(reason="resize")
    return w


def resize_on_command_finished(*, payload: dict[str, Any], node_id: int, state: str) -> None:
    """A node could not apply a growth (its runtime cannot give a running job more GPUs, or the job
    had ended): the GPUs it was to get go back at once, unbilled (their rows end where they began),
    and its target comes down to what it holds, so the cycle does not try again."""
    if state != "failed":
        return
    added = payload.get("added_gpu_uuids") or []
    try:
        workload_id = int(payload.get("workload_id"))
    except (TypeError, ValueError):
        return
    if not added:
        return
    with transaction.atomic():
        w = lock_workloads(ids=[workload_id]).get(workload_id)
        if w is None:
            return
        rows = list(
            Allocation.objects.filter(
                workload=w, node_id=node_id, resized=True, ended_at__isnull=True, gpu__uuid__in=added
            )
        )
        for a in rows:
            Allocation.objects.filter(pk=a.pk).update(ended_at=a.started_at, end_reason="resize_failed")
        held = Allocation.objects.filter(workload=w, ended_at__isnull=True).count()
        Workload.objects.filter(pk=w.pk).update(gpu_count=max(held, 1), elastic_target_gpus=max(held, 1))
        logger.warning(
            "workload %s: node %s could not grow it; %d GPU(s) given back", w.pk, node_id, len(rows)
        )
