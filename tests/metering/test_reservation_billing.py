"""Reservations as commitments: billed to the second up to their end (the term's end, or the
cancellation), whatever their status now; a cancellation fee from the settings; activation within
the region's capacity; the fee in the cost to date."""

from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.test import override_settings

from metering.models import Invoice, InvoiceLine, LineKind
from metering.services.invoices import invoice_build, invoice_run
from metering.services.usage import costs_to_date
from portal.actors import Actor
from portal.errors import Conflict
from portal.models import AuditEvent
from scheduling.models import Reservation, ReservationStatus
from scheduling.services.reservations import reservation_activate, reservation_cancel
from tests.metering.conftest import utc
from tests.portal.conftest import signed_in  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db
SYSTEM = Actor.system()
MARCH = date(2024, 3, 1)
# H100 reserved at 1.50/h (the card fixture) x 730 h = 1095.00 per GPU-month before term discounts.
GPU_MONTH = Decimal("1.50") * 730


def _fees(invoice):
    return [
        (ln.kind, ln.amount)
        for ln in InvoiceLine.objects.filter(
            invoice=invoice, kind__in=[LineKind.RESERVED_FEE, LineKind.CANCEL_FEE]
        )
    ]


def _q(x: Decimal) -> Decimal:
    return x.quantize(Decimal("0.01"))


def test_a_staff_cancel_bills_the_month_to_the_second_up_to_the_cancellation(tenant, card, reserve):
    r = reserve(tenant, utc(2024, 3, 1), utc(2025, 3, 1), count=2)
    assert _fees(invoice_build(tenant=tenant, period_start=MARCH)) == [
        (LineKind.RESERVED_FEE, Decimal("1752.00"))
    ]
    cancelled_at = utc(2024, 3, 16, 12, 0, 7)
    reservation_cancel(reservation=r, actor=SYSTEM, staff=True, now=cancelled_at)
    r.refresh_from_db()
    assert r.status == ReservationStatus.CANCELLED and r.cancelled_at == cancelled_at
    # The daily rebuild of the draft: the fee stays, for the seconds the reservation was in force.
    invoice = invoice_build(tenant=tenant, period_start=MARCH)
    in_force = Decimal((cancelled_at - utc(2024, 3, 1)).total_seconds())
    expected = _q(GPU_MONTH * Decimal("0.8") * 2 * in_force / Decimal(31 * 86400))  # 12-month term: 20 % off
    assert _fees(invoice) == [(LineKind.RESERVED_FEE, expected)]
    assert expected > Decimal("800")
    # April and later: nothing; and the monthly run still picks the tenant up for March.
    assert _fees(invoice_build(tenant=tenant, period_start=date(2024, 4, 1))) == []
    Invoice.objects.all().delete()
    invoice_run(period_start=MARCH, now=utc(2024, 4, 1, 0, 5))
    assert _fees(Invoice.objects.get(tenant=tenant, period_start=MARCH)) == [
        (LineKind.RESERVED_FEE, expected)
    ]


def test_a_request_cancelled_before_activation_bills_nothing(tenant, card, reserve):
    r = reserve(tenant, utc(2024, 3, 1), utc(2024, 4, 1))
    Reservation.objects.filter(pk=r.pk).update(status=ReservationStatus.REQUESTED)
    reservation_cancel(reservation=r, actor=SYSTEM, now=utc(2024, 3, 2))
    assert _fees(invoice_build(tenant=tenant, period_start=MARCH)) == []


@override_settings(RESERVATION_CANCEL_FEE_PERCENT=25, RESERVATION_CANCEL_ACTIVE_BY="tenant")
def test_the_cancellation_fee_is_a_percent_of_the_rest_of_the_term_and_tenants_may_cancel(
    tenant, card, reserve
):
    r = reserve(tenant, utc(2024, 3, 1), utc(2024, 6, 1), count=1)  # 3-month term: 5 % off
    cancelled_at = utc(2024, 3, 11)
    reservation_cancel(reservation=r, actor=SYSTEM, now=cancelled_at)  # the tenant itself
    invoice = invoice_build(tenant=tenant, period_start=MARCH)
    hourly = Decimal("1.50") * Decimal("0.95")
    rest_h = Decimal((utc(2024, 6, 1) - cancelled_at).total_seconds()) / 3600
    fee = _q(hourly * rest_h * Decimal("0.25"))
    march = _q(GPU_MONTH * Decimal("0.95") * 10 / 31)
    assert _fees(invoice) == [(LineKind.RESERVED_FEE, march), (LineKind.CANCEL_FEE, fee)]
    audit = AuditEvent.objects.get(action="reservation.cancel")
    assert Decimal(audit.data["cancel_fee_percent"]) == 25 and audit.data["was_active"] is True


