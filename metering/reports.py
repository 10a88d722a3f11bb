"""Finance reports for staff: revenue, billed versus used GPU-hours against fleet capacity, and
receivables. Each is a handful of aggregate queries (one per table and measure), whatever the number
of usage records; Python only folds the aggregated rows.

**Revenue** is what was invoiced: the charge lines (every line but credits and tax) of invoices in
the chosen statuses (finalized and paid by default; void never), by the invoice's month. Lines carry
tenant, GPU model and plan, so those groupings add up to the invoiced charges exactly. Lines carry
no region: by region, usage lines are split by the usage records billed on those invoices (their
unrounded amounts, rounded per month and region), and what no record explains (reserved fees, usage
above a reservation, rounding) is one "unattributed" row, so the rows still add up to the charges.
Amounts never mix currencies: every row and total is per currency.

**GPU-hours** per month: *capacity* is the fleet's GPUs times the hours each was in the fleet that
month (from its node's registration to its removal, never past now); *used* is the wall-clock
GPU-hours of allocations (a fraction of a GPU counts as that fraction); *billed* adds the minimum
billable top-ups; *busy* weighs used time by the GPU utilisation telemetry reported for it (busy %
is over the used time that has telemetry). Utilisation is used / capacity and idle is capacity -
used: the capacity that cost money and earned none.

**Receivables**: finalized, unpaid invoices, what is still owed on each (total less credit notes),
by tenant and by age past the due date (not yet due, 1-30, 31-60, 61-90, over 90 days).

CSV exports of the three: ``metering.reports_csv``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from decimal import Decimal

from django.db.models import (
    Case,
    Count,
    DecimalField,
    F,
    FloatField,
    IntegerField,
    OuterRef,
    Q,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Cast, Coalesce
from django.utils import timezone

from metering.models import CreditNote, Invoice, InvoiceLine, InvoiceStatus, LineKind, UsageRecord
from metering.money import HOUR, ZERO, quantize_money
from metering.periods import next_period, period_bounds
from nodes.models import Gpu, GpuModel, Region
from scheduling.models import MILLI, Plan

GROUPS = {
    "month": "Month",
    "tenant": "Tenant",
    "model": "GPU model",
    "plan": "Plan",
    "region": "Region",
}
GPU_HOUR_GROUPS = {"fleet": "Whole fleet", "model": "GPU model", "region": "Region"}
REVENUE_STATUSES = (InvoiceStatus.FINALIZED, InvoiceStatus.PAID)
UNATTRIBUTED = "unattributed"
UNATTRIBUTED_LABEL = "Not by region (reserved fees, usage above reservations, rounding)"
PLAN_LABELS = dict(Plan.choices)
MAX_MONTHS = 36


def months_between(first: date, last: date) -> list[date]:
    """Month starts from ``first`` to ``last`` inclusive."""
    out, p = [], first
    while p <= last:
        out.append(p)
        p = next_period(p)
    return out


# --- revenue -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RevenueRow:
    month: date
    currency: str
    key: str
    label: str
    amount: Decimal
    gpu_hours: Decimal | None  # None by region: see _revenue_by_region


@dataclass(frozen=True)
class MonthTotal:
    month: date
    currency: str
    invoices: int
    charges: Decimal
    credits: Decimal
    tax: Decimal
    total: Decimal
    credit_notes: Decimal

    @property
    def net(self) -> Decimal:
        """Revenue after credits applied and credit notes, before tax."""
        return self.charges - self.credits - self.credit_notes


@dataclass
class RevenueReport:
    months: list[date]
    group_by: str
    statuses: tuple[str, ...]
    rows: list[RevenueRow] = field(default_factory=list)
    totals: list[MonthTotal] = field(default_factory=list)

    @property
    def currencies(self) -> list[str]:
        return sorted({t.currency for t in self.totals})

    def charges_by_month(self, currency: str) -> dict[date, Decimal]:
        return {t.month: t.charges for t in self.totals if t.currency == currency}


def _line_group(group_by: str) -> tuple[list[str], Callable]:
    """The values() fields of a line grouping and how a row names its key and label."""
    if group_by == "tenant":
        return ["invoice__tenant_id", "invoice__tenant__name"], lambda r: (
            str(r["invoice__tenant_id"]),
            r["invoice__tenant__name"],
        )
    if group_by == "model":
        return ["gpu_model_id", "gpu_model__name"], lambda r: (
            str(r["gpu_model_id"] or ""),
            r["gpu_model__name"] or "No GPU model",
        )
    if group_by == "plan":
        return ["plan"], lambda r: (r["plan"] or "", PLAN_LABELS.get(r["plan"], r["plan"] or "No plan"))
    return [], lambda r: ("all", "All charges")


def revenue_report(
    *, first: date, last: date, group_by: str = "month", statuses=REVENUE_STATUSES
) -> RevenueReport:
    if group_by not in GROUPS:
        raise ValueError(f"group_by: one of {', '.join(GROUPS)}")
    statuses = tuple(statuses)
    report = RevenueReport(months=months_between(first, last), group_by=group_by, statuses=statuses)
    invoices = Invoice.objects.filter(period_start__gte=first, period_start__lte=last, status__in=statuses)
    charge = ~Q(kind__in=[LineKind.CREDIT, LineKind.TAX])

    # Month totals: one query over invoices, one over their lines (charges), one over credit notes.
    charges = {
        (r["invoice__period_start"], r["invoice__currency"]): r["s"]
        for r in InvoiceLine.objects.filter(charge, invoice__in=invoices)
        .values("invoice__period_start", "invoice__currency")
        .annotate(s=Sum("amount"))
        .order_by()
    }
    notes = {
        (r["invoice__period_start"], r["invoice__currency"]): r["s"]
        for r in CreditNote.objects.filter(invoice__in=invoices)
        .values("invoice__period_start", "invoice__currency")
        .annotate(s=Sum("amount"))
        .order_by()
    }
    for r in (
        invoices.values("period_start", "currency")
        .annotate(n=Count("id"), credits=Sum("credits"), tax=Sum("tax"), total=Sum("total"))
        .order_by("period_start", "currency")
    ):
        k = (r["period_start"], r["currency"])
        report.totals.append(
            MonthTotal(
                month=r["period_start"],
                currency=r["currency"],
                invoices=r["n"],
                charges=charges.get(k, ZERO),
                credits=r["credits"] or ZERO,
                tax=r["tax"] or ZERO,
                total=r["total"] or ZERO,
                credit_notes=notes.get(k, ZERO),
            )
        )

    if group_by == "region":
        report.rows = _revenue_by_region(invoices, report.totals)
        return report
    fields, name = _line_group(group_by)
    rows = (
        InvoiceLine.objects.filter(charge, invoice__in=invoices)
        .values("invoice__period_start", "invoice__currency", *fields)
        .annotate(s=Sum("amount"), h=Sum("quantity", filter=Q(unit="gpu-hour")))
        .order_by()
    )
    for r in rows:
        key, label = name(r)
        report.rows.append(
            RevenueRow(
                month=r["invoice__period_start"],
                currency=r["invoice__currency"],
                key=key,
                label=label,
                amount=r["s"] or ZERO,
                gpu_hours=r["h"] or ZERO,
            )
        )
    report.rows.sort(key=lambda r: (r.month, r.currency, -r.amount, r.label))
    return report


def _revenue_by_region(invoices, totals: list[MonthTotal]) -> list[RevenueRow]:
    """Usage amounts by region, summed per invoice in one scan without joins, then folded by the
    invoice's month and currency (one row per invoice and region, not per record)."""
    meta = {pk: (month, cur) for pk, month, cur in invoices.values_list("pk", "period_start", "currency")}
    codes = dict(Region.objects.values_list("pk", "code"))
    unrounded: dict[tuple[date, str, str], Decimal] = defaultdict(lambda: ZERO)
    for r in (
        UsageRecord.objects.filter(invoice__in=invoices)
        .values("invoice_id", "region_id")
        .annotate(s=Sum("amount"))
        .order_by()
    ):
        month, cur = meta[r["invoice_id"]]
        unrounded[(month, cur, codes.get(r["region_id"], ""))] += r["s"] or ZERO
    out: list[RevenueRow] = []
    attributed: dict[tuple[date, str], Decimal] = defaultdict(lambda: ZERO)
    for (month, cur, code), total in unrounded.items():
        amount = quantize_money(total, cur)
        attributed[(month, cur)] += amount
        out.append(RevenueRow(month=month, currency=cur, key=code, label=code, amount=amount, gpu_hours=None))
    for t in totals:
        rest = t.charges - attributed[(t.month, t.currency)]
        if rest:
            out.append(
                RevenueRow(
                    month=t.month,
                    currency=t.currency,
                    key=UNATTRIBUTED,
                    label=UNATTRIBUTED_LABEL,
                    amount=rest,
                    gpu_hours=None,
                )
            )
    out.sort(key=lambda r: (r.month, r.currency, r.key == UNATTRIBUTED, -r.amount, r.label))
    return out


