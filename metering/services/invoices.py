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

from collections import defaultdict
from datetime import date, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from metering.models import (
    CREDIT_ORDER,
    CreditEntry,
    CreditKind,
    CreditNote,
    Invoice,
    InvoiceLine,
    InvoiceStatus,
    LineKind,
    UsageRecord,
)
from metering.money import HOUR, ZERO, quantize_money
from metering.periods import days_in_period, next_period, period_bounds, period_of, previous_period
from metering.services.rates import PriceBook, billing_account_for, discounted, rate_card_for_tenant
from nodes.models import GpuModel, Region
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.models import Tenant
from portal.services import audit_record
from scheduling.models import MILLI, Plan, Reservation, ReservationStatus

HOURS_PER_MONTH = Decimal(730)


def _model_names() -> dict[int, str]:
    return {m.pk: (m.short_name or m.name) for m in GpuModel.objects.all()}


def term_months(starts_at: datetime, ends_at: datetime) -> int:
    months = (ends_at.year - starts_at.year) * 12 + (ends_at.month - starts_at.month)
    if (ends_at.day, ends_at.time()) < (starts_at.day, starts_at.time()):
        months -= 1
    return max(months, 1)


def term_discount_percent(months: int) -> Decimal:
    """The discount of the longest standard term (1, 3, 6 or 12 months) the reservation reaches."""
    table = {int(k): Decimal(str(v)) for k, v in settings.METERING_RESERVED_TERM_DISCOUNTS.items()}
    eligible = [t for t in table if t <= months]
    return table[max(eligible)] if eligible else ZERO


def reserved_days(reservation: Reservation, period_start: date) -> int:
    """Calendar days of the month on which the reservation is in force for any part of the day."""
    p_end = next_period(period_start)
    first = max(period_start, reservation.starts_at.date())
    last_excl = min(p_end, (reservation.ends_at - timedelta(microseconds=1)).date() + timedelta(days=1))
    return max((last_excl - first).days, 0)


def _reserved_fee_lines(tenant, period_start: date, book: PriceBook, discount, currency, names, regions):
    start, end = period_bounds(period_start)
    out = []
    reservations = Reservation.objects.filter(
        tenant=tenant, status=ReservationStatus.ACTIVE, starts_at__lt=end, ends_at__gt=start
    ).order_by("starts_at", "pk")
    for r in reservations:
        days = reserved_days(r, period_start)
        if days == 0:
            continue
        priced = book.at(max(start, r.starts_at))
        hourly = priced.gpu.get((r.gpu_model_id, Plan.RESERVED)) if priced else None
        if hourly is None:
            raise ValidationFailed(
                f"No reserved price for {names.get(r.gpu_model_id)} in force on {max(start, r.starts_at):%Y-%m-%d}.",
                fields={"rate_card": ["Missing reserved price."]},
            )
        months = term_months(r.starts_at, r.ends_at)
        term_disc = term_discount_percent(months)
        monthly = discounted(discounted(hourly, discount) * HOURS_PER_MONTH, term_disc)
        total_days = days_in_period(period_start)
        amount = quantize_money(monthly * r.count * days / total_days, currency)
        out.append(
            {
                "kind": LineKind.RESERVED_FEE,
                "description": (
                    f"Reserved: {r.count}x {names.get(r.gpu_model_id)} in {regions.get(r.region_id)}, "
                    f"{months}-month term ({term_disc}% off), {days} of {total_days} days"
                ),
                "gpu_model_id": r.gpu_model_id,
                "plan": Plan.RESERVED,
                "quantity": Decimal(r.count * days) / Decimal(total_days),
                "unit": "gpu-month",
                "unit_price": monthly,
                "amount": amount,
            }
        )
    return out


def reserved_overage(
    records, *, reservations: dict[int, Reservation]
) -> list[tuple[int, int, datetime, datetime, int]]:
    """Excess of reserved usage over each reservation's GPUs: ``(reservation_id, gpu_model_id, start,
    end, excess_milli)`` pieces, from a sweep over the records' intervals."""
    by_res: dict[int, list] = defaultdict(list)
    for rec in records:
        by_res[rec["workload__reservation_id"]].append(rec)
    out = []
    for res_id, recs in by_res.items():
        r = reservations.get(res_id)
        cap = (r.count if r is not None else 0) * MILLI
        points: dict[datetime, int] = defaultdict(int)
        for rec in recs:
            points[rec["start"]] += rec["fraction_milli"]
            points[rec["end"]] -= rec["fraction_milli"]
        in_use = 0
        times = sorted(points)
        for i, t in enumerate(times[:-1]):
            in_use += points[t]
            if in_use > cap:
                model = r.gpu_model_id if r is not None else recs[0]["gpu_model_id"]
                out.append((res_id, model, t, times[i + 1], in_use - cap))
    return out


