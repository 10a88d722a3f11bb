"""Building invoices in bulk: a fixed number of queries per batch of tenants, whatever its size.

``invoices_build_batch`` is the one piece of code that builds an invoice: ``invoice_build`` and
``invoice_finalize`` call it with one tenant, the monthly run with hundreds. Per batch it

1. loads the tenants' billing accounts and reservations (rate cards' versions are loaded once per
   card and run, GPU model names and regions once per run: :class:`RunCache`);
2. gets or creates the invoices of (tenant, period) (``INSERT .. ON CONFLICT DO NOTHING``, then the
   rows locked ``FOR UPDATE`` in id order); finalized, paid or void ones are left alone;
3. attaches unattached usage to the drafts (two ``UPDATE``s for the whole batch: the period's
   records, and late records of periods whose invoice is closed);
4. aggregates the drafts' usage in SQL, grouped by invoice, period, plan and model (one query), and
   their volumes' storage by invoice and period (one query), and loads the reserved records for the
   overage sweep (one query);
5. computes the lines in Python (the same functions for one tenant or a thousand), applies credits
   when finalizing (balances in one aggregate query), adds tax, deletes the drafts' old lines,
   inserts the new ones (COPY on PostgreSQL) and updates the invoices (one ``UPDATE``).

The caller runs each batch in its own transaction, so a failing tenant costs only its batch, which
the monthly run then retries tenant by tenant.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Subquery, Sum

from metering.locks import lock_period_invoices
from metering.models import (
    CREDIT_ORDER,
    LINE_ORDER,
    CreditEntry,
    Invoice,
    InvoiceLine,
    InvoiceStatus,
    LineKind,
    StorageUsageRecord,
    UsageRecord,
)
from metering.money import HOUR, ZERO, quantize_money
from metering.periods import days_in_period, next_period, period_bounds
from metering.services.invoice_events import invoice_event_publish
from metering.services.rates import PriceBook, TenantPricing, discounted
from nodes.models import GpuModel, Region
from portal.actors import Actor
from portal.bulk import bulk_insert
from portal.errors import ValidationFailed
from portal.models import Tenant
from portal.services.audit import audit_record
from scheduling.models import MILLI, Plan, Reservation, ReservationStatus

HOURS_PER_MONTH = Decimal(730)


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
    last_day = (reservation.ends_at - timedelta(microseconds=1)).date()
    # Compared before adding the day, so that an end at the edge of the calendar cannot overflow.
    last_excl = p_end if last_day >= p_end else last_day + timedelta(days=1)
    return max((last_excl - first).days, 0)


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


@dataclass
class RunCache:
    """What every batch of a run shares: GPU model names, region codes, and the tenants' accounts,
    rate cards and price books (:class:`TenantPricing`)."""

    names: dict[int, str] = field(default_factory=dict)
    regions: dict[int, str] = field(default_factory=dict)
    pricing: TenantPricing = field(default_factory=TenantPricing)

    @classmethod
    def load(cls) -> RunCache:
        return cls(
            names={m.pk: (m.short_name or m.name) for m in GpuModel.objects.all()},
            regions=dict(Region.objects.values_list("pk", "code")),
        )


def _reserved_fee_lines(reservations, period_start: date, book: PriceBook, discount, currency, cache):
    start, _ = period_bounds(period_start)
    names, regions = cache.names, cache.regions
    out = []
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


def _usage_line(kind, label: str, row: dict, currency: str, names, **extra) -> dict:
    hours = row["gpu_s"] / HOUR
    return {
        "kind": kind,
        "description": f"{label}{names.get(row['gpu_model_id'])}, {hours:.3f} GPU-hours",
        "gpu_model_id": row["gpu_model_id"],
        "plan": row["plan"],
        "quantity": hours,
        "unit": "gpu-hour",
        "unit_price": None,
        "amount": quantize_money(row["amount"], currency),
        **extra,
    }


def _usage_lines(
    invoice: Invoice, aggregates: list[dict], reserved: list[dict], reservations, book, discount, cache
):
    """On-demand and spot lines per model, reserved usage above the reservation billed on-demand,
    then adjustments for late usage of closed periods (naming the period)."""
    currency, names = invoice.currency, cache.names
    current = [r for r in aggregates if r["period_start"] == invoice.period_start]
    lines = []
    for plan, kind, label in (
        (Plan.ON_DEMAND, LineKind.ON_DEMAND, "On-demand"),
        (Plan.SPOT, LineKind.SPOT, "Spot"),
    ):
        for row in sorted((r for r in current if r["plan"] == plan), key=lambda r: r["gpu_model_id"]):
            lines.append(_usage_line(kind, f"{label} usage: ", row, currency, names))
    if reserved:
        per_model: dict[int, list[Decimal]] = defaultdict(lambda: [ZERO, ZERO])
        for _res_id, model_id, s, e, excess in reserved_overage(reserved, reservations=reservations):
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
    late = [r for r in aggregates if r["period_start"] < invoice.period_start]
    for row in sorted(late, key=lambda r: (r["period_start"], r["plan"], r["gpu_model_id"])):
        label = f"Adjustment: late {row['plan'].replace('_', '-')} usage for {row['period_start']:%Y-%m}: "
        lines.append(
            _usage_line(LineKind.ADJUSTMENT, label, row, currency, names, original_period=row["period_start"])
        )
    return lines


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


def _get_or_create_locked(tenants: list[Tenant], period_start: date, cache: RunCache) -> list[Invoice]:
    """The tenants' invoices for the period, made where missing (get-or-create on (tenant, period):
    a concurrent or earlier run's row wins), locked in id order."""
    _, end = period_bounds(period_start)
    grace = end + timedelta(days=settings.METERING_INVOICE_GRACE_DAYS)
    new = []
    for t in tenants:
        card = cache.pricing.card(t.pk)
        new.append(
            Invoice(
                tenant_id=t.pk,
                period_start=period_start,
                period_end=next_period(period_start),
                currency=card.currency if card is not None else t.currency,
                grace_until=grace,
            )
        )
    Invoice.objects.bulk_create(new, ignore_conflicts=True)
    return lock_period_invoices(tenant_ids=[t.pk for t in tenants], period_start=period_start)