# --- billed versus used GPU-hours ------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuHoursRow:
    month: date
    key: str
    label: str
    capacity_h: Decimal
    used_h: Decimal
    billed_h: Decimal
    busy_h: Decimal | None  # None: no telemetry for any of it
    metered_h: Decimal = ZERO  # the used GPU-hours that telemetry covers (busy_pct's base)

    @property
    def idle_h(self) -> Decimal:
        return max(self.capacity_h - self.used_h, ZERO)

    @property
    def utilisation_pct(self) -> Decimal | None:
        return None if not self.capacity_h else self.used_h * 100 / self.capacity_h

    @property
    def busy_pct(self) -> Decimal | None:
        return None if self.busy_h is None or not self.metered_h else self.busy_h * 100 / self.metered_h


def _hours(seconds: Decimal | float | int | None) -> Decimal:
    return ZERO if not seconds else Decimal(str(seconds)) / HOUR


def gpu_hours_report(
    *, first: date, last: date, group_by: str = "fleet", now: datetime | None = None
) -> list[GpuHoursRow]:
    if group_by not in GPU_HOUR_GROUPS:
        raise ValueError(f"group_by: one of {', '.join(GPU_HOUR_GROUPS)}")
    now = now or timezone.now()
    months = months_between(first, last)
    range_start, _ = period_bounds(first)
    _, range_end = period_bounds(last)
    # Usage: one scan, grouped by ids (names come from the small catalog tables). Only cheap sums run
    # on every record; the minimum-billing top-ups (few records) are taken back out of them:
    # gpu_seconds = (seconds + top-up) x fraction exactly, so used = gpu_seconds - top-up x fraction.
    usage_key = {"fleet": [], "model": ["gpu_model_id"], "region": ["region_id"]}[group_by]
    telemetry = Q(avg_util_pct__isnull=False)
    topped = Q(minimum_topup_s__gt=0)
    topup = F("minimum_topup_s") * F("fraction_milli")
    usage = (
        UsageRecord.objects.filter(period_start__gte=first, period_start__lte=last)
        .values("period_start", *usage_key)
        .annotate(
            billed=Sum("gpu_seconds"),
            billed_metered=Sum("gpu_seconds", filter=telemetry),
            busy_billed=Sum(Cast("gpu_seconds", FloatField()) * F("avg_util_pct"), output_field=FloatField()),
            topup=Sum(topup, filter=topped, output_field=DecimalField()),
            topup_metered=Sum(topup, filter=topped & telemetry, output_field=DecimalField()),
            topup_busy=Sum(
                Cast("minimum_topup_s", FloatField()) * F("fraction_milli") * F("avg_util_pct"),
                filter=topped,
                output_field=FloatField(),
            ),
        )
        .order_by()
    )
    model_names = dict(GpuModel.objects.values_list("pk", "name"))
    region_codes = dict(Region.objects.values_list("pk", "code"))

    def key_of(model_id, region_id):
        if group_by == "model":
            return str(model_id or ""), model_names.get(model_id) or "Unknown model"
        if group_by == "region":
            code = region_codes.get(region_id, "")
            return code, code
        return "fleet", "Whole fleet"

    cells: dict[tuple[date, str], dict] = {}
    labels: dict[str, str] = {}

    def cell(month: date, key: str) -> dict:
        return cells.setdefault(
            (month, key), {"capacity": ZERO, "used": ZERO, "billed": ZERO, "busy": None, "metered": ZERO}
        )

    for r in usage:
        key, label = key_of(r.get("gpu_model_id"), r.get("region_id"))
        labels[key] = label
        c = cell(r["period_start"], key)
        billed = r["billed"] or ZERO
        c["billed"] += _hours(billed)
        c["used"] += _hours(billed - (r["topup"] or ZERO) / MILLI)
        if r["billed_metered"] is not None:
            metered = r["billed_metered"] - (r["topup_metered"] or ZERO) / MILLI
            busy = Decimal(str(r["busy_billed"] or 0)) - Decimal(str(r["topup_busy"] or 0)) / MILLI
            c["busy"] = (c["busy"] or ZERO) + _hours(busy / 100)
            c["metered"] += _hours(metered)

    # Capacity: GPUs grouped by what decides their hours (model, region, in-service span), so the
    # rows are about one per node, not one per GPU.
    gpus = (
        Gpu.objects.filter(node__registered_at__lt=min(range_end, now))
        .filter(Q(removed_at__isnull=True) | Q(removed_at__gt=range_start))
        .values("model_id", "node__region_id", "node__registered_at", "removed_at")
        .annotate(n=Count("id"))
        .order_by()
    )
    for g in gpus:
        key, label = key_of(g["model_id"], g["node__region_id"])
        labels[key] = label
        for month in months:
            m_start, m_end = period_bounds(month)
            start = max(m_start, g["node__registered_at"])
            end = min(m_end, now, g["removed_at"] or m_end)
            if end > start:
                seconds = Decimal((end - start) // timedelta(microseconds=1)) / Decimal(1_000_000)
                cell(month, key)["capacity"] += _hours(seconds * g["n"])

    rows = [
        GpuHoursRow(
            month=month,
            key=key,
            label=labels[key],
            capacity_h=c["capacity"],
            used_h=c["used"],
            billed_h=c["billed"],
            busy_h=c["busy"],
            metered_h=c["metered"],
        )
        for (month, key), c in cells.items()
    ]
    rows.sort(key=lambda r: (r.month, r.label))
    return rows


# --- receivables ---------------------------------------------------------------------------------------

AGE_BUCKETS = [
    ("current", "Not yet due"),
    ("1-30", "1-30 days overdue"),
    ("31-60", "31-60 days overdue"),
    ("61-90", "61-90 days overdue"),
    ("90+", "Over 90 days overdue"),
]


@dataclass
class ReceivableRow:
    tenant_id: int
    tenant: str
    currency: str
    invoices: int = 0
    buckets: dict[str, Decimal] = field(default_factory=lambda: {k: ZERO for k, _ in AGE_BUCKETS})

    @property
    def outstanding(self) -> Decimal:
        return sum(self.buckets.values(), ZERO)

    @property
    def overdue(self) -> Decimal:
        return self.outstanding - self.buckets["current"]


@dataclass
class ReceivablesReport:
    at: datetime
    rows: list[ReceivableRow]
    oldest: list[Invoice]

    def totals(self) -> dict[str, dict[str, Decimal]]:
        """Per currency: each bucket, ``outstanding`` and ``overdue``."""
        out: dict[str, dict[str, Decimal]] = {}
        for r in self.rows:
            t = out.setdefault(r.currency, {k: ZERO for k, _ in AGE_BUCKETS} | {"outstanding": ZERO})
            for k, v in r.buckets.items():
                t[k] += v
            t["outstanding"] += r.outstanding
        for t in out.values():
            t["overdue"] = t["outstanding"] - t["current"]
        return out


def _age_bucket(now: datetime):
    day = timedelta(days=1)
    return Case(
        When(Q(due_at__isnull=True) | Q(due_at__gte=now), then=Value(0)),
        When(due_at__gte=now - 30 * day, then=Value(1)),
        When(due_at__gte=now - 60 * day, then=Value(2)),
        When(due_at__gte=now - 90 * day, then=Value(3)),
        default=Value(4),
        output_field=IntegerField(),
    )


def receivables_report(*, now: datetime | None = None, oldest: int = 20) -> ReceivablesReport:
    now = now or timezone.now()
    notes = (
        CreditNote.objects.filter(invoice=OuterRef("pk"))
        .values("invoice")
        .annotate(s=Sum("amount"))
        .values("s")
    )
    open_invoices = Invoice.objects.filter(status=InvoiceStatus.FINALIZED).annotate(
        owed=F("total")
        - Coalesce(Subquery(notes, output_field=DecimalField()), Value(ZERO), output_field=DecimalField()),
        bucket=_age_bucket(now),
    )
    rows: dict[tuple[int, str], ReceivableRow] = {}
    for r in (
        open_invoices.values("tenant_id", "tenant__name", "currency", "bucket")
        .annotate(s=Sum("owed"), n=Count("id"))
        .order_by()
    ):
        row = rows.setdefault(
            (r["tenant_id"], r["currency"]),
            ReceivableRow(tenant_id=r["tenant_id"], tenant=r["tenant__name"], currency=r["currency"]),
        )
        row.buckets[AGE_BUCKETS[r["bucket"]][0]] += r["s"] or ZERO
        row.invoices += r["n"]
    oldest_rows = list(
        open_invoices.filter(due_at__lt=now).select_related("tenant").order_by("due_at", "pk")[:oldest]
    )
    ordered = sorted(rows.values(), key=lambda r: (-r.overdue, -r.outstanding, r.tenant))
    return ReceivablesReport(at=now, rows=ordered, oldest=oldest_rows)