def _usage_lines(invoice: Invoice, book: PriceBook, discount, currency, names):
    lines = []
    current = UsageRecord.objects.filter(invoice=invoice, period_start=invoice.period_start)
    for plan, kind, label in (
        (Plan.ON_DEMAND, LineKind.ON_DEMAND, "On-demand"),
        (Plan.SPOT, LineKind.SPOT, "Spot"),
    ):
        rows = (
            current.filter(plan=plan)
            .values("gpu_model_id")
            .annotate(amount=Sum("amount"), gpu_s=Sum("gpu_seconds"))
            .order_by("gpu_model_id")
        )
        for row in rows:
            hours = row["gpu_s"] / HOUR
            lines.append(
                {
                    "kind": kind,
                    "description": f"{label} usage: {names.get(row['gpu_model_id'])}, {hours:.3f} GPU-hours",
                    "gpu_model_id": row["gpu_model_id"],
                    "plan": plan,
                    "quantity": hours,
                    "unit": "gpu-hour",
                    "unit_price": None,
                    "amount": quantize_money(row["amount"], currency),
                }
            )
    reserved = list(
        current.filter(plan=Plan.RESERVED).values(
            "workload__reservation_id", "gpu_model_id", "start", "end", "fraction_milli"
        )
    )
    if reserved:
        res = {
            r.pk: r
            for r in Reservation.objects.filter(pk__in={x["workload__reservation_id"] for x in reserved})
        }
        per_model: dict[int, list[Decimal]] = defaultdict(lambda: [ZERO, ZERO])
        for _res_id, model_id, s, e, excess in reserved_overage(reserved, reservations=res):
            priced = book.at(s)
            price = discounted(priced.gpu.get((model_id, Plan.ON_DEMAND)), discount) if priced else None
            if price is None:
                raise ValidationFailed(
                    f"No on-demand price for {names.get(model_id)} in force at {s:%Y-%m-%d %H:%M}.",
                    fields={"rate_card": ["Missing on-demand price."]},
                )
            gpu_s = Decimal(excess) / Decimal(MILLI) * Decimal((e - s).total_seconds())
            per_model[model_id][0] += gpu_s
            per_model[model_id][1] += gpu_s * price / HOUR
        for model_id in sorted(per_model):
            gpu_s, amount = per_model[model_id]
            lines.append(
                {
                    "kind": LineKind.RESERVED_OVERAGE,
                    "description": (
                        f"Reserved usage above reserved GPUs, billed on-demand: {names.get(model_id)}, "
                        f"{gpu_s / HOUR:.3f} GPU-hours"
                    ),
                    "gpu_model_id": model_id,
                    "plan": Plan.ON_DEMAND,
                    "quantity": gpu_s / HOUR,
                    "unit": "gpu-hour",
                    "unit_price": None,
                    "amount": quantize_money(amount, currency),
                }
            )
    late = (
        UsageRecord.objects.filter(invoice=invoice, period_start__lt=invoice.period_start)
        .values("period_start", "plan", "gpu_model_id")
        .annotate(amount=Sum("amount"), gpu_s=Sum("gpu_seconds"))
        .order_by("period_start", "plan", "gpu_model_id")
    )
    for row in late:
        hours = row["gpu_s"] / HOUR
        lines.append(
            {
                "kind": LineKind.ADJUSTMENT,
                "description": (
                    f"Adjustment: late {row['plan'].replace('_', '-')} usage for {row['period_start']:%Y-%m}: "
                    f"{names.get(row['gpu_model_id'])}, {hours:.3f} GPU-hours"
                ),
                "gpu_model_id": row["gpu_model_id"],
                "plan": row["plan"],
                "original_period": row["period_start"],
                "quantity": hours,
                "unit": "gpu-hour",
                "unit_price": None,
                "amount": quantize_money(row["amount"], currency),
            }
        )
    return lines