def _attach_usage(drafts: list[Invoice], period_start: date) -> None:
    """Unattached usage of the period goes onto the draft; so does late usage of an earlier period
    whose invoice is already closed (it becomes an adjustment line)."""
    tenant_ids = [i.tenant_id for i in drafts]
    draft = Invoice.objects.filter(tenant_id=OuterRef("tenant_id"), period_start=period_start).values("pk")[
        :1
    ]
    UsageRecord.objects.filter(
        tenant_id__in=tenant_ids, invoice__isnull=True, period_start=period_start
    ).update(invoice_id=Subquery(draft))
    closed = Invoice.objects.filter(
        tenant_id=OuterRef("tenant_id"), period_start=OuterRef("period_start")
    ).exclude(status=InvoiceStatus.DRAFT)
    UsageRecord.objects.filter(
        Exists(closed), tenant_id__in=tenant_ids, invoice__isnull=True, period_start__lt=period_start
    ).update(invoice_id=Subquery(draft))
    StorageUsageRecord.objects.filter(
        tenant_id__in=tenant_ids, invoice__isnull=True, period_start=period_start
    ).update(invoice_id=Subquery(draft))
    StorageUsageRecord.objects.filter(
        Exists(closed), tenant_id__in=tenant_ids, invoice__isnull=True, period_start__lt=period_start
    ).update(invoice_id=Subquery(draft))


