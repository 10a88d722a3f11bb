"""A default rate card, one node of H100s and helpers that make allocation intervals directly."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest

from metering.models import BillingAccount, Invoice, InvoiceStatus, RateCard
from metering.services.invoices import invoice_run
from metering.services.payments import invoice_payment_submit
from metering.services.rates import rate_card_version_create
from nodes.models import Gpu, GpuModel, Node, Region
from scheduling.models import Allocation, Plan, Reservation, ReservationStatus, Workload, WorkloadEvent
from tests.metering.stripe_server import StripeServer

H100 = "NVIDIA H100 SXM 80GB"
A100 = "NVIDIA A100 SXM 80GB"
_seq = itertools.count(1)


def utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


@pytest.fixture
def h100(db):
    return GpuModel.objects.get(name=H100)


@pytest.fixture
def a100(db):
    return GpuModel.objects.get(name=A100)


@pytest.fixture
def region(db):
    return Region.objects.get_or_create(code="us-east-1", defaults={"name": "US East"})[0]


@pytest.fixture
def card(db, h100, a100):
    """Default card from 2020: H100 on-demand 2.00/h, spot 0.80/h, reserved 1.50/h; A100 1.00/h."""
    rc = RateCard.objects.create(name="Standard", currency="USD", is_default=True)
    rate_card_version_create(
        rate_card=rc,
        effective_from=utc(2020, 1, 1),
        gpu_prices={
            (h100.pk, Plan.ON_DEMAND): "2.00",
            (h100.pk, Plan.SPOT): "0.80",
            (h100.pk, Plan.RESERVED): "1.50",
            (a100.pk, Plan.ON_DEMAND): "1.00",
            (a100.pk, Plan.SPOT): "0.40",
            (a100.pk, Plan.RESERVED): "0.75",
        },
        allow_past=True,
    )
    return rc


@pytest.fixture
def node(region, h100):
    n = next(_seq)
    node = Node.objects.create(hostname=f"meter-{n:04d}", region=region, cpu_cores=64, ram_mib=512 * 1024)
    for i in range(8):
        Gpu.objects.create(
            node=node, index=i, uuid=f"GPU-{uuid.uuid4()}", model=h100, reported_name=h100.name
        )
    return node


@pytest.fixture
def run(node, h100):
    """``run(tenant, start, end, plan=..., fraction_milli=..., gpu_index=...)``: a workload that held
    one GPU from ``start`` (placed and reported RUNNING then) to ``end`` (None: still running)."""

    def make(
        tenant,
        start,
        end=None,
        *,
        plan=Plan.ON_DEMAND,
        fraction_milli=1000,
        gpu_index=None,
        reservation=None,
        end_reason="stopped",
        cpu_millicores=0,
        ram_mib=0,
        running_at=None,
    ):
        gpu_index = gpu_index if gpu_index is not None else next(_seq) % 8
        gpu = Gpu.objects.get(node=node, index=gpu_index)
        w = Workload.objects.create(
            tenant=tenant,
            kind="job",
            state="running",
            plan=plan,
            reservation=reservation,
            gpu_fraction_milli=fraction_milli,
            cpu_millicores=cpu_millicores,
            ram_mib=ram_mib,
            image="img",
            started_at=start,
        )
        a = Allocation.objects.create(
            tenant=tenant,
            workload=w,
            node=node,
            gpu=gpu,
            gpu_model=h100,
            plan=plan,
            fraction_milli=fraction_milli,
            started_at=start,
            ended_at=end,
            end_reason=end_reason if end is not None else "",
        )
        WorkloadEvent.objects.create(
            tenant=tenant,
            workload=w,
            at=running_at or start,
            from_state="starting",
            to_state="running",
            reason="started",
        )
        return a

    return make


@pytest.fixture
def reserve(region, h100):
    def make(tenant, start, end, count=1):
        return Reservation.objects.create(
            tenant=tenant,
            gpu_model=h100,
            region=region,
            count=count,
            starts_at=start,
            ends_at=end,
            status=ReservationStatus.ACTIVE,
        )

    return make


D = Decimal


# --- Stripe: the local server, a finalized March invoice, and that invoice sent to Stripe -------

STRIPE_WEBHOOK_SECRET = "whsec_test_gpupool"


@pytest.fixture
def stripe_api(settings):
    with StripeServer() as server:
        settings.STRIPE_API_BASE = server.url
        settings.STRIPE_SECRET_KEY = "sk_test_gpupool"
        settings.STRIPE_WEBHOOK_SECRET = STRIPE_WEBHOOK_SECRET
        settings.METERING_PAYMENT_PROVIDER = "stripe"
        yield server.state


@pytest.fixture
def finalized(tenant, card, run):
    """March: 1 h on-demand (2.00) and 30 min spot (0.40), 10% tax; finalized on 5 April."""
    BillingAccount.objects.create(tenant=tenant, tax_rate_percent=Decimal("10"))
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 1))
    run(tenant, utc(2024, 3, 2), utc(2024, 3, 2, 0, 30), plan="spot")
    invoice_run(period_start=date(2024, 3, 1), now=utc(2024, 4, 5))
    invoice = Invoice.objects.get(tenant=tenant, period_start=date(2024, 3, 1))
    assert invoice.status == InvoiceStatus.FINALIZED and invoice.total == Decimal("2.64")
    return invoice


@pytest.fixture
def submitted(stripe_api, finalized):
    invoice_payment_submit(invoice_id=finalized.pk)
    finalized.refresh_from_db()
    return finalized
