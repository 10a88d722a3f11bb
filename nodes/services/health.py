"""Node and GPU health: the silence reconciler, GPU isolation, and staff state changes (audited)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from nodes import metrics as node_metrics
from nodes.locks import lock_gpu, lock_node, lock_silent_nodes
from nodes.models import FleetAlert, Gpu, GpuHealth, Node, NodeState
from nodes.signals import gpu_unhealthy, node_down, node_ready, send_on_commit
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.services.audit import audit_record

logger = logging.getLogger(__name__)

# States the reconciler leaves alone: staff took the node out of service, or it is already DOWN.
UNWATCHED_STATES = (NodeState.MAINTENANCE, NodeState.DOWN, NodeState.SLURM)


@dataclass
class ReconcileResult:
    suspect: list[int] = field(default_factory=list)
    down: list[int] = field(default_factory=list)
    deferred_down: list[int] = field(default_factory=list)  # over the per-run limit
    mass_silence: bool = False
    silent_fraction: float = 0.0


def node_health_reconcile(*, now: datetime | None = None) -> ReconcileResult:
    """Mark silent nodes SUSPECT, then DOWN; refuse to mark anyone DOWN when a large share of the
    fleet is silent at once (raise a FleetAlert instead); at most NODE_MAX_DOWN_PER_RUN DOWN
    transitions per run, longest-silent first."""
    now = now or timezone.now()
    suspect_before = now - timedelta(seconds=settings.NODE_SUSPECT_AFTER_S)
    down_before = now - timedelta(seconds=settings.NODE_DOWN_AFTER_S)
    result = ReconcileResult()
    with transaction.atomic():
        watched = Node.objects.exclude(state__in=UNWATCHED_STATES)
        total = watched.count()
        silent_q = Q(last_heartbeat_at__lt=suspect_before) | Q(
            last_heartbeat_at__isnull=True, registered_at__lt=suspect_before
        )
        silent = lock_silent_nodes(watched=watched, silent=silent_q)
        result.silent_fraction = len(silent) / total if total else 0.0
        result.mass_silence = (
            total >= settings.NODE_MASS_SILENCE_MIN_NODES
            and result.silent_fraction > settings.NODE_MASS_SILENCE_FRACTION
        )
        _update_mass_silence_alert(result, total, len(silent), now)
        budget = settings.NODE_MAX_DOWN_PER_RUN
        for node in silent:
            last = node.last_seen_at
            if last < down_before and not result.mass_silence:
                if budget <= 0:
                    result.deferred_down.append(node.id)
                    continue
                budget -= 1
                _set_state(node, NodeState.DOWN, f"No heartbeat since {last:%Y-%m-%d %H:%M:%S} UTC.", now)
                result.down.append(node.id)
                send_on_commit(node_down, sender=Node, node=node, last_heartbeat_at=node.last_heartbeat_at)
            elif node.state != NodeState.SUSPECT:
                _set_state(node, NodeState.SUSPECT, f"No heartbeat since {last:%Y-%m-%d %H:%M:%S} UTC.", now)
                result.suspect.append(node.id)
    if result.down:
        node_metrics.NODES_MARKED_DOWN.inc(len(result.down))
        logger.warning("Marked %d node(s) DOWN: %s", len(result.down), result.down)
    if result.deferred_down:
        logger.warning("Rate limit: %d silent node(s) left for the next run", len(result.deferred_down))
    return result


def _set_state(node: Node, state: str, reason: str, now: datetime) -> None:
    fields = {"state": state, "state_reason": reason[:255], "state_changed_at": now}
    if state in (NodeState.SUSPECT, NodeState.DOWN) and node.state not in (NodeState.SUSPECT, NodeState.DOWN):
        # Remember a staff choice (cordoned, draining) to return to when heartbeats resume.
        fields["resume_state"] = node.state if node.state != NodeState.READY else ""
    Node.objects.filter(pk=node.pk).update(**fields)
    for k, v in fields.items():
        setattr(node, k, v)


def _update_mass_silence_alert(result: ReconcileResult, total: int, silent: int, now: datetime) -> None:
    open_alert = FleetAlert.objects.filter(
        kind=FleetAlert.Kind.MASS_SILENCE, resolved_at__isnull=True
    ).first()
    node_metrics.MASS_SILENCE.set(1 if result.mass_silence else 0)
    if not result.mass_silence:
        if open_alert is not None:
            FleetAlert.objects.filter(pk=open_alert.pk).update(resolved_at=now, last_seen_at=now)
            logger.warning("Mass-silence alert resolved: %d of %d nodes silent", silent, total)
        return
    data = {"silent": silent, "watched": total, "fraction": round(result.silent_fraction, 3)}
    message = (
        f"{silent} of {total} nodes ({result.silent_fraction:.0%}) have sent no heartbeat for "
        f"{settings.NODE_SUSPECT_AFTER_S}s: the portal is probably cut off from them. No node is "
        "marked DOWN while this lasts."
    )
    if open_alert is None:
        FleetAlert.objects.create(
            kind=FleetAlert.Kind.MASS_SILENCE, message=message, data=data, opened_at=now, last_seen_at=now
        )
        node_metrics.ALERTS.labels(kind=FleetAlert.Kind.MASS_SILENCE).inc()
    else:
        FleetAlert.objects.filter(pk=open_alert.pk).update(message=message, data=data, last_seen_at=now)
    logger.error("Mass silence: %s", message)


# --- staff actions on nodes -------------------------------------------------------------------------


_STAFF_TRANSITIONS: dict[str, tuple[str, ...]] = {
    # target: allowed from
    NodeState.CORDONED: (NodeState.READY, NodeState.DRAINING, NodeState.SUSPECT),
    NodeState.DRAINING: (NodeState.READY, NodeState.CORDONED, NodeState.SUSPECT),
    NodeState.READY: (NodeState.CORDONED, NodeState.DRAINING, NodeState.MAINTENANCE, NodeState.DOWN),
    NodeState.MAINTENANCE: tuple(v for v in NodeState.values if v != NodeState.SLURM),
}


@transaction.atomic
def _node_staff_set_state(*, node: Node, state: str, actor: Actor, reason: str, action: str) -> Node:
    node = lock_node(node_id=node.pk)
    if node.state == state:
        return node
    if node.state == NodeState.SLURM:
        raise Conflict("A Slurm node's state is Slurm's: change it with scontrol.", code="invalid_state")
    if node.state not in _STAFF_TRANSITIONS[state]:
        raise Conflict(f"A {node.state} node cannot be {action}ed.", code="invalid_state")
    old = node.state
    now = timezone.now()
    node.state = state
    node.state_reason = (reason or f"{action} by {actor}")[:255]
    node.state_changed_at = now
    node.resume_state = ""
    node.save(update_fields=["state", "state_reason", "state_changed_at", "resume_state"])
    audit_record(
        tenant=None,
        actor=actor,
        action=f"node.{action}",
        target=node,
        data={"from": old, "to": state, "reason": reason},
    )
    if state == NodeState.READY:
        send_on_commit(node_ready, sender=Node, node=node)
    return node


def node_cordon(*, node: Node, actor: Actor, reason: str = "") -> Node:
    """No new work on the node; what runs there keeps running."""
    return _node_staff_set_state(
        node=node, state=NodeState.CORDONED, actor=actor, reason=reason, action="cordon"
    )


@transaction.atomic
def node_drain(*, node: Node, actor: Actor, reason: str = "") -> Node:
    """No new work; the agent is told (a ``drain`` command) to let running work finish."""
    from nodes.services.commands import node_command_enqueue

    was = node.state
    node = _node_staff_set_state(
        node=node, state=NodeState.DRAINING, actor=actor, reason=reason, action="drain"
    )
    if was != NodeState.DRAINING:
        node_command_enqueue(node=node, kind="drain", payload={})
    return node


@transaction.atomic
def node_uncordon(*, node: Node, actor: Actor, reason: str = "") -> Node:
    """Back to READY from cordoned, draining, maintenance or down; the agent is told (an ``undrain``
    command) to take work again, since a drained agent refuses starts until then."""
    from nodes.services.commands import node_command_enqueue

    was = lock_node(node_id=node.pk).state
    node = _node_staff_set_state(
        node=node, state=NodeState.READY, actor=actor, reason=reason, action="uncordon"
    )
    if was != NodeState.READY:
        node_command_enqueue(node=node, kind="undrain", payload={})
    return node


def node_set_maintenance(*, node: Node, actor: Actor, reason: str = "") -> Node:
    """Out of service for staff work: not scheduled, and not marked SUSPECT or DOWN when silent."""
    if not reason.strip():
        raise ValidationFailed("Say why the node goes into maintenance.", fields={"reason": ["Required."]})
    return _node_staff_set_state(
        node=node, state=NodeState.MAINTENANCE, actor=actor, reason=reason, action="maintenance"
    )


# --- GPUs ---------------------------------------------------------------------------------------------


def gpu_mark_unhealthy(*, gpu_id: int, reason: str, now: datetime | None = None) -> bool:
    """Isolate a failing GPU and announce it (``gpu_unhealthy``, on commit). Returns False when it
    was already unhealthy."""
    now = now or timezone.now()
    with transaction.atomic():
        changed = Gpu.objects.filter(pk=gpu_id, health=GpuHealth.HEALTHY).update(
            health=GpuHealth.UNHEALTHY, health_reason=reason[:255], health_changed_at=now, isolated=True
        )
        if not changed:
            return False
        gpu = Gpu.objects.select_related("node").get(pk=gpu_id)
        send_on_commit(gpu_unhealthy, sender=Gpu, gpu=gpu, node=gpu.node, reason=reason)
    node_metrics.GPUS_MARKED_UNHEALTHY.inc()
    logger.warning("GPU %s on %s isolated: %s", gpu.uuid, gpu.node.hostname, reason)
    return True


@transaction.atomic
def gpu_return_to_service(*, gpu: Gpu, actor: Actor, reason: str = "") -> Gpu:
    """Staff: the GPU was checked (or replaced); it is HEALTHY and schedulable again. The current ECC
    counters become the new baseline, so only new errors isolate it again."""
    gpu = lock_gpu(gpu_id=gpu.pk)
    old = {"health": gpu.health, "reason": gpu.health_reason, "isolated": gpu.isolated}
    gpu.health = GpuHealth.HEALTHY
    gpu.health_reason = ""
    gpu.isolated = False
    gpu.health_changed_at = timezone.now()
    gpu.save(update_fields=["health", "health_reason", "isolated", "health_changed_at"])
    audit_record(
        tenant=None,
        actor=actor,
        action="gpu.return_to_service",
        target=gpu,
        data={"before": old, "reason": reason},
    )
    return gpu


@transaction.atomic
def gpu_isolate(*, gpu: Gpu, actor: Actor, reason: str) -> Gpu:
    """Staff: keep a GPU out of scheduling (it stays HEALTHY as far as its telemetry goes)."""
    if not reason.strip():
        raise ValidationFailed("Say why the GPU is isolated.", fields={"reason": ["Required."]})
    gpu = lock_gpu(gpu_id=gpu.pk)
    gpu.isolated = True
    gpu.health_reason = reason[:255]
    gpu.save(update_fields=["isolated", "health_reason"])
    audit_record(tenant=None, actor=actor, action="gpu.isolate", target=gpu, data={"reason": reason})
    return gpu
