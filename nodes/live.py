"""Live fleet events for staff browsers (the ``staff`` Channels group, through ``portal.events``).

Two kinds of event, both small JSON objects:

``fleet.snapshot`` (every FLEET_SNAPSHOT_INTERVAL_S, from ``nodes.tasks.publish_fleet_snapshot``)::

    {"type": "fleet.snapshot", "v": 1, "ts": 1733140800,      # unix seconds
     "nodes": {"total": 28, "by_state": {"ready": 25, "cordoned": 1, ...},
               "by_region": {"us-east-1": {"ready": 8, ...}, ...}},
     "not_ready": {"cordoned": [12], "down": [7, 9]},          # node ids; every other node is ready
     "gpus": {"total": 120, "healthy": 118, "unhealthy": 1, "isolated": 2, "util_avg": 63.2},
     "g": [[gpu_id, util_pct, mem_gib, power_w, temp_c], ...], # null values: no current sample
     "alerts": [{"id": 3, "kind": "mass_silence", "message": "..."}],
     "unknown_gpus": 1}

About 25 bytes per GPU in ``g``: 200 nodes of 8 GPUs make a 40 kB event.

``node.state`` and ``gpu.health`` (at once, after the change commits): a staff action, a node marked
DOWN, a GPU isolated or returned to service::

    {"type": "node.state", "node": 12, "hostname": "gpu-0012", "state": "cordoned",
     "label": "Cordoned", "reason": "cordon by ops@example.com"}
    {"type": "gpu.health", "gpu": 40, "node": 12, "health": "healthy", "isolated": false, "reason": ""}

SUSPECT marks and heartbeats that bring a node back update rows with one UPDATE and send no signal;
the next snapshot carries them (``not_ready``).

The receivers are connected when this module is imported (from ``NodesConfig.ready()``).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.db.models import Count
from django.db.models.signals import post_save
from django.dispatch import receiver
from django.utils import timezone

from nodes.models import FleetAlert, Gpu, GpuHealth, Node, NodeState, UnknownGpuReport
from nodes.selectors import fresh_sample
from nodes.signals import gpu_unhealthy, node_down
from portal.events import publish

logger = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1


def _num(value: float | None, places: int = 0) -> float | int | None:
    if value is None:
        return None
    return round(value) if places == 0 else round(value, places)


def fleet_snapshot(*, now: datetime | None = None) -> dict[str, Any]:
    """The ``fleet.snapshot`` event (five queries, tuples only)."""
    now = now or timezone.now()
    by_state = dict.fromkeys(NodeState.values, 0)
    by_region: dict[str, dict[str, int]] = {}
    for code, state, n in (
        Node.objects.values_list("region__code", "state").annotate(n=Count("id")).order_by()
    ):
        by_state[state] += n
        by_region.setdefault(code, {})[state] = n
    not_ready: dict[str, list[int]] = {}
    for node_id, state in (
        Node.objects.exclude(state=NodeState.READY).order_by("id").values_list("id", "state")
    ):
        not_ready.setdefault(state, []).append(node_id)

    rows = []
    health = {"total": 0, "healthy": 0, "unhealthy": 0, "isolated": 0}
    util_sum, util_n = 0.0, 0
    for gpu_id, util, mem, power, temp, fresh, gpu_health, isolated in (
        Gpu.objects.filter(removed_at__isnull=True)
        .annotate(fresh=fresh_sample(now))
        .order_by("id")
        .values_list(
            "id", "last_util_pct", "last_mem_used_mib", "last_power_w", "last_temp_c", "fresh", "health",
            "isolated",
        )
    ):  # fmt: skip
        health["total"] += 1
        if isolated:
            health["isolated"] += 1
        if gpu_health == GpuHealth.UNHEALTHY:
            health["unhealthy"] += 1
        elif not isolated:
            health["healthy"] += 1
        if not fresh or util is None:
            rows.append([gpu_id, None, None, None, None])
            continue
        util_sum += util
        util_n += 1
        rows.append(
            [gpu_id, round(util), round(mem / 1024, 1) if mem is not None else None, _num(power), temp]
        )
    alerts = [
        {"id": pk, "kind": kind, "message": message}
        for pk, kind, message in FleetAlert.objects.filter(resolved_at__isnull=True)
        .order_by("-opened_at")
        .values_list("id", "kind", "message")[:10]
    ]
    return {
        "type": "fleet.snapshot",
        "v": SNAPSHOT_VERSION,
        "ts": int(now.timestamp()),
        "nodes": {"total": sum(by_state.values()), "by_state": by_state, "by_region": by_region},
        "not_ready": not_ready,
        "gpus": {**health, "util_avg": round(util_sum / util_n, 1) if util_n else None},
        "g": rows,
        "alerts": alerts,
        "unknown_gpus": UnknownGpuReport.objects.filter(resolved_at__isnull=True).count(),
    }


def fleet_snapshot_publish(*, now: datetime | None = None) -> dict[str, Any]:
    """Push a snapshot to the staff group. Returns the event."""
    event = fleet_snapshot(now=now)
    publish(tenant_id=None, event=event, staff=True)
    return event


def node_state_event(node: Node) -> dict[str, Any]:
    return {
        "type": "node.state",
        "node": node.pk,
        "hostname": node.hostname,
        "state": node.state,
        "label": NodeState(node.state).label,
        "reason": node.state_reason,
    }


def gpu_health_event(gpu: Gpu) -> dict[str, Any]:
    return {
        "type": "gpu.health",
        "gpu": gpu.pk,
        "node": gpu.node_id,
        "health": gpu.health,
        "isolated": gpu.isolated,
        "reason": gpu.health_reason,
    }


# --- receivers ----------------------------------------------------------------------------------------


@receiver(post_save, sender=Node, dispatch_uid="nodes.live.node_saved")
def _node_saved(sender, instance: Node, created: bool, update_fields=None, **kwargs) -> None:
    # Staff actions save with update_fields naming "state"; bulk UPDATEs (ingest, reconciler) do not
    # come here and are carried by the next snapshot.
    if update_fields is not None and "state" in update_fields:
        publish(tenant_id=None, event=node_state_event(instance), staff=True)


@receiver(node_down, dispatch_uid="nodes.live.node_down")
def _node_down(sender, node: Node, **kwargs) -> None:
    publish(tenant_id=None, event=node_state_event(node), staff=True)


@receiver(post_save, sender=Gpu, dispatch_uid="nodes.live.gpu_saved")
def _gpu_saved(sender, instance: Gpu, created: bool, update_fields=None, **kwargs) -> None:
    if update_fields is not None and {"health", "isolated"} & set(update_fields):
        publish(tenant_id=None, event=gpu_health_event(instance), staff=True)


@receiver(gpu_unhealthy, dispatch_uid="nodes.live.gpu_unhealthy")
def _gpu_unhealthy(sender, gpu: Gpu, **kwargs) -> None:
    publish(tenant_id=None, event=gpu_health_event(gpu), staff=True)


__all__ = ["fleet_snapshot", "fleet_snapshot_publish", "gpu_health_event", "node_state_event"]
