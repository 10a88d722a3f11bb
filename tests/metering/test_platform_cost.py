"""Warm-pool time before a tenant binds is the platform's cost, recorded as such and never billed;
after binding the tenant pays from the bind."""

from datetime import date, timedelta
from decimal import Decimal

import pytest

from metering.models import InvoiceLine, PlatformCost, UsageRecord
from metering.services.invoices import invoice_build
from metering.services.usage import usage_build
from nodes.models import Gpu
from scheduling.models import WarmPool, WarmSlot
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db


@pytest.fixture
def pool(h100, region):
    return WarmPool.objects.create(gpu_model=h100, region=region, image="ghcr.io/acme/train:1", min_size=1)


def _slot(pool, node, index, created, ended=None, reason="", bound_to=None):
    return WarmSlot.objects.create(
        pool=pool,
        node=node,
        gpu=Gpu.objects.get(node=node, index=index),
        created_at=created,
        ended_at=ended,
        end_reason=reason,
        bound_to=bound_to,
    )


def test_warm_time_is_platform_cost_and_the_tenant_pays_from_the_bind(tenant, card, run, node, pool):
    bind = utc(2024, 3, 1, 3)
    # The request bound the slot at 03:00; the agent reported it running two minutes later.
    bound = run(tenant, bind, utc(2024, 3, 1, 5), gpu_index=0, running_at=bind + timedelta(minutes=2))
    _slot(pool, node, 0, utc(2024, 3, 1, 0), bind, "bound", bound_to=bound.workload)
    # A cold start on another GPU is billed from the reported start, as before.
    cold = run(tenant, bind, utc(2024, 3, 1, 5), gpu_index=1, running_at=bind + timedelta(minutes=2))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))

    warm_rec = UsageRecord.objects.get(allocation=bound)
    assert (warm_rec.start, warm_rec.end, warm_rec.amount) == (bind, utc(2024, 3, 1, 5), Decimal("4"))
    cold_rec = UsageRecord.objects.get(allocation=cold)
    assert cold_rec.start == bind + timedelta(minutes=2)

    cost = PlatformCost.objects.get()
    assert (cost.start, cost.end, cost.kind) == (utc(2024, 3, 1, 0), bind, "warm_pool")
    assert cost.gpu_seconds == Decimal(3 * 3600) and cost.unit_price == Decimal("2")
    assert cost.amount == Decimal("6") and cost.bound_to_id == bound.workload_id
    # Never on the tenant's invoice: only the two workloads' usage is billed.
    invoice = invoice_build(tenant=tenant, period_start=date(2024, 3, 1))
    assert invoice.total == Decimal("4.00") + cold_rec.amount.quantize(Decimal("0.01"))
    assert not InvoiceLine.objects.filter(description__icontains="warm").exists()


def test_released_and_open_slots_are_cut_at_months_and_recorded_once(card, node, pool):
    _slot(pool, node, 2, utc(2024, 2, 29, 20), utc(2024, 3, 1, 2), "released")  # 4 h Feb + 2 h March
    _slot(pool, node, 3, utc(2024, 3, 31, 12))  # still warm: only its finished month is final
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1, 6))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1, 7))  # again: nothing new
    rows = list(PlatformCost.objects.order_by("start").values_list("period_start", "gpu_seconds", "amount"))
    assert rows == [
        (date(2024, 2, 1), Decimal(4 * 3600), Decimal("8")),
        (date(2024, 3, 1), Decimal(2 * 3600), Decimal("4")),
        (date(2024, 3, 1), Decimal(12 * 3600), Decimal("24")),
    ]
    assert UsageRecord.objects.count() == 0