def _storage_lines(invoice: Invoice, rows: list[dict]) -> list[dict]:
    """Volume storage: one line for the invoice's month, and an adjustment for each earlier month
    whose storage was recorded late (naming that month)."""
    lines = []
    for row in sorted(rows, key=lambda r: r["period_start"], reverse=True):
        hours = row["gib_s"] / HOUR
        current = row["period_start"] == invoice.period_start
        label = (
            "Volume storage"
            if current
            else f"Adjustment: late volume storage for {row['period_start']:%Y-%m}"
        )
        lines.append(
            {
                "kind": LineKind.STORAGE if current else LineKind.ADJUSTMENT,
                "description": f"{label}, {hours:.3f} GiB-hours",
                "quantity": hours,
                "unit": "gib-hour",
                "unit_price": None,
                "amount": quantize_money(row["amount"], invoice.currency),
                "original_period": None if current else row["period_start"],
            }
        )
    return lines


def _credit_lines(
    invoice: Invoice, subtotal: Decimal, balances: dict, now: datetime, entries: list
) -> tuple[list, Decimal]:
    """Credits applied in ``CREDIT_ORDER`` up to the subtotal: the lines, the ledger entries (appended
    to ``entries``) and what is left to tax."""
    remaining = max(subtotal, ZERO)
    lines = []
    for kind in CREDIT_ORDER:
        available = balances.get((invoice.tenant_id, kind), ZERO)
        use = quantize_money(min(available, remaining), invoice.currency)
        if use <= 0:
            continue
        entries.append(
            CreditEntry(
                tenant_id=invoice.tenant_id,
                kind=kind,
                amount=-use,
                currency=invoice.currency,
                invoice=invoice,
                note=f"Applied to invoice {invoice.pk} ({invoice.period_start:%Y-%m})",
                created_at=now,
            )
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
    return lines, remaining


def invoices_build_batch(
    *,
    tenant_ids,
    period_start: date,
    now: datetime,
    cache: RunCache | None = None,
    finalize: bool = False,
    actor: Actor | None = None,
) -> list[Invoice]:
    """Get or create the tenants' invoices for the month and (re)build the drafts' lines; with
    ``finalize`` also apply credits and finalize them. Returns every invoice of the batch (those
    already closed unchanged). Runs in the caller's transaction (one is opened if there is none)."""
    cache = cache or RunCache.load()
    start, end = period_bounds(period_start)
    with transaction.atomic():
        tenants = list(Tenant.objects.filter(pk__in=list(tenant_ids)).only("pk", "currency").order_by("pk"))
        if not tenants:
            return []
        ids = [t.pk for t in tenants]
        cache.pricing.load(ids)
        invoices = _get_or_create_locked(tenants, period_start, cache)
        drafts = [i for i in invoices if i.is_draft]
        if not drafts:
            return invoices
        draft_ids = [i.pk for i in drafts]
        _attach_usage(drafts, period_start)
        aggregates: dict[int, list[dict]] = defaultdict(list)
        for row in (
            UsageRecord.objects.filter(invoice_id__in=draft_ids)
            .exclude(period_start=period_start, plan=Plan.RESERVED)
            .values("invoice_id", "period_start", "plan", "gpu_model_id")
            .annotate(amount=Sum("amount"), gpu_s=Sum("gpu_seconds"))
            .order_by()
        ):
            aggregates[row["invoice_id"]].append(row)
        storage: dict[int, list[dict]] = defaultdict(list)
        for row in (
            StorageUsageRecord.objects.filter(invoice_id__in=draft_ids)
            .values("invoice_id", "period_start")
            .annotate(amount=Sum("amount"), gib_s=Sum("gib_seconds"))
            .order_by()
        ):
            storage[row["invoice_id"]].append(row)
        reserved: dict[int, list[dict]] = defaultdict(list)
        for row in UsageRecord.objects.filter(
            invoice_id__in=draft_ids, period_start=period_start, plan=Plan.RESERVED
        ).values("invoice_id", "workload__reservation_id", "gpu_model_id", "start", "end", "fraction_milli"):
            reserved[row["invoice_id"]].append(row)
        res_of: dict[int, list[Reservation]] = defaultdict(list)
        by_pk = {
            r.pk: r
            for r in Reservation.objects.filter(
                tenant_id__in=[i.tenant_id for i in drafts],
                status=ReservationStatus.ACTIVE,
                starts_at__lt=end,
                ends_at__gt=start,
            ).order_by("starts_at", "pk")
        }
        for r in by_pk.values():
            res_of[r.tenant_id].append(r)
        needed = {r["workload__reservation_id"] for rows in reserved.values() for r in rows} - set(by_pk)
        if needed:
            by_pk.update(Reservation.objects.in_bulk(needed))
        balances: dict[tuple[int, str], Decimal] = {}
        if finalize:
            for row in (
                CreditEntry.objects.filter(tenant_id__in=[i.tenant_id for i in drafts])
                .values("tenant_id", "kind")
                .annotate(s=Sum("amount"))
                .order_by()
            ):
                balances[(row["tenant_id"], row["kind"])] = row["s"] or ZERO
        new_lines: list[InvoiceLine] = []
        credit_entries: list[CreditEntry] = []
        for invoice in drafts:
            account, book = cache.pricing.account(invoice.tenant_id), cache.pricing.book(invoice.tenant_id)
            discount, currency = account.discount_percent, invoice.currency
            lines = _reserved_fee_lines(
                res_of[invoice.tenant_id], period_start, book, discount, currency, cache
            )
            lines += _usage_lines(
                invoice, aggregates[invoice.pk], reserved[invoice.pk], by_pk, book, discount, cache
            )
            lines += _storage_lines(invoice, storage[invoice.pk])
            lines.sort(key=lambda line: LINE_ORDER.index(line["kind"]))  # storage before adjustments
            taxable, _, _, _ = _totals(lines)
            if finalize:
                credit, taxable = _credit_lines(invoice, taxable, balances, now, credit_entries)
                lines += credit
            tax = _tax_line(taxable, account.tax_rate_percent, currency)
            if tax is not None:
                lines.append(tax)
            new_lines += [
                InvoiceLine(tenant_id=invoice.tenant_id, invoice_id=invoice.pk, position=i, **line)
                for i, line in enumerate(lines, start=1)
            ]
            invoice.subtotal, invoice.credits, invoice.tax, invoice.total = _totals(lines)
            invoice.tax_rate_percent = account.tax_rate_percent
            invoice.built_at = now
            if finalize:
                invoice.status = InvoiceStatus.FINALIZED
                invoice.finalized_at = now
                invoice.due_at = now + timedelta(days=settings.METERING_PAYMENT_TERMS_DAYS)
                invoice.payment_provider = settings.METERING_PAYMENT_PROVIDER
        # The old lines go and the new come while the rows are still drafts in the database (its
        # guard refuses lines of a finalized invoice); then the invoices' fields in one UPDATE.
        InvoiceLine.objects.filter(invoice_id__in=draft_ids).delete()
        bulk_insert(new_lines)
        fields = ["subtotal", "credits", "tax", "total", "tax_rate_percent", "built_at"]
        if finalize:
            CreditEntry.objects.bulk_create(credit_entries)
            fields += ["status", "finalized_at", "due_at", "payment_provider"]
        Invoice.objects.bulk_update(drafts, fields)
        if finalize:
            _after_finalize(drafts, actor or Actor.system())
    return invoices


def _after_finalize(invoices: list[Invoice], actor: Actor) -> None:
    tenants = Tenant.objects.in_bulk([i.tenant_id for i in invoices])
    for invoice in invoices:
        invoice.tenant = tenants[invoice.tenant_id]
        if invoice.payment_provider != "manual":
            from metering.tasks import invoice_payment_submit

            pk = invoice.pk
            transaction.on_commit(lambda pk=pk: invoice_payment_submit.delay(pk))
        audit_record(
            tenant=invoice.tenant,
            actor=actor,
            action="invoice.finalize",
            target=invoice,
            data={"total": str(invoice.total)},
        )
        invoice_event_publish(invoice=invoice, type="invoice.finalized", now=invoice.finalized_at)
