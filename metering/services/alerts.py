"""Billing alerts: what staff must look at about money (``metering.BillingAlert``, in the admin).

At most one alert is open per kind and subject (the subject names the object: ``invoice:<id>``,
``event:<Stripe id>``, ``charge:<Stripe id>``); raising it again updates the open one and counts
the repeat, so a sweeper that fails every ten minutes leaves one row, not a flood. An alert is
resolved by staff in the admin, or by the code that sees the problem go away.
"""

from __future__ import annotations

import logging

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from metering.models import BillingAlert, Invoice

logger = logging.getLogger(__name__)


def billing_alert_raise(
    *, kind: str, subject: str, message: str, invoice: Invoice | None = None, data: dict | None = None
) -> BillingAlert:
    """Open an alert, or update the open one of the same kind and subject."""
    now = timezone.now()
    fields = {"message": message[:4000], "data": data or {}, "last_seen_at": now}
    for _ in range(2):  # a concurrent raise of the same alert: the second updates the first's row
        updated = BillingAlert.objects.filter(kind=kind, subject=subject, resolved_at__isnull=True).update(
            count=F("count") + 1, **fields
        )
        if updated:
            return BillingAlert.objects.get(kind=kind, subject=subject, resolved_at__isnull=True)
        try:
            with transaction.atomic():
                alert = BillingAlert.objects.create(
                    kind=kind, subject=subject, invoice=invoice, opened_at=now, **fields
                )
        except IntegrityError:
            continue
        logger.warning("billing alert %s %s: %s", kind, subject, message)
        return alert
    raise RuntimeError(f"billing alert {kind} {subject} could not be opened")  # pragma: no cover


def billing_alert_resolve(*, kind: str, subject: str) -> int:
    """Resolve the open alert of this kind and subject, if any (the problem went away)."""
    return BillingAlert.objects.filter(kind=kind, subject=subject, resolved_at__isnull=True).update(
        resolved_at=timezone.now()
    )
