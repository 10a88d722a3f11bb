"""An invoice's events for the tenant (live, and webhooks): finalized, paid, overdue. Published in
the transaction that made the change, for the roles that see billing."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from metering.models import Invoice
from metering.money import quantize_money
from portal.events import publish
from portal.models import Scope


def invoice_event_publish(*, invoice: Invoice, type: str, now: datetime, **extra: Any) -> None:
    """``type`` is ``invoice.finalized``, ``invoice.paid`` or ``invoice.overdue``."""
    from metering.documents import invoice_number

    publish(
        tenant_id=invoice.tenant_id,
        scope=Scope.BILLING,
        event={
            "type": type,
            "invoice_id": invoice.pk,
            "number": invoice_number(invoice),
            "period": f"{invoice.period_start:%Y-%m}",
            "status": invoice.status,
            "total": str(quantize_money(invoice.total, invoice.currency)),
            "currency": invoice.currency,
            "due_at": invoice.due_at.isoformat() if invoice.due_at else None,
            **extra,
            "at": now.isoformat(),
        },
    )
