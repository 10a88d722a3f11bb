"""Reads for the tenant's billing pages (``metering.views_billing``): a month of usage by UTC day and
GPU model, credit balances, and the quote of a reservation.

Usage records are cut at month and price-version boundaries only, so one record may span many days.
:func:`usage_by_day` shares each record's GPU-seconds and amount among the UTC days it covers in
proportion to its wall-clock time on each (a minimum-billing top-up counts on its last day, as it
was added to its last piece), and gives the last day what is left, so the days of a record add up to
the record exactly and the month's totals equal the sums of its records.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db.models import Q, Sum
from django.utils import timezone

from metering.models import CreditEntry, GpuPrice, UsageRecord
from metering.money import HOUR, ZERO, quantize_money
from metering.periods import days_in_period, period_bounds
from metering.services.invoice_build import HOURS_PER_MONTH, term_discount_percent
from metering.services.rates import current_prices, discounted, rate_card_for_tenant
from nodes.models import GpuModel
from scheduling.models import Plan

DAY = timedelta(days=1)


@dataclass
class ModelUsage:
    gpu_seconds: Decimal = ZERO
    amount: Decimal = ZERO

    @property
    def gpu_hours(self) -> Decimal:
        return self.gpu_seconds / HOUR


@dataclass
class MonthUsage:
    """``cells[(day, gpu_model_id)]``: what a model used on a UTC day of the month."""

    period_start: date
    days: list[date]
    models: dict[int, str]  # id -> name, ordered by the month's amount (dearest first)
    cells: dict[tuple[date, int], ModelUsage] = field(default_factory=dict)
    by_model: dict[int, ModelUsage] = field(default_factory=dict)
    records: int = 0
    memory_gib_seconds: Decimal = ZERO  # GPU memory held, all models (its own invoice line)
    memory_amount: Decimal = ZERO

    @property
    def memory_gib_hours(self) -> Decimal:
        return self.memory_gib_seconds / HOUR

    @property
    def total(self) -> ModelUsage:
        return ModelUsage(
            gpu_seconds=sum((m.gpu_seconds for m in self.by_model.values()), ZERO),
            amount=sum((m.amount for m in self.by_model.values()), ZERO),
        )


def _seconds(delta: timedelta) -> Decimal:
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / Decimal(1_000_000)


def _day_start(at: datetime) -> datetime:
    at = at.astimezone(UTC)
    return datetime(at.year, at.month, at.day, tzinfo=UTC)


def usage_by_day(*, tenant, period_start: date) -> MonthUsage:
    """A tenant's usage records of one billing month, by UTC day and GPU model (two queries), and
    the month's GPU memory (GiB-hours and amount; included in the models' amounts too)."""
    rows = (
        UsageRecord.objects.filter(tenant=tenant, period_start=period_start)
        .order_by()
        .values_list(
            "gpu_model_id",
            "start",
            "end",
            "seconds",
            "minimum_topup_s",
            "gpu_seconds",
            "amount",
            "gpu_memory_gib_seconds",
            "gpu_memory_amount",
        )
    )
    memory_s, memory_amount = ZERO, ZERO
    cells: dict[tuple[date, int], ModelUsage] = defaultdict(ModelUsage)
    by_model: dict[int, ModelUsage] = defaultdict(ModelUsage)
    count = 0
    for model_id, start, end, seconds, topup, gpu_seconds, amount, mem_s, mem_a in rows.iterator(
        chunk_size=5000
    ):
        count += 1
        memory_s += mem_s
        memory_amount += mem_a
        by_model[model_id].gpu_seconds += gpu_seconds
        by_model[model_id].amount += amount
        first = _day_start(start)
        if first + DAY >= end:  # the common case: the record lies within one day
            cell = cells[(first.date(), model_id)]
            cell.gpu_seconds += gpu_seconds
            cell.amount += amount
            continue
        weight = seconds + topup
        left_s, left_a = gpu_seconds, amount
        day = first
        while day < end:
            nxt = day + DAY
            cell = cells[(day.date(), model_id)]
            if nxt >= end or weight <= 0:
                cell.gpu_seconds += left_s
                cell.amount += left_a
                break
            share = _seconds(min(nxt, end) - max(day, start)) / weight
            part_s, part_a = gpu_seconds * share, amount * share
            cell.gpu_seconds += part_s
            cell.amount += part_a
            left_s -= part_s
            left_a -= part_a
            day = nxt
    names = dict(GpuModel.objects.filter(pk__in=list(by_model)).values_list("pk", "name"))
    order = sorted(by_model, key=lambda m: (-by_model[m].amount, names.get(m, "")))
    start_dt, _ = period_bounds(period_start)
    return MonthUsage(
        period_start=period_start,
        days=[(start_dt + DAY * i).date() for i in range(days_in_period(period_start))],
        models={m: names.get(m, f"model {m}") for m in order},
        cells=dict(cells),
        by_model={m: by_model[m] for m in order},
        records=count,
        memory_gib_seconds=memory_s,
        memory_amount=memory_amount,
    )


def usage_months(*, tenant) -> list[date]:
    """The billing months the tenant has usage in, newest first."""
    return list(
        UsageRecord.objects.filter(tenant=tenant)
        .order_by("-period_start")
        .values_list("period_start", flat=True)
        .distinct()
    )


def credit_balances(*, tenant) -> dict[str, Decimal]:
    """Balance per credit kind (grants less what invoices used), in one query."""
    return {
        row["kind"]: row["s"] or ZERO
        for row in CreditEntry.objects.filter(tenant=tenant)
        .order_by()
        .values("kind")
        .annotate(s=Sum("amount"))
    }


# --- reservation quotes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReservationQuote:
    """What a reservation of ``count`` GPUs for ``term`` months costs, priced as the invoice will
    price its fee (``services.invoice_build``: the reserved hourly price after the tenant's
    discount, times 730 hours, less the term's discount), against the same GPUs on demand around
    the clock."""

    currency: str
    count: int
    term: int
    reserved_hourly: Decimal  # per GPU, after the tenant's discount
    term_discount: Decimal  # percent
    monthly_per_gpu: Decimal
    on_demand_hourly: Decimal | None
    monthly_fee: Decimal
    total: Decimal
    on_demand_monthly: Decimal | None
    on_demand_total: Decimal | None

    @property
    def saving(self) -> Decimal | None:
        return None if self.on_demand_total is None else self.on_demand_total - self.total

    @property
    def saving_percent(self) -> Decimal | None:
        if not self.on_demand_total:
            return None
        return (self.saving * 100 / self.on_demand_total).quantize(Decimal("0.1"))

    def money(self, value: Decimal | None) -> Decimal | None:
        return None if value is None else quantize_money(value, self.currency)


def reservation_quote(*, tenant, gpu_model: GpuModel, count: int, term: int, currency: str, region=None):
    """The quote in ``region`` (its own prices where the card has them, as the fee will be billed),
    or None when the rate card has no reserved price for the model."""
    prices = current_prices(gpu_model=gpu_model, tenant=tenant, region=region)
    hourly = prices.get(Plan.RESERVED)
    if hourly is None:
        return None
    term_disc = term_discount_percent(term)
    monthly_per_gpu = discounted(hourly * HOURS_PER_MONTH, term_disc)
    monthly = monthly_per_gpu * count
    od = prices.get(Plan.ON_DEMAND)
    od_monthly = None if od is None else od * HOURS_PER_MONTH * count
    return ReservationQuote(
        currency=currency,
        count=count,
        term=term,
        reserved_hourly=hourly,
        term_discount=term_disc,
        monthly_per_gpu=monthly_per_gpu,
        on_demand_hourly=od,
        monthly_fee=monthly,
        total=monthly * term,
        on_demand_monthly=od_monthly,
        on_demand_total=None if od_monthly is None else od_monthly * term,
    )


def reservable_models(*, tenant) -> list[GpuModel]:
    """The GPU models the tenant's rate card has a reserved price for now (one query after the card)."""
    card = rate_card_for_tenant(tenant=tenant)
    if card is None:
        return []
    now = timezone.now()
    return list(
        GpuModel.objects.filter(
            pk__in=GpuPrice.objects.filter(
                version__rate_card=card, version__effective_from__lte=now, plan=Plan.RESERVED
            )
            .filter(Q(version__effective_to__isnull=True) | Q(version__effective_to__gt=now))
            .values("gpu_model_id")
        ).order_by("vendor", "-memory_gib", "name")
    )


def reservation_terms() -> list[int]:
    """The standard terms, in months (the keys of ``METERING_RESERVED_TERM_DISCOUNTS``)."""
    return sorted(int(k) for k in settings.METERING_RESERVED_TERM_DISCOUNTS)
