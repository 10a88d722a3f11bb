"""The dashboard's billing panels: the cost chart (cost to date by day against the budget) and
"Needs attention" (budget alerts this month, unpaid invoices, grace or suspension): the numbers, the
tenant's own data only, the billing scope, query counts and server time."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from metering.models import Budget, BudgetAlert, CostToDate, Invoice, InvoiceStatus, UsageRecord
from metering.money import HOUR, quantize_money
from metering.periods import next_period, period_bounds, period_of
from metering.services.budgets import costs_to_date_update
from metering.services.usage import usage_build
from portal.models import Role, Tenant
from tests.portal.conftest import HTMX, add_member, signed_in  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db
D = Decimal
BUDGET, ALERTS = "/panels/budget/", "/panels/alerts/"


@pytest.fixture
def client(signed_in, owner, tenant):  # noqa: F811
    return signed_in(owner, tenant)


def fastest(client, url: str, tries: int = 3) -> float:
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        assert client.get(url, **HTMX).status_code == 200
        times.append(time.perf_counter() - start)
    return min(times)


def chart_points(html: str) -> list[tuple[str, str]]:
    """(day label, value) of every point of the spend chart."""
    chart = html.split("data-spend-chart>")[1].split("</svg>")[0]
    assert '<svg class="chart chart-line"' in chart and "<polyline" in chart
    return re.findall(r"<circle [^>]*><title>([^:<]+): ([\d,.]+) USD</title></circle>", chart)


# --- the cost chart ------------------------------------------------------------------------------------


def test_the_chart_is_the_cost_to_date_by_day_and_ends_at_the_figure_shown(client, tenant, card, run):
    now = timezone.now()
    month_start = period_bounds(period_of(now))[0]
    # a finished job at the start of the month (at most an hour, all on day 1) and one still running
    took = min(timedelta(hours=1), (now - month_start) / 2)
    run(tenant, month_start, month_start + took)
    run(tenant, max(month_start + took, now - timedelta(hours=1)), None)
    usage_build(tenant=tenant, since=month_start, now=now)
    costs_to_date_update(now=now)
    recorded = sum(r.amount for r in UsageRecord.objects.filter(tenant=tenant, period_start=period_of(now)))
    assert recorded == D(2) * D((took).total_seconds()) / HOUR
    shown = CostToDate.objects.get(tenant=tenant).amount
    assert shown > recorded  # the running job counts

    html = client.get(BUDGET, **HTMX).content.decode()
    points = chart_points(html)
    assert [label for label, _ in points] == [f"{d} {now:%b}" for d in range(1, now.day + 1)]
    values = [D(v.replace(",", "")) for _, v in points]
    assert values[:-1] == [quantize_money(recorded, "USD")] * (now.day - 1)
    assert values[-1] == quantize_money(shown, "USD")
    assert f"data-cost-to-date>{quantize_money(shown, 'USD')} USD<" in html
    assert "data-level" not in html  # no budget, no budget line

    Budget.objects.create(tenant=tenant, monthly_limit=D("10"))
    html = client.get(BUDGET, **HTMX).content.decode()
    assert re.search(r"<line data-level [^>]*><title>Budget: 10\.00 USD</title></line>", html)
    assert len(chart_points(html)) == now.day


def test_the_chart_shows_this_tenants_cost_only(client, tenant, make_tenant, card, run):
    now = timezone.now()
    other = make_tenant("bravo")
    month_start = period_bounds(period_of(now))[0]
    run(other, month_start, month_start + min(timedelta(hours=1), (now - month_start) / 2))
    usage_build(since=month_start, now=now)
    costs_to_date_update(now=now)
    values = {v for _, v in chart_points(client.get(BUDGET, **HTMX).content.decode())}
    assert values == {"0.00"}


def test_the_cost_panel_needs_the_billing_scope(tenant, signed_in, add_member, card):  # noqa: F811
    for role, allowed in ((Role.BILLING, True), (Role.MEMBER, False), (Role.VIEWER, False)):
        client = signed_in(add_member(tenant, role).user, tenant)
        assert client.get(BUDGET, **HTMX).status_code == (200 if allowed else 403), role
        assert client.get(ALERTS, **HTMX).status_code == (200 if allowed else 403), role
        dashboard = client.get("/").content.decode()
        assert ('hx-get="/panels/alerts/"' in dashboard) is allowed
        assert ('hx-get="/panels/budget/"' in dashboard) is allowed


def test_the_cost_panel_with_a_month_of_records_is_fast_and_reads_few_queries(
    client, tenant, card, run, django_assert_max_num_queries
):
    now = timezone.now()
    month_start = period_bounds(period_of(now))[0]
    a = run(tenant, month_start, month_start + timedelta(minutes=1))
    template = {
        "tenant": tenant, "allocation": a, "workload_id": a.workload_id, "gpu_model_id": a.gpu_model_id,
        "region_id": a.node.region_id, "plan": "on_demand", "period_start": period_of(now),
        "version": card.versions.get(), "fraction_milli": 1000, "unit_price": D(2),
    }  # fmt: skip
    span = (now - month_start) / 5000
    rows = []
    for i in range(5000):
        s = month_start + span * i
        secs = D(int(span.total_seconds()))
        rows.append(
            UsageRecord(
                start=s, end=s + span, seconds=secs, gpu_seconds=secs, amount=secs * 2 / HOUR, **template
            )
        )
    UsageRecord.objects.bulk_create(rows)
    Budget.objects.create(tenant=tenant, monthly_limit=D("100000"))
    costs_to_date_update(now=now)
    with django_assert_max_num_queries(14):
        html = client.get(BUDGET, **HTMX).content.decode()
    assert len(chart_points(html)) == now.day
    elapsed = fastest(client, BUDGET)
    print(f"cost panel, {len(rows):,} records: {elapsed * 1000:.0f} ms")
    assert elapsed < 0.3


# --- needs attention ----------------------------------------------------------------------------------


def invoice(tenant, months_ago: int, status, due_in_days: int | None, total="120.50") -> Invoice:
    start = period_of(timezone.now())
    for _ in range(months_ago):
        start = period_of(period_bounds(start)[0] - timedelta(days=1))
    now = timezone.now()
    return Invoice.objects.create(
        tenant=tenant, period_start=start, period_end=next_period(start), status=status, total=D(total),
        finalized_at=now, due_at=None if due_in_days is None else now + timedelta(days=due_in_days),
    )  # fmt: skip


def test_needs_attention_lists_budget_alerts_unpaid_invoices_and_grace(client, tenant, make_tenant):
    other = make_tenant("bravo")
    period = period_of(timezone.now())
    last_month = period_of(period_bounds(period)[0] - timedelta(days=1))
    for t, p, threshold in ((tenant, period, 50), (tenant, period, 80), (tenant, last_month, 100),
                            (other, period, 100)):  # fmt: skip
        BudgetAlert.objects.create(
            tenant=t, period_start=p, threshold=threshold, amount=D("90.00"), monthly_limit=D("100.00")
        )
    overdue = invoice(tenant, 2, InvoiceStatus.FINALIZED, -3, total="250.00")
    due = invoice(tenant, 1, InvoiceStatus.FINALIZED, 10)
    invoice(tenant, 3, InvoiceStatus.PAID, -40)
    invoice(tenant, 0, InvoiceStatus.DRAFT, None)
    theirs = invoice(other, 1, InvoiceStatus.FINALIZED, -3, total="999.00")

    html = re.sub(r"\s+", " ", client.get(ALERTS, **HTMX).content.decode())
    assert re.findall(r'data-alert="budget" data-threshold="(\d+)"', html) == ["80", "50"]
    assert "80% of the monthly budget reached" in html and "90.00 of 100.00 USD" in html
    assert re.findall(r'data-invoice="(\d+)"', html) == [str(overdue.pk), str(due.pk)]
    assert f'data-invoice="{overdue.pk}" data-overdue>' in html
    assert f'data-invoice="{due.pk}">' in html
    assert "250.00 USD unpaid" in html and "120.50 USD unpaid" in html
    due_on = f"{overdue.due_at.day} {overdue.due_at:%b %Y}"  # the owner's time zone is UTC
    assert f'due <time datetime="{overdue.due_at:%Y-%m-%dT%H:%M:%S}' in html and f">{due_on}</time>" in html
    assert 'href="/billing/invoices/"' in html
    assert "999.00" not in html and str(theirs.pk) not in re.findall(r'data-invoice="(\d+)"', html)
    assert 'data-alert="tenant"' not in html and "data-all-well" not in html

    Tenant.objects.filter(pk=tenant.pk).update(
        status=Tenant.Status.GRACE, suspended_reason="The invoice for October is 3 days overdue."
    )
    html = client.get(ALERTS, **HTMX).content.decode()
    assert 'data-alert="tenant"' in html and "Payment overdue." in html
    assert "The invoice for October is 3 days overdue." in html


def test_needs_attention_says_all_is_well_when_nothing_is_wrong(client, tenant, make_tenant):
    other = make_tenant("bravo")
    BudgetAlert.objects.create(
        tenant=other, period_start=period_of(timezone.now()), threshold=100, amount=D(1), monthly_limit=D(1)
    )
    invoice(other, 1, InvoiceStatus.FINALIZED, -3)
    invoice(tenant, 1, InvoiceStatus.PAID, -3)
    html = client.get(ALERTS, **HTMX).content.decode()
    assert "data-all-well" in html and "All is well" in html and "data-alert" not in html
    # first on the dashboard (the lowest order) for whoever may see it
    dashboard = client.get("/").content.decode()
    assert re.findall(r'hx-get="([^"]+)" hx-trigger="load"', dashboard)[0] == ALERTS


def test_needs_attention_reads_few_queries_and_is_fast(client, tenant, django_assert_max_num_queries):
    for months_ago in range(1, 25):
        invoice(tenant, months_ago, InvoiceStatus.FINALIZED, -months_ago * 30)
    for threshold in (50, 80, 100, 120):
        BudgetAlert.objects.create(
            tenant=tenant, period_start=period_of(timezone.now()), threshold=threshold, amount=D(1),
            monthly_limit=D(1),
        )  # fmt: skip
    with django_assert_max_num_queries(6):
        html = client.get(ALERTS, **HTMX).content.decode()
    assert html.count('data-alert="invoice"') == 24 and html.count('data-alert="budget"') == 4
    elapsed = fastest(client, ALERTS)
    print(f"needs attention: {elapsed * 1000:.0f} ms")
    assert elapsed < 0.3
