"""The monthly run in batches: a fixed number of queries per batch, one failing tenant costs nobody
else their invoice, and the bulk path gives the same invoices as building one tenant at a time."""

from datetime import date
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from metering.models import BillingAccount, Invoice, InvoiceLine, InvoiceStatus, RateCard
from metering.services import invoices as invoices_service
from metering.services.invoices import InvoiceRunFailed, invoice_build, invoice_run
from metering.services.rates import rate_card_version_create
from metering.services.usage import usage_build
from scheduling.models import Plan
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db
MARCH = date(2024, 3, 1)


def _usage(run, tenants):
    for i, t in enumerate(tenants):
        run(t, utc(2024, 3, 1 + i % 20), utc(2024, 3, 1 + i % 20, 1 + i % 5))
        run(t, utc(2024, 3, 2 + i % 20), utc(2024, 3, 2 + i % 20, 2), plan=Plan.SPOT)
        run(t, utc(2024, 2, 10), utc(2024, 2, 10, 1))  # February: an adjustment once Feb is closed


def _queries(fn) -> int:
    with CaptureQueriesContext(connection) as ctx:
        fn()
    return len(ctx.captured_queries)


def test_the_run_costs_the_same_queries_for_3_or_12_tenants_per_batch(make_tenant, card, run, monkeypatch):
    monkeypatch.setattr(invoices_service, "BATCH_SIZE", 100)
    few = [make_tenant(f"few{i}") for i in range(3)]
    _usage(run, few)
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    small = _queries(lambda: invoice_run(period_start=MARCH, now=utc(2024, 4, 1)))
    Invoice.objects.all().delete()
    many = few + [make_tenant(f"many{i}") for i in range(9)]
    _usage(run, many[3:])
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    large = _queries(lambda: invoice_run(period_start=MARCH, now=utc(2024, 4, 1)))
    assert Invoice.objects.filter(period_start=MARCH).count() == 12
    assert large == small, (small, large)


def test_a_failing_tenant_costs_only_its_own_invoice_and_is_named(make_tenant, card, run, reserve, h100):
    good = [make_tenant(f"good{i}") for i in range(4)]
    bad = make_tenant("bad")
    odd = RateCard.objects.create(name="No reserved price", currency="USD")
    rate_card_version_create(
        rate_card=odd,
        effective_from=utc(2020, 1, 1),
        gpu_prices={(h100.pk, Plan.ON_DEMAND): "3"},
        allow_past=True,
    )
    BillingAccount.objects.create(tenant=bad, rate_card=odd)
    reserve(bad, utc(2024, 3, 1), utc(2024, 4, 1))  # no reserved price on its card: cannot be billed
    _usage(run, [*good, bad])
    invoices_service.BATCH_SIZE, saved = 2, invoices_service.BATCH_SIZE
    try:
        with pytest.raises(InvoiceRunFailed) as exc:
            invoice_run(period_start=MARCH, now=utc(2024, 4, 1))
    finally:
        invoices_service.BATCH_SIZE = saved
    assert list(exc.value.failed) == [bad.pk] and "reserved price" in str(exc.value)
    built = Invoice.objects.filter(period_start=MARCH)
    assert sorted(built.values_list("tenant_id", flat=True)) == sorted(t.pk for t in good)
    assert all(i.total > 0 and InvoiceLine.objects.filter(invoice=i).exists() for i in built)


def test_the_bulk_run_builds_what_one_tenant_at_a_time_builds(make_tenant, card, run, reserve, monkeypatch):
    monkeypatch.setattr(invoices_service, "BATCH_SIZE", 3)
    tenants = [make_tenant(f"t{i}") for i in range(7)]
    for i, t in enumerate(tenants):
        BillingAccount.objects.create(
            tenant=t, discount_percent=Decimal(i), tax_rate_percent=Decimal("7.5") if i % 2 else 0
        )
    _usage(run, tenants)
    r = reserve(tenants[0], utc(2024, 3, 10), utc(2025, 3, 10), count=1)
    run(tenants[0], utc(2024, 3, 11), utc(2024, 3, 11, 5), plan=Plan.RESERVED, reservation=r)
    run(tenants[0], utc(2024, 3, 11, 1), utc(2024, 3, 11, 2), plan=Plan.RESERVED, reservation=r)
    # February is finalized first, so February's usage that arrives later is an adjustment in March.
    invoice_run(period_start=date(2024, 2, 1), now=utc(2024, 3, 1))
    invoice_run(period_start=date(2024, 2, 1), now=utc(2024, 3, 5))
    run(tenants[1], utc(2024, 2, 20), utc(2024, 2, 20, 3))

    bulk = invoice_run(period_start=MARCH, now=utc(2024, 4, 1))

    def snapshot():
        return {
            i.tenant_id: (
                i.status,
                i.subtotal,
                i.tax,
                i.total,
                list(InvoiceLine.objects.filter(invoice=i).values_list("kind", "description", "amount")),
            )
            for i in Invoice.objects.filter(period_start=MARCH)
        }

    by_batch = snapshot()
    assert len(bulk) == 7 and len(by_batch) == 7
    kinds = {k for _, _, _, _, lines in by_batch.values() for k, _, _ in lines}
    assert {"reserved_fee", "reserved_overage", "on_demand", "spot", "adjustment", "tax"} <= kinds
    Invoice.objects.filter(period_start=MARCH).delete()
    for t in tenants:
        invoice_build(tenant=t, period_start=MARCH, now=utc(2024, 4, 1))
    assert snapshot() == by_batch
    # Finalizing in bulk once the grace is over: every draft, credits and all, then immutable.
    invoice_run(period_start=MARCH, now=utc(2024, 4, 5))
    assert set(Invoice.objects.filter(period_start=MARCH).values_list("status", flat=True)) == {
        InvoiceStatus.FINALIZED
    }
    assert {t: v[1:] for t, v in snapshot().items()} == {t: v[1:] for t, v in by_batch.items()}
