"""Demo data of metering for ``make run`` (``manage.py seed_demo``), idempotent: a default rate card
priced for every model of the demo fleet (Tokyo dearer than the rest, GPU memory and volume
storage priced too), so the launch page shows prices, and the demo tenant's first invoice: last
month's, for a one-month reservation it held, with its welcome credit applied.

History is written here directly (a reservation in the past, confirmed): the services refuse to
make the past, which is right for people and wrong for a demo that needs a month behind it."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from django.db import transaction
from django.utils import timezone

from metering.models import CreditEntry, CreditKind, Invoice, InvoiceStatus, RateCard
from metering.periods import period_bounds, period_of, previous_period
from metering.services.invoices import credit_grant, invoice_build, invoice_finalize
from metering.services.rates import rate_card_version_create
from nodes.models import GpuModel, Region
from portal.actors import Actor
from scheduling.models import Plan, Reservation, ReservationStatus

DEMO_CARD = "Standard"
# On-demand USD per GPU-hour of the demo fleet's models; spot is 40 % of it, reserved 70 %.
DEMO_PRICES = {
    "NVIDIA H200 SXM 141GB": "4.50",
    "NVIDIA H100 SXM 80GB": "3.00",
    "NVIDIA H100 PCIe 80GB": "2.40",
    "NVIDIA A100 SXM 80GB": "1.80",
    "NVIDIA A100 SXM 40GB": "1.40",
    "NVIDIA L40S": "1.10",
    "NVIDIA L4": "0.50",
    "NVIDIA T4": "0.30",
    "NVIDIA A10": "0.60",
    "NVIDIA V100 SXM2 32GB": "0.80",
    "AMD Instinct MI300X": "3.20",
    "AMD Instinct MI250": "1.60",
}
PLAN_SHARE = {Plan.ON_DEMAND: Decimal(1), Plan.SPOT: Decimal("0.4"), Plan.RESERVED: Decimal("0.7")}
# Power and space cost more in Tokyo: every price there is 10 % higher.
REGION_MARKUP = {"ap-northeast-1": Decimal("1.10")}
GPU_MEMORY_GIB_HOUR = "0.002"
STORAGE_GIB_HOUR = "0.0001"
WELCOME_CREDIT = "100.00"


def rate_card_demo_seed(*, now=None) -> RateCard | None:
    """The default card, from the first of last month (so last month's invoice is priced), unless a
    default card exists already. None when the catalog is not seeded yet."""
    now = now or timezone.now()
    existing = RateCard.objects.filter(is_default=True).first()
    if existing is not None:
        return existing
    models = {m.name: m for m in GpuModel.objects.filter(name__in=DEMO_PRICES)}
    if not models:
        return None
    regions = {r.code: r for r in Region.objects.filter(code__in=REGION_MARKUP)}
    prices: dict[tuple, Decimal] = {}
    for name, model in models.items():
        base = Decimal(DEMO_PRICES[name])
        for plan, share in PLAN_SHARE.items():
            prices[(model.pk, plan)] = (base * share).quantize(Decimal("0.0001"))
            for code, markup in REGION_MARKUP.items():
                if code in regions:
                    prices[(model.pk, plan, regions[code].pk)] = (base * share * markup).quantize(
                        Decimal("0.0001")
                    )
    card = RateCard.objects.create(name=DEMO_CARD, currency="USD", is_default=True)
    start, _ = period_bounds(previous_period(period_of(now)))
    rate_card_version_create(
        rate_card=card,
        effective_from=start,
        gpu_prices=prices,
        gpu_memory_gib_hour_price=GPU_MEMORY_GIB_HOUR,
        storage_gib_hour_price=STORAGE_GIB_HOUR,
        allow_past=True,
        now=now,
    )
    return card


def first_invoice_demo_seed(*, tenant, now=None) -> Invoice | None:
    """Last month's invoice of the demo tenant: a one-month reservation of two H100s that ran the
    whole month, and a welcome credit; finalized. Left alone once it exists."""
    now = now or timezone.now()
    period = previous_period(period_of(now))
    if Invoice.objects.filter(tenant=tenant, period_start=period).exists():
        return None
    model = GpuModel.objects.filter(name="NVIDIA H100 SXM 80GB").first()
    region = Region.objects.filter(code="us-east-1").first()
    if model is None or region is None or RateCard.objects.filter(is_default=True).first() is None:
        return None
    start, end = period_bounds(period)
    system = Actor.system()
    Reservation.objects.get_or_create(
        tenant=tenant,
        gpu_model=model,
        region=region,
        starts_at=start,
        ends_at=end,
        defaults={
            "count": 2,
            "status": ReservationStatus.ACTIVE,
            "activated_at": start - timedelta(days=2),
            "created_at": start - timedelta(days=3),
            "note": "demo: last month's training run",
        },
    )
    if not CreditEntry.objects.filter(tenant=tenant, kind=CreditKind.PROMOTIONAL).exists():
        credit_grant(
            tenant=tenant, kind=CreditKind.PROMOTIONAL, amount=WELCOME_CREDIT, note="Welcome", actor=system
        )
    invoice = invoice_build(tenant=tenant, period_start=period, now=now)
    if invoice.status == InvoiceStatus.DRAFT:
        invoice = invoice_finalize(invoice=invoice, actor=system, now=now)
    return invoice


@transaction.atomic
def on_seed_demo_requested(sender, tenant=None, stdout=None, **kwargs) -> None:
    card = rate_card_demo_seed()
    invoice = first_invoice_demo_seed(tenant=tenant) if tenant is not None else None
    if stdout is not None:
        if card is not None:
            stdout.write(f"Rate card: {card.name} (default).")
        if invoice is not None:
            stdout.write(f"First invoice: {invoice.period_start:%Y-%m}, {invoice.total} {invoice.currency}.")
