from datetime import date
from decimal import Decimal

import pytest
from django.db import IntegrityError, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metering.models import (
    BillingAccount,
    CreditEntry,
    Invoice,
    InvoiceLine,
    InvoiceStatus,
    LineKind,
    UsageRecord,
)
from metering.services.invoices import (
    credit_grant,
    credit_note_issue,
    invoice_build,
    invoice_finalize,
    invoice_mark_paid,
    invoice_run,
    invoice_void,
)
from metering.services.usage import usage_build
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from scheduling.models import Plan
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db
SYSTEM = Actor.system()
MARCH = date(2024, 3, 1)


def _lines(invoice):
    return [(ln.kind, ln.amount) for ln in InvoiceLine.objects.filter(invoice=invoice)]


def _state(invoice):
    inv = Invoice.objects.get(pk=invoice.pk)
    return (inv.status, inv.subtotal, inv.credits, inv.tax, inv.total, _lines(inv))


def test_lines_per_plan_and_model_tax_and_a_rerun_changes_nothing(tenant, card, run):
    BillingAccount.objects.create(tenant=tenant, tax_rate_percent=Decimal("19"))
    run(tenant, utc(2024, 3, 1, 0), utc(2024, 3, 1, 10))  # 10 h on-demand = 20.00
    run(tenant, utc(2024, 3, 2, 0), utc(2024, 3, 2, 5), plan=Plan.SPOT)  # 5 h spot = 4.00
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    invoice = invoice_build(tenant=tenant, period_start=MARCH, now=utc(2024, 4, 1))
    assert _lines(invoice) == [
        (LineKind.ON_DEMAND, Decimal("20.00")),
        (LineKind.SPOT, Decimal("4.00")),
        (LineKind.TAX, Decimal("4.56")),
    ]
    assert invoice.total == Decimal("28.56") and invoice.status == InvoiceStatus.DRAFT
    before = _state(invoice)
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    again = invoice_run(period_start=MARCH, now=utc(2024, 4, 1))
    assert [i.pk for i in again] == [invoice.pk] and Invoice.objects.count() == 1
    assert _state(invoice) == before


def test_late_usage_lands_on_the_draft_then_on_the_next_invoice_as_an_adjustment(tenant, card, run):
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 1))
    invoice_run(period_start=MARCH, now=utc(2024, 4, 1))
    run(tenant, utc(2024, 3, 10), utc(2024, 3, 10, 1))  # arrives during the grace period
    invoice = invoice_run(period_start=MARCH, now=utc(2024, 4, 2))[0]
    assert invoice.total == Decimal("4.00") and invoice.status == InvoiceStatus.DRAFT
    march = invoice_run(period_start=MARCH, now=utc(2024, 4, 5))[0]  # grace over: finalized
    march.refresh_from_db()
    assert march.status == InvoiceStatus.FINALIZED and march.total == Decimal("4.00")
    run(tenant, utc(2024, 3, 20), utc(2024, 3, 20, 3))  # after finalization
    run(tenant, utc(2024, 4, 3), utc(2024, 4, 3, 1))
    april = invoice_run(period_start=date(2024, 4, 1), now=utc(2024, 5, 1))[0]
    march.refresh_from_db()
    assert march.total == Decimal("4.00")
    adj = InvoiceLine.objects.get(invoice=april, kind=LineKind.ADJUSTMENT)
    assert adj.original_period == MARCH and adj.amount == Decimal("6.00") and "2024-03" in adj.description
    assert april.total == Decimal("8.00")


def test_a_finalized_invoice_is_immutable_in_the_database(tenant, card, run):
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 1))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    invoice = invoice_finalize(
        invoice=invoice_build(tenant=tenant, period_start=MARCH), actor=SYSTEM, now=utc(2024, 4, 4)
    )
    with pytest.raises(IntegrityError), transaction.atomic():
        Invoice.objects.filter(pk=invoice.pk).update(total=Decimal("0.01"))
    with pytest.raises(IntegrityError), transaction.atomic():
        Invoice.objects.filter(pk=invoice.pk).update(status=InvoiceStatus.DRAFT)
    line = InvoiceLine.objects.filter(invoice=invoice).first()
    with pytest.raises(IntegrityError), transaction.atomic():
        InvoiceLine.objects.filter(pk=line.pk).update(amount=Decimal(0))
    with pytest.raises(IntegrityError), transaction.atomic():
        InvoiceLine.objects.filter(pk=line.pk).delete()
    with pytest.raises(IntegrityError), transaction.atomic():
        InvoiceLine.objects.create(
            tenant=tenant, invoice=invoice, position=99, kind=LineKind.ADJUSTMENT, description="x", amount=1
        )
    with pytest.raises(IntegrityError), transaction.atomic():
        Invoice.objects.filter(pk=invoice.pk).delete()
    # The service refuses with a message; moving on to paid is allowed.
    with pytest.raises(Conflict, match="only a draft"):
        invoice_finalize(invoice=invoice, actor=SYSTEM)
    invoice_mark_paid(invoice=invoice, actor=SYSTEM)
    assert Invoice.objects.get(pk=invoice.pk).status == InvoiceStatus.PAID
    assert Invoice.objects.get(pk=invoice.pk).total == Decimal("2.00")


