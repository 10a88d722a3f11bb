"""Thin Celery tasks: each calls one service; all are safe to run twice."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings


@shared_task(name="metering.tasks.usage_build")
def usage_build() -> int:
    from metering.services.usage import usage_build as build

    return build().created


# The monthly run over every tenant: the long limits (portal/settings.py), within
# GPUPOOL_TASK_LONGEST_RUN_S, which the broker's visibility timeout outlasts.
LONG_LIMITS = {
    "soft_time_limit": settings.GPUPOOL_LONG_TASK_SOFT_TIME_LIMIT_S,
    "time_limit": settings.GPUPOOL_LONG_TASK_TIME_LIMIT_S,
}


@shared_task(name="metering.tasks.invoice_run", **LONG_LIMITS)
def invoice_run(period_start: str | None = None) -> int:
    from datetime import date

    from metering.metrics import invoice_run_recorded
    from metering.services.invoices import invoice_run as run

    with invoice_run_recorded():
        return len(run(period_start=date.fromisoformat(period_start) if period_start else None))


@shared_task(name="metering.tasks.spot_prices_update")
def spot_prices_update() -> int:
    from metering.services.spot import spot_prices_update as update

    return len(update())


@shared_task(name="metering.tasks.invoice_payment_submit", max_retries=8)
def invoice_payment_submit(invoice_id: int) -> str:
    """Hand a finalized invoice to the payment provider; transient provider errors are retried
    (with the same idempotency keys)."""
    from metering.payments.stripe import TRANSIENT_ERRORS
    from metering.services.payments import invoice_payment_submit as submit

    try:
        return submit(invoice_id=invoice_id).external_id
    except TRANSIENT_ERRORS as e:
        raise invoice_payment_submit.retry(exc=e, countdown=30) from e


@shared_task(name="metering.tasks.invoice_payments_sweep", **LONG_LIMITS)
def invoice_payments_sweep() -> dict:
    """Every few minutes: finalized invoices the provider never received are sent again."""
    from metering.services.payments import invoice_payments_sweep as sweep

    return {outcome: len(ids) for outcome, ids in sweep().items()}


@shared_task(name="metering.tasks.dunning_run")
def dunning_run() -> int:
    from metering.services.payments import dunning_run as run

    return len(run())


@shared_task(name="metering.tasks.costs_to_date_update")
def costs_to_date_update() -> int:
    """Every minute: each tenant's cost of the month so far, and budget alerts."""
    from metering.services.budgets import costs_to_date_update as update

    return update()