def _attach_usage(invoice: Invoice) -> None:
    UsageRecord.objects.filter(
        tenant=invoice.tenant_id, invoice__isnull=True, period_start=invoice.period_start
    ).update(invoice=invoice)
    closed_periods = Invoice.objects.filter(
        tenant=invoice.tenant_id, period_start__lt=invoice.period_start
    ).exclude(status=InvoiceStatus.DRAFT)
    UsageRecord.objects.filter(
        tenant=invoice.tenant_id,
        invoice__isnull=True,
        period_start__in=closed_periods.values("period_start"),
    ).update(invoice=invoice)


def _write_lines(invoice: Invoice, lines: list[dict], currency: str) -> None:
    InvoiceLine.objects.filter(invoice=invoice).delete()
    InvoiceLine.objects.bulk_create(
        InvoiceLine(tenant_id=invoice.tenant_id, invoice=invoice, position=i, **line)
        for i, line in enumerate(lines, start=1)
    )


def _totals(lines: list[dict]) -> tuple[Decimal, Decimal, Decimal, Decimal]:
    subtotal = sum((ln["amount"] for ln in lines if ln["kind"] not in (LineKind.CREDIT, LineKind.TAX)), ZERO)
    credits = -sum((ln["amount"] for ln in lines if ln["kind"] == LineKind.CREDIT), ZERO)
    tax = sum((ln["amount"] for ln in lines if ln["kind"] == LineKind.TAX), ZERO)
    total = sum((ln["amount"] for ln in lines), ZERO)
    return subtotal, credits, tax, total


def _tax_line(taxable: Decimal, rate: Decimal, currency: str) -> dict | None:
    if not rate:
        return None
    return {
        "kind": LineKind.TAX,
        "description": f"Tax {rate.normalize():f}%",
        "quantity": Decimal(1),
        "unit": "",
        "unit_price": None,
        "amount": quantize_money(taxable * rate / Decimal(100), currency),
    }


def _charge_lines(invoice: Invoice, tenant) -> tuple[list[dict], Decimal, str]:
    card = rate_card_for_tenant(tenant=tenant)
    account = billing_account_for(tenant=tenant)
    book = PriceBook(card)
    currency = invoice.currency
    names = _model_names()
    regions = dict(Region.objects.values_list("pk", "code"))
    lines = _reserved_fee_lines(
        tenant, invoice.period_start, book, account.discount_percent, currency, names, regions
    )
    lines += _usage_lines(invoice, book, account.discount_percent, currency, names)
    return lines, account.tax_rate_percent, currency


def invoice_get_or_create(*, tenant: Tenant, period_start: date) -> Invoice:
    if period_start.day != 1:
        raise ValidationFailed(
            "period_start: must be the first day of a month.", fields={"period_start": ["Not a month start."]}
        )
    card = rate_card_for_tenant(tenant=tenant)
    _, end = period_bounds(period_start)
    invoice, _ = Invoice.objects.get_or_create(
        tenant=tenant,
        period_start=period_start,
        defaults={
            "period_end": next_period(period_start),
            "currency": card.currency if card is not None else tenant.currency,
            "grace_until": end + timedelta(days=settings.METERING_INVOICE_GRACE_DAYS),
        },
    )
    return invoice


def invoice_build(*, tenant: Tenant, period_start: date, now: datetime | None = None) -> Invoice:
    """Get or create the tenant's invoice for the month and, while it is a draft, (re)build its
    lines from usage and reservations. A finalized, paid or void invoice is returned unchanged."""
    now = now or timezone.now()
    invoice = invoice_get_or_create(tenant=tenant, period_start=period_start)
    with transaction.atomic():
        invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
        if not invoice.is_draft:
            return invoice
        _attach_usage(invoice)
        lines, tax_rate, currency = _charge_lines(invoice, tenant)
        subtotal, _, _, _ = _totals(lines)
        tax = _tax_line(subtotal, tax_rate, currency)
        if tax is not None:
            lines.append(tax)
        _write_lines(invoice, lines, currency)
        invoice.subtotal, invoice.credits, invoice.tax, invoice.total = _totals(lines)
        invoice.tax_rate_percent = tax_rate
        invoice.built_at = now
        invoice.save(update_fields=["subtotal", "credits", "tax", "total", "tax_rate_percent", "built_at"])
    return invoice


