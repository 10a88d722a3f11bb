"""Volumes billed per GiB-hour of their size, from creation to deletion, at the rate card's storage
price in force (after the tenant's discount), on the monthly invoice's "Volume storage" line."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest

from metering.models import BillingAccount, InvoiceLine, LineKind, RateCard, StorageUsageRecord
from metering.services.invoices import invoice_build
from metering.services.rates import rate_card_version_create
from metering.services.usage import costs_to_date, usage_build
from scheduling.models import Volume, VolumeState
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db


@pytest.fixture
def storage_card(db, h100):
    """0.0001 per GiB-hour from 2026, 0.0002 from 20 March 2026 00:00 UTC."""
    rc = RateCard.objects.create(name="Storage", currency="USD", is_default=True)
    for start, price in ((utc(2026, 1, 1), "0.0001"), (utc(2026, 3, 20), "0.0002")):
        rate_card_version_create(
            rate_card=rc,
            effective_from=start,
            gpu_prices={},
            storage_gib_hour_price=price,
            allow_past=True,
        )
    return rc


def test_a_volume_is_billed_per_gib_hour_across_a_price_change_and_a_month(tenant, region, storage_card):
    BillingAccount.objects.create(tenant=tenant, discount_percent=Decimal("10"))
    v = Volume.objects.create(
        tenant=tenant,
        name="data",
        region=region,
        size_gib=100,
        created_at=utc(2026, 3, 10),
        state=VolumeState.DELETED,
        deleted_at=utc(2026, 4, 5, 12),
    )
    result = usage_build(since=utc(2026, 3, 1), now=utc(2026, 5, 1))
    assert result.storage_created == 3 and result.unrated == []
    rows = list(StorageUsageRecord.objects.filter(volume=v).order_by("start"))
    assert [(r.start, r.end) for r in rows] == [
        (utc(2026, 3, 10), utc(2026, 3, 20)),
        (utc(2026, 3, 20), utc(2026, 4, 1)),
        (utc(2026, 4, 1), utc(2026, 4, 5, 12)),
    ]
    # 100 GiB x 240 h x 0.00009, 100 x 288 h x 0.00018, 100 x 108 h x 0.00018 (10% off).
    assert [r.unit_price for r in rows] == [Decimal("0.00009"), Decimal("0.00018"), Decimal("0.00018")]
    assert [r.amount for r in rows] == [Decimal("2.16"), Decimal("5.184"), Decimal("1.944")]
    assert [r.gib_seconds for r in rows] == [
        Decimal(100 * 240 * 3600),
        Decimal(100 * 288 * 3600),
        Decimal(100 * 108 * 3600),
    ]
    # A rerun makes nothing new.
    assert usage_build(since=utc(2026, 3, 1), now=utc(2026, 5, 1)).storage_created == 0

    march = invoice_build(tenant=tenant, period_start=date(2026, 3, 1), now=utc(2026, 4, 2))
    (line,) = InvoiceLine.objects.filter(invoice=march, kind=LineKind.STORAGE)
    assert line.amount == Decimal("7.34")  # 7.344, rounded half up at cents
    assert line.quantity == Decimal(100 * 528) and line.unit == "gib-hour"
    assert line.description == "Volume storage, 52800.000 GiB-hours"
    assert march.total == Decimal("7.34")
    april = invoice_build(tenant=tenant, period_start=date(2026, 4, 1), now=utc(2026, 5, 2))
    (line,) = InvoiceLine.objects.filter(invoice=april, kind=LineKind.STORAGE)
    assert line.amount == Decimal("1.94")


def test_a_live_volume_records_only_finished_pieces_and_counts_in_the_cost_to_date(
    tenant, region, storage_card
):
    v = Volume.objects.create(
        tenant=tenant, name="live", region=region, size_gib=10, created_at=utc(2026, 4, 20)
    )
    usage_build(since=utc(2026, 4, 1), now=utc(2026, 5, 3))
    (april,) = StorageUsageRecord.objects.filter(volume=v)  # May is not over
    assert (april.start, april.end) == (utc(2026, 4, 20), utc(2026, 5, 1))
    assert april.amount == Decimal("0.0002") * 10 * 11 * 24
    # May so far: 2 days of 10 GiB at 0.0002, accrued though not yet recorded.
    cost = costs_to_date(tenant_ids=[tenant.pk], now=utc(2026, 5, 3))
    assert cost[tenant.pk] == Decimal("0.0002") * 10 * 48


def test_no_storage_price_bills_nothing_and_says_so(tenant, region, card):
    Volume.objects.create(
        tenant=tenant,
        name="free",
        region=region,
        size_gib=5,
        created_at=utc(2026, 3, 1),
        state=VolumeState.DELETED,
        deleted_at=utc(2026, 3, 2),
    )
    result = usage_build(since=utc(2026, 3, 1), now=utc(2026, 4, 1))
    assert result.storage_created == 0 and any("no storage price" in u for u in result.unrated)


def test_a_resized_volume_is_billed_at_each_size_for_its_own_hours(tenant, region, storage_card):
    """Grown from 100 to 200 GiB on 15 March, shrunk to 50 GiB on 2 April, deleted 5 April noon."""
    from portal.actors import Actor
    from scheduling.services.volumes import volume_resize

    v = Volume.objects.create(
        tenant=tenant, name="data", region=region, size_gib=100, created_at=utc(2026, 3, 10)
    )
    volume_resize(volume=v, size_gib=200, actor=Actor.system(), now=utc(2026, 3, 15))
    # A live volume: the piece before the resize is final and recorded; the rest waits.
    usage_build(since=utc(2026, 3, 1), now=utc(2026, 3, 16))
    first = list(StorageUsageRecord.objects.filter(volume=v).order_by("start"))
    assert [(r.start, r.end, r.size_gib) for r in first] == [(utc(2026, 3, 10), utc(2026, 3, 15), 100)]
    # Cost to date after the resize: 200 GiB for the day since it, at 0.0001.
    assert costs_to_date(tenant_ids=[tenant.pk], now=utc(2026, 3, 16))[tenant.pk] == (
        first[0].amount + Decimal("0.0001") * 200 * 24
    )
    volume_resize(volume=v, size_gib=50, actor=Actor.system(), now=utc(2026, 4, 2))
    Volume.objects.filter(pk=v.pk).update(state=VolumeState.DELETED, deleted_at=utc(2026, 4, 5, 12))
    usage_build(since=utc(2026, 3, 1), now=utc(2026, 5, 1))
    rows = list(StorageUsageRecord.objects.filter(volume=v).order_by("start"))
    assert [(r.start, r.end, r.size_gib) for r in rows] == [
        (utc(2026, 3, 10), utc(2026, 3, 15), 100),
        (utc(2026, 3, 15), utc(2026, 3, 20), 200),
        (utc(2026, 3, 20), utc(2026, 4, 1), 200),
        (utc(2026, 4, 1), utc(2026, 4, 2), 200),
        (utc(2026, 4, 2), utc(2026, 4, 5, 12), 50),
    ]
    hours = [120, 120, 288, 24, 84]
    assert [r.gib_seconds for r in rows] == [
        Decimal(size * h * 3600) for size, h in zip([100, 200, 200, 200, 50], hours, strict=True)
    ]
    prices = [Decimal("0.0001"), Decimal("0.0001"), Decimal("0.0002"), Decimal("0.0002"), Decimal("0.0002")]
    assert [r.amount for r in rows] == [
        p * size * h for p, size, h in zip(prices, [100, 200, 200, 200, 50], hours, strict=True)
    ]
    # A rerun makes nothing new.
    assert usage_build(since=utc(2026, 3, 1), now=utc(2026, 5, 1)).storage_created == 0
