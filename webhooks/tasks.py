"""Webhook tasks: thin, by id, safe to run twice (an attempt is claimed under a row lock)."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="webhooks.tasks.deliver", ignore_result=True)
def deliver(delivery_id: int) -> None:
    from webhooks.services.deliveries import delivery_attempt

    delivery_attempt(delivery_id=delivery_id)


@shared_task(name="webhooks.tasks.deliver_due", ignore_result=True)
def deliver_due() -> int:
    from webhooks.services.deliveries import deliveries_due

    ids = deliveries_due()
    for pk in ids:
        deliver.delay(pk)
    return len(ids)


@shared_task(name="webhooks.tasks.purge", ignore_result=True)
def purge() -> int:
    from webhooks.services.deliveries import webhooks_purge

    return webhooks_purge()
