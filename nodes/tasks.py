"""Periodic fleet work (scheduled in settings.CELERY_BEAT_SCHEDULE). Thin: each calls one service."""

from celery import shared_task

from nodes.services.commands import node_commands_expire
from nodes.services.health import node_health_reconcile
from nodes.services.mig import gpu_mig_drained_send
from nodes.services.rollouts import rollout_advance
from nodes.services.telemetry import telemetry_purge


@shared_task(name="nodes.tasks.reconcile_node_health")
def reconcile_node_health() -> dict:
    result = node_health_reconcile()
    return {
        "suspect": len(result.suspect),
        "down": len(result.down),
        "deferred_down": len(result.deferred_down),
        "mass_silence": result.mass_silence,
    }


@shared_task(name="nodes.tasks.expire_commands")
def expire_commands() -> int:
    return node_commands_expire()


@shared_task(name="nodes.tasks.purge_telemetry")
def purge_telemetry() -> dict:
    return telemetry_purge()


@shared_task(name="nodes.tasks.publish_fleet_snapshot", ignore_result=True)
def publish_fleet_snapshot() -> int:
    """Push the fleet snapshot to staff browsers (``nodes.live``); returns the GPUs it carried."""
    from nodes.live import fleet_snapshot_publish

    return len(fleet_snapshot_publish()["g"])


@shared_task(name="nodes.tasks.advance_rollouts")
def advance_rollouts() -> dict:
    """Move rolling-upgrade campaigns on (single flight: a second run at once returns)."""
    return rollout_advance()


@shared_task(name="nodes.tasks.send_drained_mig")
def send_drained_mig() -> int:
    """Send staff MIG changes whose GPU has drained (the reconciler of scheduling's prompt call)."""
    return gpu_mig_drained_send()
