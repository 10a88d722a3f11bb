"""Budgets: the cost to date every minute (recorded usage plus running allocations, priced as their
records will be), alerts once per month and threshold (audited, e-mailed, pushed live), the API and
the dashboard panel."""

from datetime import timedelta
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.core import mail
from django.utils import timezone

from metering import tasks
from metering.models import Budget, BudgetAlert, CostToDate, SpotPrice
from metering.periods import period_of
from metering.selectors.shared import month_cost_to_date
from metering.services.budgets import costs_to_date_update
from metering.services.usage import costs_to_date, usage_build
from portal.events import tenant_group
from portal.models import AuditEvent, Membership, Role
from portal.services.accounts import user_get_or_create
from scheduling.models import Plan
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db


def test_cost_to_date_is_recorded_usage_plus_what_running_allocations_accrued(
    tenant, make_tenant, card, run, reserve, node, h100
):
    now = utc(2024, 3, 5, 1, 30)
    run(tenant, utc(2024, 3, 1, 0), utc(2024, 3, 1, 2))  # recorded: 2 h x 2.00 = 4.00
    run(tenant, utc(2024, 3, 5, 0), None)  # running 1.5 h on-demand: 3.00
    run(tenant, utc(2024, 2, 28, 0), None)  # running since February: only March counts, 97.5 h: 195.00
    spot = run(tenant, utc(2024, 3, 5, 0), None, plan=Plan.SPOT)
    SpotPrice.objects.create(
        gpu_model=h100,
        region=node.region,
        at=utc(2024, 3, 5, 1),
        price=Decimal("1.2"),
        floor=Decimal("0.8"),
        on_demand=Decimal("2"),
        utilisation=Decimal("0.5"),
    )  # spot: 1 h at 0.80 (the card), then 0.5 h at the market's 1.20 = 1.40
    r = reserve(tenant, utc(2024, 3, 1), utc(2024, 4, 1))
    run(tenant, utc(2024, 3, 5, 1), None, plan=Plan.RESERVED, reservation=r)  # covered by the fee
    run(make_tenant("other"), utc(2024, 3, 1), utc(2024, 3, 1, 1))
    usage_build(since=utc(2024, 1, 1), now=now)
    # The reservation's fee so far (1-month term: 1.50 x 730 h a month, to the second of 31 days).
    fee = Decimal("1.50") * 730 * Decimal((now - utc(2024, 3, 1)).total_seconds()) / Decimal(31 * 86400)
    expected = Decimal("4") + Decimal("3") + Decimal("195") + Decimal("1.4") + fee
    assert abs(costs_to_date(tenant_ids=[tenant.pk], now=now)[tenant.pk] - expected) < Decimal("1e-9")
    assert abs(month_cost_to_date(tenant=tenant, now=now) - expected) < Decimal("1e-9")
    # February's completed month was recorded (final), and is not part of March's cost.
    assert abs(costs_to_date(now=now)[tenant.pk] - expected) < Decimal("1e-9")
    assert spot.ended_at is None


def _member(tenant, email, role):
    user, _ = user_get_or_create(email=email, password="pw-for-tests-1")
    Membership.objects.create(tenant=tenant, user=user, role=role)


def test_alerts_fire_once_per_month_and_threshold_audited_mailed_and_live(
    tenant, card, run, django_capture_on_commit_callbacks
):
    _member(tenant, "money@acme.test", Role.BILLING)
    _member(tenant, "dev@acme.test", Role.MEMBER)
    Budget.objects.create(tenant=tenant, monthly_limit=Decimal("10"))  # default thresholds 50/80/100
    run(tenant, utc(2024, 3, 1, 0), None)  # 2.00 per hour
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(tenant_group(tenant.pk, "billing"), channel)  # amounts: billing only

    with django_capture_on_commit_callbacks(execute=True):
        costs_to_date_update(now=utc(2024, 3, 1, 2))  # 4.00: 40 %, nothing
    assert BudgetAlert.objects.count() == 0 and mail.outbox == []
    row = CostToDate.objects.get(tenant=tenant)
    assert row.amount == Decimal("4") and row.as_of == utc(2024, 3, 1, 2) and row.currency == "USD"

    with django_capture_on_commit_callbacks(execute=True):
        costs_to_date_update(now=utc(2024, 3, 1, 4, 30))  # 9.00: 50 % and 80 %
        costs_to_date_update(now=utc(2024, 3, 1, 4, 31))  # again: nothing new
    assert list(BudgetAlert.objects.values_list("threshold", "amount")) == [
        (50, Decimal("9.00")),
        (80, Decimal("9.00")),
    ]
    assert len(mail.outbox) == 2
    # owners and billing members (the billing address is the owner's here); not plain members
    assert sorted(mail.outbox[0].to) == ["money@acme.test", "owner@acme.test"]
    assert "50%" in mail.outbox[0].subject and "9.00 USD" in mail.outbox[0].body
    audited = AuditEvent.objects.filter(tenant=tenant, action="budget.alert").order_by("pk")
    assert [e.data["threshold"] for e in audited] == [50, 80]
    events = [async_to_sync(layer.receive)(channel)["event"] for _ in range(2)]
    assert [(e["type"], e["threshold"], e["amount"]) for e in events] == [
        ("budget.alert", 50, "9.00"),
        ("budget.alert", 80, "9.00"),
    ]

    tasks.costs_to_date_update.run()  # the beat task runs today: a new month, nothing of March re-sent
    assert BudgetAlert.objects.filter(period_start="2024-03-01").count() == 2
    with django_capture_on_commit_callbacks(execute=True):
        costs_to_date_update(now=utc(2024, 3, 1, 5, 0))  # 10.00: 100 %
    assert BudgetAlert.objects.filter(period_start="2024-03-01").count() == 3 and len(mail.outbox) >= 3


