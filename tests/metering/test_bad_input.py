"""Bad input gets a clear 4xx naming what is wrong, never a 500: deep JSON on any API POST, dates
and months beyond what the code can compute with, and quantities that overflow the decimal context.

Each request here was a 500 (an exception in the view) before the input was bounded at the edge."""

from __future__ import annotations

import pytest
from django.test import Client

from portal.actors import Actor
from portal.models import StaffScope, User
from portal.staff_tokens import staff_token_create
from tests.metering.conftest import H100
from tests.portal.conftest import signed_in  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db


def deep(levels: int) -> bytes:
    return b'{"a":' * levels + b"1" + b"}" * levels


def no_raise(client: Client) -> Client:
    """Let a 500 come back as a response, so that the test sees the status, not the exception."""
    client.raise_request_exception = False
    return client


@pytest.fixture
def staff(db) -> User:
    return User.objects.create_user(email="ops@gpupool.test", password="pw-for-tests-1", is_staff=True)


@pytest.mark.parametrize(
    "url", ["/api/v1/instances/", "/api/v1/jobs/", "/api/v1/cost-estimate/", "/api/v1/tokens/"]
)
def test_json_nested_deeper_than_the_limit_is_a_400_on_every_api_post(tenant, make_token, api, url):
    client = no_raise(api(make_token(tenant)))
    # Positive control: the same route parses a shallow body (a 400 about its fields, not its JSON).
    shallow = client.post(url, b'{"a": {"b": 1}}', content_type="application/json")
    assert shallow.status_code == 400
    assert "JSON" not in shallow.json()["error"]["message"]
    for levels in (1_025, 5_000):
        response = client.post(url, deep(levels), content_type="application/json")
        assert response.status_code == 400, (levels, response.content[:300])
        assert "nested more than 1024 levels" in response.json()["error"]["message"]
    # Just under the limit the body parses, and the route refuses its fields as any other.
    assert client.post(url, deep(1_000), content_type="application/json").status_code == 400


def test_a_filter_date_that_leaves_the_calendar_in_utc_is_a_400(tenant, make_token, api):
    client = no_raise(api(make_token(tenant)))
    assert client.get("/api/v1/jobs/", {"submitted_after": "2024-01-01T00:00:00+01:00"}).status_code == 200
    for value in ("0001-01-01T00:00:00+23:59", "9999-12-31T23:59:59-23:59", "1900-01-01T00:00:00Z"):
        response = client.get("/api/v1/jobs/", {"submitted_after": value})
        assert response.status_code == 400, (value, response.content[:300])
        assert "submitted_after" in response.json()["error"]["fields"]
    # Date filters made from model fields are bounded too.
    response = client.get("/api/v1/invoices/", {"period_start": "0001-01-01"})
    assert response.status_code == 400 and "period_start" in response.json()["error"]["fields"]


def test_a_usage_page_month_out_of_range_is_a_400_naming_it(signed_in, owner, tenant):  # noqa: F811
    client = no_raise(signed_in(owner, tenant))
    assert client.get("/billing/usage/", {"month": "2024-03"}).status_code == 200
    for month in ("9999-12", "0001-01", "2024-13"):
        response = client.get("/billing/usage/", {"month": month})
        assert response.status_code == 400, (month, response.status_code)
        assert b"YYYY-MM" in response.content


@pytest.mark.parametrize("path", ["revenue/", "gpu-hours/"])  # receivables take no months
def test_a_staff_finance_month_out_of_range_is_a_400_naming_it(staff, path):
    _, plaintext = staff_token_create(
        user=staff, name="ro", scopes=[StaffScope.FINANCE_READ], actor=Actor(user=staff)
    )
    client = no_raise(Client(HTTP_AUTHORIZATION=f"Bearer {plaintext}"))
    url = f"/api/staff/v1/finance/{path}"
    assert client.get(url, {"end": "2024-03"}).status_code == 200
    for params in ({"end": "9999-12"}, {"start": "9999-12"}, {"start": "0001-01", "end": "0001-12"}):
        response = client.get(url, params)
        assert response.status_code == 400, (params, response.content[:300])
        assert set(response.json()["error"]["fields"]) & set(params)


@pytest.mark.parametrize("path", ["", "gpu-hours/"])
def test_a_staff_finance_page_month_out_of_range_is_a_400(signed_in, staff, path):  # noqa: F811
    client = no_raise(signed_in(staff))
    url = f"/staff/finance/{path}"
    assert client.get(url, {"end": "2024-03"}).status_code == 200
    response = client.get(url, {"end": "9999-12"})
    assert response.status_code == 400, response.status_code
    assert b"YYYY-MM" in response.content


def test_a_cost_estimate_whose_quantities_overflow_is_a_400_naming_them(tenant, make_token, api, card):
    client = no_raise(api(make_token(tenant)))
    ok = client.post("/api/v1/cost-estimate/", {"gpu_model": H100, "cpu_millicores": 4000, "ram_mib": 8192})
    assert ok.status_code == 200, ok.content
    huge = 10**40
    for field in ("cpu_millicores", "ram_mib"):
        response = client.post("/api/v1/cost-estimate/", {"gpu_model": H100, field: huge})
        assert response.status_code == 400, (field, response.content[:300])
        assert field in response.json()["error"]["fields"]