def credit_balance(*, tenant, kind: str | None = None) -> Decimal:
    qs = CreditEntry.objects.filter(tenant=tenant)
    if kind is not None:
        qs = qs.filter(kind=kind)
    return qs.aggregate(s=Sum("amount"))["s"] or ZERO


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
    tenant = invoice.tenant
    with transaction.atomic():
        invoice = invoice_build(tenant=tenant, period_start=invoice.period_start, now=now)
        invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
        if not invoice.is_draft:
            raise Conflict(f"Invoice {invoice.pk} is {invoice.status}; only a draft can be finalized.")
        lines, tax_rate, currency = _charge_lines(invoice, tenant)
        subtotal, _, _, _ = _totals(lines)
        remaining = max(subtotal, ZERO)
        for kind in CREDIT_ORDER:
            available = credit_balance(tenant=tenant, kind=kind)
            use = quantize_money(min(available, remaining), currency)
            if use <= 0:
                continue
            CreditEntry.objects.create(
                tenant=tenant,
                kind=kind,
                amount=-use,
                currency=currency,
                invoice=invoice,
                note=f"Applied to invoice {invoice.pk} ({invoice.period_start:%Y-%m})",
                created_at=now,
            )
            lines.append(
                {
                    "kind": LineKind.CREDIT,
                    "description": f"{kind.title()} credits applied",
                    "quantity": Decimal(1),
                    "unit": "",
                    "unit_price": None,
                    "amount": -use,
                }
            )
            remaining -= use
        tax = _tax_line(remaining, tax_rate, currency)
        if tax is not None:
            lines.append(tax)
        _write_lines(invoice, lines, currency)
        invoice.subtotal, invoice.credits, invoice.tax, invoice.total = _totals(lines)
        invoice.tax_rate_percent = tax_rate
        invoice.status = InvoiceStatus.FINALIZED
        invoice.finalized_at = now
        invoice.due_at = now + timedelta(days=settings.METERING_PAYMENT_TERMS_DAYS)
        invoice.payment_provider = settings.METERING_PAYMENT_PROVIDER
        invoice.save()
        if invoice.payment_provider != "manual":
            from metering.tasks import invoice_payment_submit

            pk = invoice.pk
            transaction.on_commit(lambda: invoice_payment_submit.delay(pk))
        audit_record(
            tenant=tenant,
            actor=actor,
            action="invoice.finalize",
            target=invoice,
            data={"total": str(invoice.total)},
        )
    return invoice


def invoice_mark_paid(
    *, invoice: Invoice, actor: Actor, now: datetime | None = None, data: dict | None = None
) -> Invoice:
    """Finance (manual provider) or the provider's webhook: the invoice is paid. If it is why the
    tenant was suspended (dunning), the tenant is reactivated. ``data`` (e.g. the provider's event)
    goes into the audit record."""
    from metering.services.payments import dunning_release

    now = now or timezone.now()
    with transaction.atomic():
        invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
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
        dunning_release(invoice=invoice, now=now)
    return invoice


def invoice_void(*, invoice: Invoice, actor: Actor, reason: str, now: datetime | None = None) -> Invoice:
    """Void a finalized, unpaid invoice; credits it used go back to the ledger as new grants."""
    now = now or timezone.now()
    with transaction.atomic():
        invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
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
        invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
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


def invoice_run(*, period_start: date | None = None, now: datetime | None = None) -> list[Invoice]:
    """The monthly run (beat, and staff on demand): record usage, build every tenant's invoice for
    the period (default: last month) and finalize drafts whose grace period is over. Idempotent."""
    from metering.services.usage import usage_build

    now = now or timezone.now()
    period_start = period_start or previous_period(period_of(now))
    start, end = period_bounds(period_start)
    usage_build(since=start, now=now)
    tenant_ids = set(
        UsageRecord.objects.filter(
            Q(period_start=period_start) | Q(invoice__isnull=True, period_start__lt=period_start)
        ).values_list("tenant_id", flat=True)
    )
    tenant_ids |= set(
        Reservation.objects.filter(
            status=ReservationStatus.ACTIVE, starts_at__lt=end, ends_at__gt=start
        ).values_list("tenant_id", flat=True)
    )
    invoices = [
        invoice_build(tenant=t, period_start=period_start, now=now)
        for t in Tenant.objects.filter(pk__in=tenant_ids).order_by("pk")
    ]
    invoices_finalize_due(now=now)
    return invoices


def invoices_finalize_due(*, now: datetime | None = None) -> int:
    now = now or timezone.now()
    due = list(
        Invoice.objects.filter(status=InvoiceStatus.DRAFT, grace_until__lte=now).select_related("tenant")
    )
    for invoice in due:
        invoice_finalize(invoice=invoice, actor=Actor.system(), now=now)
    return len(due)
