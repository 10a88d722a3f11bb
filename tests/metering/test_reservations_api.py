"""Reservations through the API: the billing scope, as on the web, and bounded dates."""

from __future__ import annotations

from datetime import date, timedelta

import pytest
from django.utils import timezone

from metering.services.invoices import invoice_build
from scheduling.models import Reservation
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db

JSON = "application/json"


def _body(h100, starts_at=None, ends_at=None, count=2) -> dict:
    start = starts_at or (timezone.now() + timedelta(days=1)).isoformat()
    end = ends_at or (timezone.now() + timedelta(days=31)).isoformat()
    return {"gpu_model": h100.name, "region": "us-east-1", "count": count, "starts_at": start, "ends_at": end}


def test_reservations_need_the_billing_scope(tenant, make_token, api, region, h100):
    billing = api(make_token(tenant, scopes=["read", "billing"]))
    assert billing.post("/api/v1/reservations/", _body(h100), content_type=JSON).status_code == 201
    assert billing.get("/api/v1/reservations/").status_code == 200
    rid = Reservation.objects.get().pk
    worker = api(make_token(tenant, scopes=["read", "write"]))
    for response in (
        worker.get("/api/v1/reservations/"),
        worker.get(f"/api/v1/reservations/{rid}/"),
        worker.post("/api/v1/reservations/", _body(h100), content_type=JSON),
        worker.post(f"/api/v1/reservations/{rid}/cancel/"),
    ):
        assert response.status_code == 403 and "billing" in response.json()["error"]["message"]
    assert Reservation.objects.count() == 1 and Reservation.objects.get().status == "requested"


@pytest.mark.parametrize(
    ("field", "override"),
    [
        ("ends_at", {"ends_at": "9999-12-31T23:59:59Z"}),
        ("starts_at", {"starts_at": "9000-01-01T00:00:00Z", "ends_at": "9000-02-01T00:00:00Z"}),
        ("count", {"count": 1_000_000}),
    ],
)
def test_reservation_dates_and_count_are_bounded(tenant, make_token, api, region, h100, field, override):
    client = api(make_token(tenant, scopes=["read", "write", "billing"]))
    response = client.post("/api/v1/reservations/", {**_body(h100), **override}, content_type=JSON)
    assert response.status_code == 400, response.content
    assert list(response.json()["error"]["fields"]) == [field]
    assert not Reservation.objects.exists()


def test_a_far_end_already_stored_does_not_break_the_invoice_build(tenant, card, reserve, h100):
    reserve(tenant, utc(2024, 3, 1), utc(9999, 12, 31, 23, 59, 59), count=1)
    invoice = invoice_build(tenant=tenant, period_start=date(2024, 3, 1))
    (line,) = invoice.lines.filter(kind="reserved_fee")
    assert line.amount > 0 and "31 of 31 days" in line.description
