"""A whole month scripted end to end, and its invoice checked against a total computed here, in
plain Decimal arithmetic from the rate card's figures: instances and jobs (on-demand, in two
regions at their own prices), spot, two workloads sharing a GPU with GPU memory priced per
GiB-hour, a reservation started and cancelled mid-month (its fee to the second and the cancellation
fee), the per-allocation minimum, the tenant's discount, credits and tax."""

import uuid
from datetime import date
from decimal import ROUND_HALF_UP, Decimal

import pytest
from django.test import override_settings

from metering.models import BillingAccount, CreditKind, Invoice, InvoiceStatus, LineKind, RateCard
from metering.services.invoices import credit_grant, invoice_finalize, invoice_run
from metering.services.rates import rate_card_version_create
from nodes.models import Gpu, Node, Region
from portal.actors import Actor
from scheduling.models import Allocation, Plan, Reservation, ReservationStatus, Workload
from scheduling.services.reservations import reservation_activate, reservation_cancel
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db
SYSTEM = Actor.system()
MARCH = date(2024, 3, 1)
D = Decimal

# The rate card, as a person would read it.
ON_DEMAND, ON_DEMAND_EU, SPOT, RESERVED = D("2.00"), D("2.60"), D("0.80"), D("1.50")
MEMORY_GIB_HOUR = D("0.01")
H100_GIB = 80
DISCOUNT, TAX, FEE_PERCENT, PROMO = D("10"), D("8"), D("10"), D("20.00")


def cents(x: Decimal) -> Decimal:
    return x.quantize(D("0.01"), rounding=ROUND_HALF_UP)


def off(price: Decimal) -> Decimal:
    return price * (100 - DISCOUNT) / 100


@pytest.fixture
def month(tenant, h100, region, node):
    eu = Region.objects.create(code="eu-west-1", name="EU West")
    eu_node = Node.objects.create(hostname="eu-0001", region=eu, cpu_cores=64, ram_mib=512 * 1024)
    for i in range(8):
        Gpu.objects.create(
            node=eu_node, index=i, uuid=f"GPU-{uuid.uuid4()}", model=h100, reported_name=h100.name
        )
    card = RateCard.objects.create(name="Standard", currency="USD", is_default=True)
    rate_card_version_create(
        rate_card=card,
        effective_from=utc(2020, 1, 1),
        gpu_prices={
            (h100.pk, Plan.ON_DEMAND): ON_DEMAND,
            (h100.pk, Plan.ON_DEMAND, eu.pk): ON_DEMAND_EU,
            (h100.pk, Plan.SPOT): SPOT,
            (h100.pk, Plan.RESERVED): RESERVED,
        },
        gpu_memory_gib_hour_price=MEMORY_GIB_HOUR,
        allow_past=True,
    )
    BillingAccount.objects.create(tenant=tenant, discount_percent=DISCOUNT, tax_rate_percent=TAX)
    return eu_node