def test_credits_apply_promotional_then_prepaid_and_tax_on_the_rest(tenant, card, run):
    BillingAccount.objects.create(tenant=tenant, tax_rate_percent=Decimal("10"))
    credit_grant(tenant=tenant, kind="prepaid", amount="10", actor=SYSTEM)
    credit_grant(tenant=tenant, kind="promotional", amount="5", actor=SYSTEM)
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 10))  # 20.00
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    invoice = invoice_finalize(invoice=invoice_build(tenant=tenant, period_start=MARCH), actor=SYSTEM)
    assert _lines(invoice) == [
        (LineKind.ON_DEMAND, Decimal("20.00")),
        (LineKind.CREDIT, Decimal("-5.00")),
        (LineKind.CREDIT, Decimal("-10.00")),
        (LineKind.TAX, Decimal("0.50")),
    ]
    assert invoice.total == Decimal("5.50") and invoice.credits == Decimal("15.00")
    assert list(CreditEntry.objects.order_by("pk").values_list("kind", "amount")) == [
        ("prepaid", Decimal("10")),
        ("promotional", Decimal("5")),
        ("promotional", Decimal("-5")),
        ("prepaid", Decimal("-10")),
    ]
    invoice_void(invoice=invoice, actor=SYSTEM, reason="test")
    assert CreditEntry.objects.filter(kind="prepaid").values_list("amount", flat=True).last() == Decimal("10")


def test_credit_notes_correct_a_finalized_invoice_up_to_its_total(tenant, card, run):
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 5))  # 10.00
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    draft = invoice_build(tenant=tenant, period_start=MARCH)
    with pytest.raises(Conflict):
        credit_note_issue(invoice=draft, amount="1", reason="x", actor=SYSTEM)
    invoice = invoice_finalize(invoice=draft, actor=SYSTEM)
    invoice_mark_paid(invoice=invoice, actor=SYSTEM)
    credit_note_issue(invoice=invoice, amount="4", reason="outage", actor=SYSTEM)
    with pytest.raises(ValidationFailed) as exc:
        credit_note_issue(invoice=invoice, amount="6.01", reason="more", actor=SYSTEM)
    assert "amount" in exc.value.fields
    assert CreditEntry.objects.get().amount == Decimal("4.00")


@pytest.mark.parametrize(
    ("start", "end", "period", "expected"),
    [
        # 2 x H100 reserved at 1.50/h x 730 h = 1095.00 per GPU-month; 12-month term: 20 % off = 876.00
        (utc(2024, 1, 1), utc(2025, 1, 1), date(2024, 2, 1), Decimal("1752.00")),
        # February of a leap year, from the 15th: 15 of 29 days
        (utc(2024, 2, 15), utc(2025, 2, 15), date(2024, 2, 1), Decimal("906.21")),
        # February of a common year, from the 15th: 14 of 28 days
        (utc(2023, 2, 15), utc(2024, 2, 15), date(2023, 2, 1), Decimal("876.00")),
        # A 1-month term (no term discount) ending on 10 March: 9 of 31 days
        (utc(2024, 2, 10), utc(2024, 3, 10), date(2024, 3, 1), Decimal("635.81")),
    ],
)
def test_reserved_fees_are_prorated_by_day(tenant, card, reserve, start, end, period, expected):
    reserve(tenant, start, end, count=2)
    invoice = invoice_build(tenant=tenant, period_start=period)
    assert _lines(invoice) == [(LineKind.RESERVED_FEE, expected)]


def test_reserved_usage_up_to_n_gpus_is_covered_and_above_it_billed_on_demand(tenant, card, run, reserve):
    r = reserve(tenant, utc(2024, 3, 1), utc(2024, 4, 1), count=1)
    run(tenant, utc(2024, 3, 2, 0), utc(2024, 3, 2, 4), plan=Plan.RESERVED, reservation=r)
    run(tenant, utc(2024, 3, 2, 1), utc(2024, 3, 2, 3), plan=Plan.RESERVED, reservation=r)  # 2 h above 1 GPU
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    assert set(UsageRecord.objects.values_list("amount", flat=True)) == {Decimal(0)}
    invoice = invoice_build(tenant=tenant, period_start=MARCH)
    assert _lines(invoice) == [
        (LineKind.RESERVED_FEE, Decimal("1095.00")),
        (LineKind.RESERVED_OVERAGE, Decimal("4.00")),
    ]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=27 * 86400),
            st.integers(min_value=1, max_value=40 * 3600),
            st.sampled_from([Plan.ON_DEMAND, Plan.SPOT]),
            st.sampled_from([1000, 333, 1]),
        ),
        min_size=1,
        max_size=6,
    ),
    st.decimals(min_value=0, max_value=30, places=3),
    st.sampled_from(["USD", "JPY"]),
)
def test_the_total_is_exactly_the_sum_of_the_lines(tenant, card, run, specs, tax, currency):
    Invoice.objects.all().delete()
    UsageRecord.objects.all().delete()
    card.currency = currency
    card.save()
    BillingAccount.objects.update_or_create(
        tenant=tenant, defaults={"tax_rate_percent": tax, "discount_percent": Decimal("7.5")}
    )
    from datetime import timedelta

    for offset, length, plan, fraction in specs:
        start = utc(2024, 2, 1) + timedelta(seconds=offset)
        run(tenant, start, start + timedelta(seconds=length), plan=plan, fraction_milli=fraction)
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    invoice = invoice_build(tenant=tenant, period_start=date(2024, 2, 1))
    amounts = list(InvoiceLine.objects.filter(invoice=invoice).values_list("amount", flat=True))
    assert invoice.total == sum(amounts)
    assert invoice.total == invoice.subtotal - invoice.credits + invoice.tax
    places = 0 if currency == "JPY" else 2
    assert all(a == a.quantize(Decimal(1).scaleb(-places)) for a in amounts)
