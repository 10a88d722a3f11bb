"""Invoices: one per tenant per calendar month (UTC), built with get-or-create on (tenant, period).

Lines, in this order: reserved fees (prorated by day), on-demand usage per GPU model, spot usage per
model, reserved usage above the reservation's GPUs (billed on-demand), adjustments (usage that
arrived after its own period's invoice was finalized, naming that period), credits applied and tax.
Each line is rounded once by ``quantize_money``; the total is the sum of the lines.

A draft is rebuilt from its usage records every time it is built, so building twice gives the same
lines. Credits are applied at finalization (the ledger is append-only). After finalization the
database refuses changes to the money fields and lines; corrections are credit notes.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import date, datetime
from decimal import Decimal

from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from metering.locks import lock_invoice
from metering.models import (
    CreditEntry,
    CreditKind,
    CreditNote,
    Invoice,
    InvoiceStatus,
    UsageRecord,
)
from metering.money import ZERO, quantize_money
from metering.periods import period_bounds, period_of, previous_period
from metering.services.invoice_build import RunCache, invoices_build_batch
from metering.services.invoice_events import invoice_event_publish
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.models import Tenant
from portal.services.audit import audit_record
from scheduling.models import Reservation, ReservationStatus

logger = logging.getLogger(__name__)
# Tenants per transaction in the monthly run: a fixed number of queries per batch.
BATCH_SIZE = 250


def _check_period(period_start: date) -> None:
    if period_start.day != 1:
        raise ValidationFailed(
            "period_start: must be the first day of a month.", fields={"period_start": ["Not a month start."]}
        )


def invoice_build(*, tenant: Tenant, period_start: date, now: datetime | None = None) -> Invoice:
    """Get or create the tenant's invoice for the month and, while it is a draft, (re)build its
    lines from usage and reservations. A finalized, paid or void invoice is returned unchanged."""
    _check_period(period_start)
    now = now or timezone.now()
    return invoices_build_batch(tenant_ids=[tenant.pk], period_start=period_start, now=now)[0]


def credit_grant(*, tenant, kind: str, amount, note: str = "", actor: Actor) -> CreditEntry:
    value = Decimal(str(amount))
    if not value.is_finite() or value <= 0:
        raise ValidationFailed(
            "amount: a credit must be more than 0.", fields={"amount": ["Must be more than 0."]}
        )
    entry = CreditEntry.objects.create(
        tenant=tenant,
        kind=kind,
        amount=quantize_money(value, tenant.currency),
        currency=tenant.currency,
        note=note,
    )
    audit_record(
        tenant=tenant,
        actor=actor,
        action="credit.grant",
        target=entry,
        data={"kind": kind, "amount": str(entry.amount)},
    )
    return entry


def invoice_finalize(*, invoice: Invoice, actor: Actor, now: datetime | None = None) -> Invoice:
    """Rebuild the draft one last time, apply credits (promotional, then prepaid, up to the
    subtotal), add tax on what is left, and make it immutable."""
    now = now or timezone.now()
    with transaction.atomic():
        current = lock_invoice(invoice_id=invoice.pk)
        if not current.is_draft:
            raise Conflict(f"Invoice {current.pk} is {current.status}; only a draft can be finalized.")
        return invoices_build_batch(
            tenant_ids=[current.tenant_id],
            period_start=current.period_start,
            now=now,
            finalize=True,
            actor=actor,
        )[0]


def invoice_mark_paid(
    *, invoice: Invoice, actor: Actor, now: datetime | None = None, data: dict | None = None
) -> Invoice:
    """Finance (manual provider) or the provider's webhook: the invoice is paid. If it is why the
    tenant was suspended (dunning), the tenant is reactivated. ``data`` (e.g. the provider's event)
    goes into the audit record."""
    from metering.services.payments import dunning_release

    now = now or timezone.now()
    with transaction.atomic():
        invoice = lock_invoice(invoice_id=invoice.pk)
        if invoice.status != InvoiceStatus.FINALIZED:
            raise Conflict(f"Invoice {invoice.pk} is {invoice.status}; only a finalized invoice can be paid.")
        invoice.status = InvoiceStatus.PAID
        invoice.paid_at = now
        invoice.save(update_fields=["status", "paid_at"])
        audit_record(
            tenant=invoice.tenant,
            actor=actor,
            action="invoice.paid",
            target=invoice,
            data={"total": str(quantize_money(invoice.total, invoice.currency)), **(data or {})},
        )
        invoice_event_publish(invoice=invoice, type="invoice.paid", now=now)
        dunning_release(invoice=invoice, now=now)
    return invoice


def invoice_void(
    *, invoice: Invoice, actor: Actor, reason: str, now: datetime | None = None, provider_done: bool = False
) -> Invoice:
    """Void a finalized, unpaid invoice; credits it used go back to the ledger as new grants.

    It is voided at the payment provider first (Stripe: the invoice sent for it, found by its id
    or our metadata), so the customer is not charged for what we no longer claim; a provider
    error leaves it finalized here. ``provider_done``: the provider voided it (its webhook)."""
    from metering.payments import provider_get

    now = now or timezone.now()
    current = Invoice.objects.get(pk=invoice.pk)
    if current.status == InvoiceStatus.FINALIZED and current.payment_provider and not provider_done:
        provider_get(current.payment_provider).void(invoice=current)
    with transaction.atomic():
        invoice = lock_invoice(invoice_id=invoice.pk)
        if invoice.status != InvoiceStatus.FINALIZED:
            raise Conflict(
                f"Invoice {invoice.pk} is {invoice.status}; only a finalized, unpaid invoice can be voided."
            )
        for used in CreditEntry.objects.filter(invoice=invoice):
            CreditEntry.objects.create(
                tenant_id=invoice.tenant_id,
                kind=used.kind,
                amount=-used.amount,
                currency=used.currency,
                note=f"Returned from voided invoice {invoice.pk}",
                created_at=now,
            )
        invoice.status = InvoiceStatus.VOID
        invoice.voided_at = now
        invoice.save(update_fields=["status", "voided_at"])
        audit_record(
            tenant=invoice.tenant, actor=actor, action="invoice.void", target=invoice, data={"reason": reason}
        )
    return invoice


def credit_note_issue(*, invoice: Invoice, amount, reason: str, actor: Actor) -> CreditNote:
    """A correction to a finalized or paid invoice. On a paid invoice the amount also becomes a
    prepaid credit, so it reaches the next invoice."""
    try:
        value = quantize_money(Decimal(str(amount)), invoice.currency)
    except (ArithmeticError, ValueError):
        raise ValidationFailed("amount: not a number.", fields={"amount": ["Not a number."]}) from None
    if value <= 0:
        raise ValidationFailed("amount: must be more than 0.", fields={"amount": ["Must be more than 0."]})
    if not reason.strip():
        raise ValidationFailed("reason: say why.", fields={"reason": ["Required."]})
    with transaction.atomic():
        invoice = lock_invoice(invoice_id=invoice.pk)
        if invoice.status not in (InvoiceStatus.FINALIZED, InvoiceStatus.PAID):
            raise Conflict(
                f"Invoice {invoice.pk} is {invoice.status}; a draft is corrected by rebuilding it."
            )
        issued = CreditNote.objects.filter(invoice=invoice).aggregate(s=Sum("amount"))["s"] or ZERO
        if issued + value > invoice.total:
            raise ValidationFailed(
                f"amount: credit notes would exceed the invoice total {invoice.total}.",
                fields={"amount": [f"At most {invoice.total - issued}."]},
            )
        note = CreditNote.objects.create(
            tenant_id=invoice.tenant_id, invoice=invoice, amount=value, reason=reason[:255]
        )
        if invoice.status == InvoiceStatus.PAID:
            CreditEntry.objects.create(
                tenant_id=invoice.tenant_id,
                kind=CreditKind.PREPAID,
                amount=value,
                currency=invoice.currency,
                note=f"Credit note {note.pk} on invoice {invoice.pk}",
            )
        audit_record(
            tenant=invoice.tenant,
            actor=actor,
            action="invoice.credit_note",
            target=invoice,
            data={"amount": str(value), "reason": reason},
        )
    return note


def _in_batches(
    tenant_ids: list[int], *, period_start: date, now: datetime, cache: RunCache, finalize: bool = False
) -> tuple[list[Invoice], dict[int, Exception]]:
    """Build (or finalize) the tenants' invoices, ``BATCH_SIZE`` tenants per
    transaction. A batch that fails is retried tenant by tenant, so one tenant's failure (a missing
    price, say) costs nobody else their invoice; the failures are returned by tenant id."""
    invoices: list[Invoice] = []
    failed: dict[int, Exception] = {}

    def build(ids: list[int]) -> Exception | None:
        try:
            invoices.extend(
                invoices_build_batch(
                    tenant_ids=ids, period_start=period_start, now=now, cache=cache, finalize=finalize
                )
            )
        except Exception as exc:
            return exc
        return None

    for i in range(0, len(tenant_ids), BATCH_SIZE):
        batch = tenant_ids[i : i + BATCH_SIZE]
        if build(batch) is None:
            continue
        for tenant_id in batch:  # retried one by one: only the failing tenants fail
            error = build([tenant_id])
            if error is not None:
                logger.error(
                    "Invoice of tenant %s for %s failed: %s", tenant_id, period_start, error, exc_info=error
                )
                failed[tenant_id] = error
    return invoices, failed


class InvoiceRunFailed(Exception):
    """Some tenants' invoices could not be built; every other tenant's were."""

    def __init__(self, failed: dict[int, Exception]):
        self.failed = failed
        detail = "; ".join(f"tenant {t}: {e}" for t, e in sorted(failed.items()))
        super().__init__(f"{len(failed)} invoice(s) failed: {detail}")


def invoice_run(*, period_start: date | None = None, now: datetime | None = None) -> list[Invoice]:
    """The monthly run (beat, and staff on demand): record usage, build every tenant's invoice for
    the period (default: last month) and finalize drafts whose grace period is over. Idempotent.
    Tenants are built in batches (``invoices_build_batch``); if some fail, the rest are still built
    and finalized, and :class:`InvoiceRunFailed` names the failures at the end."""
    from metering.services.usage import usage_build

    now = now or timezone.now()
    period_start = period_start or previous_period(period_of(now))
    start, end = period_bounds(period_start)
    usage_build(since=start, now=now)
    tenant_ids = set(
        UsageRecord.objects.filter(
            Q(period_start=period_start) | Q(invoice__isnull=True, period_start__lt=period_start)
        )
        .values_list("tenant_id", flat=True)
        .distinct()
        .order_by()
    )
    tenant_ids |= set(
        Reservation.objects.filter(
            status=ReservationStatus.ACTIVE, starts_at__lt=end, ends_at__gt=start
        ).values_list("tenant_id", flat=True)
    )
    cache = RunCache.load()
    invoices, failed = _in_batches(sorted(tenant_ids), period_start=period_start, now=now, cache=cache)
    invoices.sort(key=lambda i: i.tenant_id)
    failed |= _finalize_due(now=now, cache=cache)[1]
    if failed:
        raise InvoiceRunFailed(failed)
    return invoices


def _finalize_due(*, now: datetime, cache: RunCache) -> tuple[int, dict[int, Exception]]:
    due = (
        Invoice.objects.filter(status=InvoiceStatus.DRAFT, grace_until__lte=now)
        .values_list("period_start", "tenant_id")
        .order_by("period_start", "tenant_id")
    )
    by_period: dict[date, list[int]] = defaultdict(list)
    for period, tenant_id in due:
        by_period[period].append(tenant_id)
    done, failed = 0, {}
    for period, tenant_ids in by_period.items():
        invoices, errors = _in_batches(tenant_ids, period_start=period, now=now, cache=cache, finalize=True)
        done += sum(1 for i in invoices if i.finalized_at == now)
        failed |= errors
    return done, failed
