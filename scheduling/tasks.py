"""Celery tasks: thin, named, safe to run twice (the cycle is single-flight and idempotent)."""

from __future__ import annotations

from celery import shared_task

from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.lifecycle import scheduling_reconcile
from scheduling.services.triggers import cycle_request_clear


@shared_task(name="scheduling.tasks.run_cycle", ignore_result=True)
def run_cycle() -> dict:
    cycle_request_clear()
    r = scheduling_cycle_run()
    return {"ran": r.ran, "placed": len(r.placed), "preempted": len(r.preempted), "pending": r.pending}


@shared_task(name="scheduling.tasks.reconcile", ignore_result=True)
def reconcile() -> dict:
    return scheduling_reconcile().as_dict()
