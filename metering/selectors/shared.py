"""Reads shared by the API, the admission checks and the price provider."""

from __future__ import annotations

import csv
import io
from datetime import datetime
from decimal import Decimal

from django.utils import timezone

from metering.models import Invoice
from metering.money import ZERO
from metering.services.rates import billing_account_for, current_price_table, discounted, rate_card_for_tenant
from nodes.models import Region
from scheduling.models import MILLI, Plan


def month_cost_to_date(*, tenant, now: datetime | None = None) -> Decimal:
    """Unrounded cost of the current month so far: recorded usage plus what running allocations
    have accrued, priced as their records will be (``services.usage.costs_to_date``)."""
    from metering.services.usage import costs_to_date

    tenant_id = getattr(tenant, "pk", tenant)
    return costs_to_date(tenant_ids=[tenant_id], now=now)[tenant_id]


def hourly_estimate(
    *,
    tenant,
    gpu_models,
    gpu_count: int,
    fraction_milli: int,
    cpu_millicores: int = 0,
    ram_mib: int = 0,
    regions=None,
) -> dict[str, Decimal | None]:
    """Price of one hour of a workload spec per plan: the dearest of the candidate models and of
    ``regions`` (None: every region that has the model; the scheduler may place it in any), after the
    tenant's discount, with vCPU and RAM where the rate card prices them. Spot is the region's market
    price where there is one, as usage is billed (``services.usage``). None: no price for that plan.
    The launch form shows the same figure (the price provider's ``estimate``)."""
    from metering.services.spot import current_spot_prices

    gpus = Decimal(gpu_count) * Decimal(fraction_milli) / MILLI
    out: dict[str, Decimal | None] = {}
    discount = billing_account_for(tenant=tenant).discount_percent
    gpu_models = list(gpu_models)
    listed = current_price_table(gpu_models=gpu_models, tenant=tenant)
    where = {
        m.pk: list(regions if regions is not None else Region.objects.filter(nodes__gpus__model=m).distinct())
        for m in gpu_models
    }
    market = current_spot_prices(pairs=[(m, r) for m in gpu_models for r in where[m.pk]])
    per_model = []
    for m in gpu_models:
        prices = listed[m.pk]
        spots = []
        for region in where[m.pk]:
            price = market.get((m.pk, region.pk))
            spots.append(discounted(price, discount) if price is not None else prices.get("spot"))
        if spots:
            prices["spot"] = None if any(s is None for s in spots) else max(spots)
        per_model.append(prices)
    extra = ZERO
    card = rate_card_for_tenant(tenant=tenant)
    if card is not None:
        now = timezone.now()
        version = card.versions.filter(effective_from__lte=now).order_by("-effective_from").first()
        if version is not None and (version.effective_to is None or version.effective_to > now):
            if version.vcpu_hour_price is not None:
                extra += Decimal(cpu_millicores) / 1000 * discounted(version.vcpu_hour_price, discount)
            if version.ram_gib_hour_price is not None:
                extra += Decimal(ram_mib) / 1024 * discounted(version.ram_gib_hour_price, discount)
    for plan in Plan.values:
        prices = [p.get(plan) for p in per_model]
        if not prices or any(p is None for p in prices):
            out[plan] = None
            continue
        out[plan] = max(prices) * gpus + (extra if plan != Plan.RESERVED else ZERO)
    return out


def invoice_csv(*, invoice: Invoice) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["invoice", invoice.pk, "period", f"{invoice.period_start:%Y-%m}", "status", invoice.status])
    w.writerow(
        [
            "position",
            "kind",
            "description",
            "original_period",
            "quantity",
            "unit",
            "unit_price",
            "amount",
            "currency",
        ]
    )
    for ln in invoice.lines.all():
        w.writerow(
            [
                ln.position,
                ln.kind,
                ln.description,
                f"{ln.original_period:%Y-%m}" if ln.original_period else "",
                ln.quantity.normalize() if ln.quantity else "0",
                ln.unit,
                "" if ln.unit_price is None else ln.unit_price.normalize(),
                ln.amount,
                invoice.currency,
            ]
        )
    w.writerow(["", "subtotal", "", "", "", "", "", invoice.subtotal, invoice.currency])
    w.writerow(["", "credits", "", "", "", "", "", -invoice.credits, invoice.currency])
    w.writerow(["", "tax", "", "", "", "", "", invoice.tax, invoice.currency])
    w.writerow(["", "total", "", "", "", "", "", invoice.total, invoice.currency])
    return buf.getvalue()