@override_settings(RESERVATION_CANCEL_FEE_PERCENT=FEE_PERCENT, METERING_MINIMUM_BILLABLE_S=60)
def test_a_scripted_month_invoices_exactly_what_the_rate_card_says(tenant, h100, region, node, run, month):
    eu_node = month
    # An instance, on-demand, 60 h in us-east-1.
    inst = run(tenant, utc(2024, 3, 2), utc(2024, 3, 4, 12), gpu_index=0)
    Workload.objects.filter(pk=inst.workload_id).update(kind="instance")
    # A job, on-demand, 10 h in eu-west-1 (its own price).
    eu_job = run(tenant, utc(2024, 3, 5), utc(2024, 3, 5, 10), gpu_index=1)
    Allocation.objects.filter(pk=eu_job.pk).update(node=eu_node, gpu=eu_node.gpus.get(index=1))
    # Two jobs sharing one GPU, half each, 8 h.
    a = run(tenant, utc(2024, 3, 6), utc(2024, 3, 6, 8), gpu_index=2, fraction_milli=500)
    b = run(tenant, utc(2024, 3, 6), utc(2024, 3, 6, 8), gpu_index=2, fraction_milli=500)
    Allocation.objects.filter(pk=b.pk).update(milli_offset=500)
    assert a.gpu_id == b.gpu_id
    # A 30-second job: billed the minute.
    run(tenant, utc(2024, 3, 7), utc(2024, 3, 7, 0, 0, 30), gpu_index=3)
    # Spot, 5 h.
    run(tenant, utc(2024, 3, 8), utc(2024, 3, 8, 5), gpu_index=4, plan=Plan.SPOT)
    # A reservation of 2 GPUs for 3 months from 10 March, confirmed, used, cancelled on 20 March 06:00.
    r = Reservation.objects.create(
        tenant=tenant,
        gpu_model=h100,
        region=region,
        count=2,
        starts_at=utc(2024, 3, 10),
        ends_at=utc(2024, 6, 10),
        status=ReservationStatus.REQUESTED,
    )
    reservation_activate(reservation=r, actor=SYSTEM, now=utc(2024, 3, 1))
    run(tenant, utc(2024, 3, 11), utc(2024, 3, 12), gpu_index=5, plan=Plan.RESERVED, reservation=r)
    reservation_cancel(reservation=r, actor=SYSTEM, staff=True, now=utc(2024, 3, 20, 6))
    credit_grant(tenant=tenant, kind=CreditKind.PROMOTIONAL, amount=PROMO, actor=SYSTEM)

    invoice_run(period_start=MARCH, now=utc(2024, 4, 1, 0, 10))
    invoice = invoice_finalize(invoice=Invoice.objects.get(tenant=tenant, period_start=MARCH), actor=SYSTEM)

    # --- the same month, from the rate card, by hand ---
    gpu_hours_us = D(60) + D(8) * D("0.5") * 2 + D(60) / 3600  # instance, shared pair, the minute
    gpu_hours_eu = D(10)
    spot_hours = D(5)
    on_demand = cents(gpu_hours_us * off(ON_DEMAND) + gpu_hours_eu * off(ON_DEMAND_EU))
    spot = cents(spot_hours * off(SPOT))
    memory_gib_hours = (gpu_hours_us + gpu_hours_eu + spot_hours) * H100_GIB  # reserved work: in the fee
    memory = cents(memory_gib_hours * off(MEMORY_GIB_HOUR))
    monthly = off(RESERVED) * 730 * D("0.95")  # a 3-month term: 5 % off
    in_force_days = D("10.25")  # 10 March 00:00 to 20 March 06:00
    reserved_fee = cents(monthly * 2 * in_force_days / 31)
    rest_hours = D((utc(2024, 6, 10) - utc(2024, 3, 20, 6)).total_seconds()) / 3600
    cancel = cents(monthly / 730 * 2 * rest_hours * FEE_PERCENT / 100)
    subtotal = on_demand + spot + memory + reserved_fee + cancel
    tax = cents((subtotal - PROMO) * TAX / 100)
    total = subtotal - PROMO + tax

    lines = {ln.kind: ln.amount for ln in invoice.lines.all()}
    assert lines == {
        LineKind.RESERVED_FEE: reserved_fee,
        LineKind.CANCEL_FEE: cancel,
        LineKind.ON_DEMAND: on_demand,
        LineKind.SPOT: spot,
        LineKind.GPU_MEMORY: memory,
        LineKind.CREDIT: -PROMO,
        LineKind.TAX: tax,
    }
    assert invoice.status == InvoiceStatus.FINALIZED
    assert (invoice.subtotal, invoice.credits, invoice.tax, invoice.total) == (subtotal, PROMO, tax, total)
    # The reservation's fees are most of it: it was a commitment, cancelled or not.
    assert reserved_fee + cancel > total / 2 and memory > 0
