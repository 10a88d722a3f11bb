"""Thin Celery tasks: each calls one service; all are safe to run twice."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="metering.tasks.usage_build")
def usage_build() -> int:
    from metering.services.usage import usage_build as build

    return build().created


@shared_task(name="metering.tasks.invoice_run")
def invoice_run(period_start: str | None = None) -> int:
    from datetime import date

    from metering.services.invoices import invoice_run as run

    return len(run(period_start=date.fromisoformat(period_start) if period_start else None))


@shared_task(name="metering.tasks.spot_prices_update")
def spot_prices_update() -> int:
    from metering.services.spot import spot_prices_update as update

    return len(update())