def test_thresholds_are_per_budget_and_a_new_month_starts_again(tenant, card, run):
    Budget.objects.create(tenant=tenant, monthly_limit=Decimal("4"), alert_thresholds=[25, 150])
    run(tenant, utc(2024, 3, 31, 22), utc(2024, 4, 1, 2))  # 2 h in March, 2 h in April
    costs_to_date_update(now=utc(2024, 4, 1, 3))  # April: 4.00 = 100 %
    assert list(BudgetAlert.objects.values_list("period_start", "threshold")) == [
        (utc(2024, 4, 1).date(), 25)
    ]
    assert CostToDate.objects.get(tenant=tenant).amount == Decimal("4")


def test_the_beat_runs_it_every_minute():
    entry = settings.CELERY_BEAT_SCHEDULE["metering-costs-to-date"]
    assert entry["task"] == "metering.tasks.costs_to_date_update"
    assert entry["schedule"] <= timedelta(minutes=1)


def test_budget_api_shows_cost_to_date_and_sets_the_budget_with_4xx_on_bad_input(
    tenant, card, run, make_token, api
):
    run(tenant, utc(2024, 3, 1, 0), utc(2024, 3, 1, 3))  # 6.00, but in March 2024
    billing = api(make_token(tenant, scopes=["read", "billing"]))
    reader = api(make_token(tenant, scopes=["read"]))
    assert reader.get("/api/v1/budget/").status_code == 403
    body = billing.get("/api/v1/budget/").json()
    assert body["monthly_limit"] is None and body["percent"] is None and body["currency"] == "USD"
    assert body["amount"] == "0.00"  # nothing this (real) month

    put = billing.put(
        "/api/v1/budget/",
        {"monthly_limit": "500", "hard_limit": True, "alert_thresholds": [90, 50]},
        content_type="application/json",
    )
    assert put.status_code == 200, put.content
    assert put.json()["monthly_limit"] == "500.00" and put.json()["alert_thresholds"] == [50, 90]
    budget = Budget.objects.get(tenant=tenant)
    assert budget.hard_limit and budget.alert_thresholds == [50, 90]
    assert AuditEvent.objects.filter(tenant=tenant, action="budget.set").exists()

    for bad, field in (
        ({"monthly_limit": "-1"}, "monthly_limit"),
        ({"monthly_limit": "lots"}, "monthly_limit"),
        ({"monthly_limit": "5", "alert_thresholds": [0]}, "alert_thresholds"),
        ({"monthly_limit": "5", "alert_thresholds": "80"}, "alert_thresholds"),
    ):
        r = billing.put("/api/v1/budget/", bad, content_type="application/json")
        assert r.status_code == 400 and field in r.json()["error"]["fields"], (bad, r.content)
    assert Budget.objects.get(tenant=tenant).monthly_limit == Decimal("500")

    now = timezone.now()
    CostToDate.objects.create(
        tenant=tenant, period_start=period_of(now), amount=Decimal("125.004"), as_of=now
    )
    body = billing.get("/api/v1/budget/").json()
    assert body["amount"] == "125.00" and body["percent"] == "25.0" and body["hard_limit"] is True


def test_the_dashboard_shows_the_cost_panel_to_billing_members(client, tenant, owner, card):
    Budget.objects.create(tenant=tenant, monthly_limit=Decimal("200"))
    client.force_login(owner)
    page = client.get("/")
    assert page.status_code == 200 and b"/panels/budget/" in page.content
    panel = client.get("/panels/budget/", HTTP_HX_REQUEST="true")
    assert panel.status_code == 200
    assert b"data-cost-to-date" in panel.content and b"200.00 USD" in panel.content
    assert b"every 60s" in panel.content
    full = client.get("/panels/budget/")
    assert full.status_code == 200 and b"Cost this month" in full.content

    _member(tenant, "dev@acme.test", Role.MEMBER)
    client.force_login(Membership.objects.get(tenant=tenant, role=Role.MEMBER).user)
    assert b"/panels/budget/" not in client.get("/").content
    assert client.get("/panels/budget/", HTTP_HX_REQUEST="true").status_code == 403


def test_a_budget_with_junk_thresholds_alerts_at_the_defaults_and_others_still_run(
    tenant, make_tenant, card, run
):
    other = make_tenant("other")
    Budget.objects.create(tenant=tenant, monthly_limit=Decimal("2"), alert_thresholds=["x", None])
    Budget.objects.create(tenant=other, monthly_limit=Decimal("2"))
    run(tenant, utc(2024, 3, 1, 0), utc(2024, 3, 1, 1))  # 2.00 = 100 %
    run(other, utc(2024, 3, 1, 0), utc(2024, 3, 1, 1))
    costs_to_date_update(now=utc(2024, 3, 1, 2))
    for t in (tenant, other):
        assert list(BudgetAlert.objects.filter(tenant=t).values_list("threshold", flat=True)) == [50, 80, 100]
