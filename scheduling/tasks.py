"""Celery tasks: thin, named, safe to run twice (the cycle is single-flight and idempotent)."""

from __future__ import annotations

from celery import shared_task

from scheduling.api import gpu_types_refresh
from scheduling.metrics import cycle_recorded
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.lifecycle import scheduling_reconcile
from scheduling.services.logs import workload_logs_purge
from scheduling.services.triggers import cycle_request_clear
from scheduling.services.volumes import volumes_data_removal
from scheduling.services.warm_pools import warm_pools_reconcile


@shared_task(name="scheduling.tasks.run_cycle", ignore_result=True)
def run_cycle(token: str | None = None) -> dict:
    """A cycle: asked for by a trigger (``token``: the mark's, which it clears; see
    ``scheduling.services.triggers``) or by beat (none)."""
    if token is not None:
        cycle_request_clear(token)
    with cycle_recorded() as outcome:
        r = outcome["result"] = scheduling_cycle_run()
    return {"ran": r.ran, "placed": len(r.placed), "preempted": len(r.preempted), "pending": r.pending}


@shared_task(name="scheduling.tasks.reconcile", ignore_result=True)
def reconcile() -> dict:
    result = scheduling_reconcile().as_dict()
    result["volume_data_removals"] = volumes_data_removal()
    return result


@shared_task(name="scheduling.tasks.warm_pools", ignore_result=True)
def warm_pools() -> dict:
    r = warm_pools_reconcile()
    return {"ran": r.ran, "targets": r.targets, "prewarmed": r.prewarmed, "ended": r.ended}


@shared_task(name="scheduling.tasks.refresh_gpu_types", ignore_result=True)
def refresh_gpu_types() -> None:
    """The GPU catalog's next cached answer, asked for by the request that found it old (see
    ``scheduling.api.GpuTypeViewSet.list`` and ``gpu_types_refresh``)."""
    gpu_types_refresh()


@shared_task(name="scheduling.tasks.purge_logs")
def purge_logs() -> dict:
    return workload_logs_purge()


@shared_task(name="scheduling.tasks.slurm_sync", ignore_result=True)
def slurm_sync() -> list[dict]:
    """Every Slurm region: inventory, submissions, states, stops, accounting and output."""
    from scheduling.services.slurm import slurm_regions_sync

    return [
        {"region": r.region, "submitted": len(r.submitted), "ended": len(r.ended), "error": r.error}
        for r in slurm_regions_sync()
    ]
