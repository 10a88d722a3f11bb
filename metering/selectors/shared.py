"""Reads shared by the API, the admission checks and the price provider."""

from __future__ import annotations

import csv
import io
from datetime import datetime
from decimal import Decimal

from metering.models import Invoice
from metering.money import ZERO
from metering.services.rates import billing_account_for, current_price_table, current_version, discounted
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
    priced_only: bool = False,
) -> dict[str, Decimal | None]:
    """Price of one hour of a workload spec per plan: the dearest of the candidate models and of
    ``regions`` (None: every region that has the model; the scheduler may place it in any), each
    region at its own price where the card has one, after the tenant's discount, with GPU memory
    (the share of the model's memory held), vCPU and RAM where the rate card prices them. Spot is
    the region's market price where there is one, as usage is billed (``services.usage``). None: no
    price for that plan (for some candidate; with ``priced_only``, for every candidate: a model
    without a price bills nothing, so the dearest priced one is what the request may cost). The
    launch form shows the same figure (the price provider's ``estimate``)."""
    from metering.services.spot import current_spot_prices

    gpus = Decimal(gpu_count) * Decimal(fraction_milli) / MILLI
    out: dict[str, Decimal | None] = {}
    discount = billing_account_for(tenant=tenant).discount_percent
    gpu_models = list(gpu_models)
    where = {
        m.pk: list(regions if regions is not None else Region.objects.filter(nodes__gpus__model=m).distinct())
        for m in gpu_models
    }
    all_regions = {None} | {r for rs in where.values() for r in rs}
    listed = current_price_table(gpu_models=gpu_models, tenant=tenant, regions=all_regions)
    market = current_spot_prices(pairs=[(m, r) for m in gpu_models for r in where[m.pk]])
    version = current_version(tenant=tenant)
    memory_price = None
    extra = ZERO
    if version is not None:
        memory_price = discounted(version.gpu_memory_gib_hour_price, discount)
        if version.vcpu_hour_price is not None:
            extra += Decimal(cpu_millicores) / 1000 * discounted(version.vcpu_hour_price, discount)
        if version.ram_gib_hour_price is not None:
            extra += Decimal(ram_mib) / 1024 * discounted(version.ram_gib_hour_price, discount)
    per_model = []
    for m in gpu_models:
        memory = Decimal(m.memory_gib) * memory_price if memory_price is not None else ZERO
        prices: dict[str, Decimal | None] = {}
        for plan in Plan.values:
            found = []
            for region in where[m.pk] or [None]:
                price = listed[(m.pk, getattr(region, "pk", None))][plan]
                if plan == Plan.SPOT and region is not None:
                    spot = market.get((m.pk, region.pk))
                    price = discounted(spot, discount) if spot is not None else price
                found.append(price)
            held = memory if plan != Plan.RESERVED else ZERO  # reserved usage: covered by the fee
            prices[plan] = None if any(p is None for p in found) else max(found) + held
        per_model.append(prices)
    for plan in Plan.values:
        prices = [p.get(plan) for p in per_model]
        if priced_only:
            prices = [p for p in prices if p is not None]
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