def test_by_default_only_staff_end_an_active_reservation(tenant, card, reserve):
    r = reserve(tenant, utc(2024, 3, 1), utc(2024, 6, 1))
    with pytest.raises(Conflict, match="staff"):
        reservation_cancel(reservation=r, actor=SYSTEM, now=utc(2024, 3, 2))
    assert Reservation.objects.get(pk=r.pk).status == ReservationStatus.ACTIVE


def test_activation_refuses_more_gpus_than_the_region_holds_for_the_term(
    tenant, make_tenant, card, node, reserve
):
    # The node has 8 H100s; 6 are reserved by another tenant over part of the term.
    reserve(make_tenant("other"), utc(2030, 1, 10), utc(2030, 1, 20), count=6)
    r = reserve(tenant, utc(2030, 1, 1), utc(2030, 2, 1), count=3)
    Reservation.objects.filter(pk=r.pk).update(status=ReservationStatus.REQUESTED)
    with pytest.raises(Conflict) as exc:
        reservation_activate(reservation=r, actor=SYSTEM)
    assert exc.value.status_code == 409
    assert "capacity" in str(exc.value) and "2 of 8" in str(exc.value)
    assert Reservation.objects.get(pk=r.pk).status == ReservationStatus.REQUESTED
    # A request that fits is confirmed.
    fits = reserve(tenant, utc(2030, 1, 1), utc(2030, 2, 1), count=2)
    Reservation.objects.filter(pk=fits.pk).update(status=ReservationStatus.REQUESTED)
    assert reservation_activate(reservation=fits, actor=SYSTEM).status == ReservationStatus.ACTIVE
    # Staff may override; the audit says what it risks.
    done = reservation_activate(reservation=r, actor=SYSTEM, override_capacity=True)
    assert done.status == ReservationStatus.ACTIVE
    audit = AuditEvent.objects.filter(action="reservation.activate").latest("pk")
    assert audit.data["capacity_override"] is True
    assert "overbooked" in audit.data["risk"] and "3" in audit.data["risk"]


def test_the_cost_to_date_includes_the_reservation_fee_so_far(tenant, card, reserve, run):
    reserve(tenant, utc(2024, 3, 1), utc(2024, 4, 1), count=2)  # 1-month term, no discount
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 1))  # 2.00 on-demand
    now = utc(2024, 3, 5, 1, 30)
    from metering.services.usage import usage_build

    usage_build(since=utc(2024, 1, 1), now=now)
    fee = GPU_MONTH * 2 * Decimal((now - utc(2024, 3, 1)).total_seconds()) / Decimal(31 * 86400)
    got = costs_to_date(tenant_ids=[tenant.pk], now=now)[tenant.pk]
    assert abs(got - (Decimal("2") + fee)) < Decimal("0.000001")
    assert costs_to_date(tenant_ids=[tenant.pk], now=now + timedelta(hours=1))[tenant.pk] > got


@override_settings(RESERVATION_CANCEL_FEE_PERCENT=25, RESERVATION_CANCEL_ACTIVE_BY="tenant")
def test_the_reservations_page_offers_to_end_an_active_one_with_its_fee(
    tenant,
    owner,
    card,
    reserve,
    signed_in,  # noqa: F811
):
    r = reserve(tenant, utc(2024, 1, 1), utc(2099, 1, 1))
    c = signed_in(owner, tenant)
    html = c.get("/billing/reservations/").content.decode()
    assert "End now (25% fee)" in html
    assert c.post(f"/billing/reservations/{r.pk}/cancel/").status_code == 302
    r.refresh_from_db()
    assert r.status == ReservationStatus.CANCELLED and r.cancelled_at is not None
    assert r.cancel_fee_percent == 25
    with override_settings(RESERVATION_CANCEL_ACTIVE_BY="staff"):
        other = reserve(tenant, utc(2024, 1, 1), utc(2099, 1, 1))
        assert "End now" not in c.get("/billing/reservations/").content.decode()
        c.post(f"/billing/reservations/{other.pk}/cancel/")
        assert Reservation.objects.get(pk=other.pk).status == ReservationStatus.ACTIVE
