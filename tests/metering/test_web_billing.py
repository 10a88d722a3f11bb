"""The tenant's usage, reservations, budget and invoices pages: tenant scoping, the numbers against
the usage records and the rate card, inline errors naming the field, roles, query counts and
server time with a month of usage."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from metering.models import Budget, CreditKind, UsageRecord
from metering.money import HOUR, quantize_money
from metering.periods import period_bounds, period_of
from metering.services.invoices import credit_grant
from metering.services.usage import usage_build
from portal.actors import Actor
from portal.models import AuditEvent, Membership, Role
from scheduling.models import Reservation, ReservationStatus
from tests.metering.conftest import H100, utc
from tests.portal.conftest import HTMX, add_member, signed_in  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db
D = Decimal


@pytest.fixture
def client(signed_in, owner, tenant):  # noqa: F811
    return signed_in(owner, tenant)


@pytest.fixture
def as_role(signed_in, add_member, tenant):  # noqa: F811
    """``as_role(role)``: a client signed in as a new member of ``tenant`` with ``role``."""
    return lambda role: signed_in(add_member(tenant, role).user, tenant)


def fastest(client, url: str, data=None, tries: int = 3) -> float:
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        assert client.get(url, data or {}).status_code == 200
        times.append(time.perf_counter() - start)
    return min(times)


def text(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


# --- usage ----------------------------------------------------------------------------------------------


def test_usage_page_numbers_equal_the_usage_records(client, tenant, card, run):
    # Two jobs in March 2024: one within a day, one from 22:00 on the 3rd to 02:00 on the 5th.
    run(tenant, utc(2024, 3, 2, 10), utc(2024, 3, 2, 12))
    run(tenant, utc(2024, 3, 3, 22), utc(2024, 3, 5, 2), fraction_milli=500)
    usage_build(tenant=tenant, since=utc(2024, 1, 1), now=utc(2024, 4, 2))
    records = UsageRecord.objects.filter(tenant=tenant, period_start="2024-03-01")
    gpu_s = sum(r.gpu_seconds for r in records)
    amount = sum(r.amount for r in records)
    assert gpu_s == D(7200 + 28 * 3600 / 2)
    html = text(client.get("/billing/usage/", {"month": "2024-03"}))
    hours = (gpu_s / HOUR).quantize(D("0.001"))
    assert f"data-usage-gpu-hours>{hours}<" in html
    assert f"data-usage-cost>{quantize_money(amount, 'USD')} USD<" in html
    assert f'{hours}</td><td class="num">{gpu_s:.0f}</td>' in html
    # by day: the 2nd has 2 GPU-hours; the long job's half GPU: 1 h on the 3rd, 12 h on the 4th, 1 h on the 5th
    days = html.split("data-usage-days")[1]
    for label, gh, cost in (("Sat 2 Mar", "2.000", "4.00"), ("Sun 3 Mar", "1.000", "2.00"),
                            ("Mon 4 Mar", "12.000", "24.00"), ("Tue 5 Mar", "1.000", "2.00")):  # fmt: skip
        assert f'>{label}</th><td>{H100}</td><td class="num">{gh}</td><td class="num">{cost} USD</td>' in days
    assert html.count('<svg class="chart"') == 2
    # another month: nothing, and an empty state that says what to do
    empty = text(client.get("/billing/usage/", {"month": "2024-05"}))
    assert "No usage recorded in May 2024" in empty and "Choose another month" in empty


def test_usage_month_must_be_a_month(client):
    response = client.get("/billing/usage/", {"month": "2024-13"})
    assert response.status_code == 400
    assert "month: Use a month as YYYY-MM" in text(response)


def test_usage_page_shows_cost_to_date_and_the_budget_this_month(client, tenant, owner, card, run):
    now = timezone.now()
    start = max(period_bounds(period_of(now))[0], now - timedelta(hours=3))
    run(tenant, start, start + timedelta(hours=1))
    usage_build(tenant=tenant, now=now)
    Budget.objects.create(tenant=tenant, monthly_limit=D("10.00"))
    html = text(client.get("/billing/usage/"))
    assert "data-cost-to-date>2.00 USD<" in html
    assert "data-budget-percent>20.0% of 10.00 USD<" in html
    assert "No monthly budget yet" not in html


def test_usage_is_the_tenants_own(client, tenant, make_tenant, card, run):
    other = make_tenant("bravo")
    run(other, utc(2024, 3, 2, 10), utc(2024, 3, 2, 12))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 2))
    html = text(client.get("/billing/usage/", {"month": "2024-03"}))
    assert "No usage recorded in March 2024" in html and "data-usage-gpu-hours>0.000<" in html


def test_usage_page_with_a_month_of_usage_is_fast_and_reads_few_queries(
    client, tenant, card, run, django_assert_max_num_queries
):
    # A month of a busy tenant: 5,000 records over March (one allocation cut into segments: what the
    # page reads is the records), some crossing midnight
    a = run(tenant, utc(2024, 3, 1), utc(2024, 3, 31))
    template = {
        "tenant": tenant, "allocation": a, "workload_id": a.workload_id, "gpu_model_id": a.gpu_model_id,
        "region_id": a.node.region_id, "plan": "on_demand", "period_start": utc(2024, 3, 1).date(),
        "version": card.versions.get(), "fraction_milli": 1000, "unit_price": D(2),
    }  # fmt: skip
    rows = []
    for i in range(5000):
        s = utc(2024, 3, 1) + timedelta(minutes=8 * i)
        e = s + timedelta(minutes=7 if i % 10 else 180)
        secs = D((e - s).total_seconds())
        rows.append(
            UsageRecord(start=s, end=e, seconds=secs, gpu_seconds=secs, amount=secs * 2 / HOUR, **template)
        )
    UsageRecord.objects.bulk_create(rows)
    total = sum(r.amount for r in rows)
    with django_assert_max_num_queries(12):
        html = text(client.get("/billing/usage/", {"month": "2024-03"}))
    assert f"data-usage-cost>{quantize_money(total, 'USD'):,} USD<" in html
    elapsed = fastest(client, "/billing/usage/", {"month": "2024-03"})
    print(f"usage page, {len(rows):,} records: {elapsed * 1000:.0f} ms")
    assert elapsed < 0.3, f"usage page took {elapsed * 1000:.0f} ms"
    for url in ("/billing/usage/", "/billing/budget/", "/billing/invoices/", "/billing/reservations/"):
        elapsed = fastest(client, url)  # the other pages (and this month) beside those records
        print(f"{url}: {elapsed * 1000:.0f} ms")
        assert elapsed < 0.3, f"{url} took {elapsed * 1000:.0f} ms"


# --- reservations ---------------------------------------------------------------------------------------


def reserve_form(**overrides):
    return {"gpu_model": H100, "count": "2", "region": "us-east-1", "term": "6", **overrides}


def test_the_quote_comes_from_the_rate_card(client, card, region, settings):
    # H100 reserved 1.50/h, on demand 2.00/h; a 6-month term is 10% off
    response = client.get("/billing/reservations/quote/", reserve_form(), **HTMX)
    assert response.status_code == 200
    html = text(response)
    per_gpu = D("1.50") * 730 * D("0.9")  # 985.50
    monthly, total = per_gpu * 2, per_gpu * 2 * 6
    on_demand = D("2.00") * 730 * 2 * 6
    assert f'data-quote="monthly">{monthly:.2f} USD<' in html
    assert f'data-quote="total"><strong>{total:.2f} USD</strong>' in html
    assert f'data-quote="on-demand">{on_demand:.2f} USD<' in html
    assert f'data-quote="saving"><strong>{on_demand - total:.2f} USD</strong> (32.5%)' in html
    assert "10% off for 6 months" in html


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("count", "0", "greater than or equal to 1"),
        ("gpu_model", "NVIDIA Z9000", "Unknown GPU model NVIDIA Z9000."),
        ("term", "2", "Choose a term of 1, 3, 6, 12 months; 2 is not one."),
        ("region", "mars-1", "Unknown region mars-1."),
    ],
)
def test_bad_input_is_an_inline_4xx_naming_the_field(client, tenant, card, region, field, value, message):
    for data in (reserve_form(**{field: value}), reserve_form(**{field: value}, confirm="1")):
        response = client.post("/billing/reservations/", data)
        assert response.status_code == 400
        html = text(response)
        assert f'id="id_{field}_error">' in html and message in html.split(f'id="id_{field}_error">')[1][:200]
    quote = client.get("/billing/reservations/quote/", reserve_form(**{field: value}), **HTMX)
    assert quote.status_code == 400 and "Correct the form to see the price" in text(quote)
    assert not Reservation.objects.exists()


def test_buy_review_then_confirm_through_the_service(client, tenant, card, region):
    review = client.post("/billing/reservations/", reserve_form())
    assert review.status_code == 200 and not Reservation.objects.exists()
    html = text(review)
    assert "Confirm purchase" in html and 'name="confirm" value="1"' in html
    assert 'data-quote="saving"' in html
    done = client.post("/billing/reservations/", reserve_form(confirm="1"))
    assert done.status_code == 302 and done["Location"] == "/billing/reservations/"
    r = Reservation.objects.get()
    assert (r.tenant, r.count, r.gpu_model.name, r.region.code, r.status) == (
        tenant, 2, H100, "us-east-1", ReservationStatus.REQUESTED
    )  # fmt: skip
    assert r.ends_at.month == (r.starts_at.month + 5) % 12 + 1
    assert AuditEvent.objects.filter(tenant=tenant, action="reservation.request").count() == 1
    listing = text(client.get("/billing/reservations/"))
    assert f'id="reservation-{r.pk}"' in listing and "Requested" in listing and "requested: 2 x" in listing
    # a request may be withdrawn
    assert client.post(f"/billing/reservations/{r.pk}/cancel/").status_code == 302
    r.refresh_from_db()
    assert r.status == ReservationStatus.CANCELLED


def test_empty_reservations_say_what_to_do(client, card, region):
    html = text(client.get("/billing/reservations/"))
    assert "No reservations yet" in html and "Reserve GPUs with the form" in html
    assert 'data-quote="monthly"' in html  # the first model's price before any change


def test_another_tenants_reservation_and_invoice_do_not_exist(client, make_tenant, h100, region, card):
    other = make_tenant("bravo")
    r = Reservation.objects.create(
        tenant=other,
        gpu_model=h100,
        region=region,
        count=3,
        starts_at=utc(2030, 1, 1),
        ends_at=utc(2030, 2, 1),
    )
    from metering.services.invoices import invoice_build

    inv = invoice_build(tenant=other, period_start=utc(2024, 3, 1).date())
    for headers in ({}, HTMX):
        assert client.post(f"/billing/reservations/{r.pk}/cancel/", **headers).status_code == 404
        assert client.get(f"/billing/invoices/{inv.pk}/csv/", **headers).status_code == 404
    r.refresh_from_db()
    assert r.status == ReservationStatus.REQUESTED
    assert f'id="reservation-{r.pk}"' not in text(client.get("/billing/reservations/"))
    assert "bravo" not in text(client.get("/billing/invoices/")).lower()


# --- roles ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", [Role.VIEWER, Role.MEMBER])
def test_without_the_billing_scope_nothing_is_bought_or_set(as_role, tenant, card, region, role):
    c = as_role(role)
    assert c.post("/billing/reservations/", reserve_form(confirm="1")).status_code == 403
    assert c.post("/billing/budget/", {"monthly_limit": "5", "alert_thresholds": "50"}).status_code == 403
    for url in ("/billing/usage/", "/billing/reservations/", "/billing/budget/", "/billing/invoices/"):
        assert c.get(url).status_code == 403, url
    assert not Reservation.objects.exists() and not Budget.objects.exists()
    nav = text(c.get("/"))
    assert 'href="/billing/usage/"' not in nav and 'href="/billing/budget/"' not in nav


def test_a_billing_member_buys_and_sets_the_budget(as_role, tenant, card, region):
    c = as_role(Role.BILLING)
    nav = text(c.get("/"))
    for href in ("/billing/usage/", "/billing/reservations/", "/billing/budget/", "/billing/invoices/"):
        assert f'href="{href}"' in nav
    assert c.post("/billing/reservations/", reserve_form(confirm="1")).status_code == 302
    assert c.post("/billing/budget/", {"monthly_limit": "5", "alert_thresholds": "80"}).status_code == 302
    assert Reservation.objects.count() == 1 and Budget.objects.get(tenant=tenant).alert_thresholds == [80]


# --- budget ---------------------------------------------------------------------------------------------


def test_budget_form_sets_the_budget_through_the_audited_service(client, tenant, owner):
    response = client.post(
        "/billing/budget/",
        {"monthly_limit": "1500.50", "alert_thresholds": "90, 50 ,100", "limit_action": "refuse"},
    )
    assert response.status_code == 302
    b = Budget.objects.get(tenant=tenant)
    assert (b.monthly_limit, b.hard_limit, b.alert_thresholds) == (D("1500.50"), True, [50, 90, 100])
    audit = AuditEvent.objects.get(tenant=tenant, action="budget.set")
    assert audit.actor_user == owner
    html = text(client.get("/billing/budget/"))
    assert 'value="1500.50"' in html
    assert 'value="50, 90, 100"' in html and "0.0% of 1500.50 USD (refuses new work)" in html


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"monthly_limit": "-1", "alert_thresholds": "50"}, "monthly_limit", "greater than or equal to 0"),
        ({"monthly_limit": "abc", "alert_thresholds": "50"}, "monthly_limit", "Enter a number."),
        ({"monthly_limit": "10", "alert_thresholds": "50, 2000"}, "alert_thresholds", "between 1 and 1000"),
        (
            {"monthly_limit": "10", "alert_thresholds": "fifty"},
            "alert_thresholds",
            "'fifty' is not a whole percent",
        ),
    ],
)
def test_bad_budget_input_is_inline_and_writes_nothing(client, tenant, data, field, message):
    response = client.post("/billing/budget/", data)
    assert response.status_code == 400
    html = text(response)
    assert f'id="id_{field}_error">' in html
    assert message in html.split(f'id="id_{field}_error">')[1][:200].replace("&#x27;", "'")
    assert not Budget.objects.exists() and not AuditEvent.objects.filter(action="budget.set").exists()


# --- invoices: payment status and credits -----------------------------------------------------------------


def test_invoices_show_payment_status_and_credits(client, tenant, owner, card, run):
    run(tenant, utc(2024, 3, 2, 10), utc(2024, 3, 2, 12))
    usage_build(tenant=tenant, since=utc(2024, 1, 1), now=utc(2024, 4, 2))
    credit_grant(
        tenant=tenant, kind=CreditKind.PROMOTIONAL, amount="1.50", note="welcome", actor=Actor.system()
    )
    from metering.services.invoices import invoice_build, invoice_finalize

    inv = invoice_build(tenant=tenant, period_start=utc(2024, 3, 1).date(), now=utc(2024, 4, 2))
    inv = invoice_finalize(invoice=inv, actor=Actor.system(), now=utc(2024, 4, 5))
    html = text(client.get("/billing/invoices/"))
    assert "Overdue" in html or "Awaiting payment" in html
    assert "welcome" in html and f"Applied to invoice #{inv.pk}" in html
    assert "data-credit-total>0.00 USD<" in html
    assert "-1.50 USD" in html


def test_credit_ledger_is_paginated_with_few_queries(client, tenant, django_assert_max_num_queries):
    for i in range(45):
        credit_grant(
            tenant=tenant, kind=CreditKind.PREPAID, amount="1", note=f"topup-{i}", actor=Actor.system()
        )
    with django_assert_max_num_queries(12):
        html = text(client.get("/billing/invoices/"))
    assert html.count("topup-") == 20 and "Page 1 of 3" in html and "data-credit-total>45.00 USD<" in html
    assert text(client.get("/billing/invoices/", {"credits_page": 3})).count("topup-") == 5


def test_reservations_and_budget_pages_read_few_queries(
    client, tenant, card, region, h100, django_assert_max_num_queries
):
    for i in range(30):
        Reservation.objects.create(
            tenant=tenant, gpu_model=h100, region=region, count=i + 1,
            starts_at=utc(2030, 1, 1), ends_at=utc(2030, 7, 1), status=ReservationStatus.ACTIVE,
        )  # fmt: skip
    with django_assert_max_num_queries(20):  # a fixed number: the rate card and the quote
        html = text(client.get("/billing/reservations/"))
    assert len(re.findall(r'id="reservation-\d+"', html)) == 25 and "Page 1 of 2" in html
    with django_assert_max_num_queries(15):  # the cost to date: usage, storage, reservations, accrual
        assert client.get("/billing/budget/").status_code == 200
    assert Membership.objects.filter(tenant=tenant).count() == 1
