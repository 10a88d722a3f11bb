"""Budget alerts and the invoice run raced on PostgreSQL (SQLite serialises writers)."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest
from django.core import mail

from metering.models import Budget, BudgetAlert, Invoice, InvoiceLine
from metering.services.budgets import costs_to_date_update
from metering.services.invoices import invoice_run
from metering.services.usage import usage_build
from tests.conftest import postgres_only
from tests.metering.conftest import utc
from tests.races import together

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _postgres_only():
    postgres_only("concurrent writers")


def test_parallel_cost_updates_send_each_alert_once(tenant, card, run):
    Budget.objects.create(tenant=tenant, monthly_limit=Decimal("10"))
    run(tenant, utc(2024, 3, 1, 0), utc(2024, 3, 1, 4, 30))  # 9.00: 50 % and 80 %
    assert together(lambda: costs_to_date_update(now=utc(2024, 3, 1, 5))) == []
    assert sorted(BudgetAlert.objects.values_list("threshold", flat=True)) == [50, 80]
    assert len(mail.outbox) == 2


def test_parallel_invoice_runs_make_one_invoice_per_tenant_with_the_same_lines(make_tenant, card, run):
    tenants = [make_tenant(f"race{i}") for i in range(6)]
    for i, t in enumerate(tenants):
        run(t, utc(2024, 3, 2), utc(2024, 3, 2, 1 + i))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    errors = together(lambda: invoice_run(period_start=date(2024, 3, 1), now=utc(2024, 4, 1)))
    assert errors == []
    assert Invoice.objects.count() == 6
    totals = dict(Invoice.objects.values_list("tenant__slug", "total"))
    assert totals == {f"race{i}": Decimal(2 * (1 + i)) for i in range(6)}
    assert InvoiceLine.objects.count() == 6


def test_parallel_submissions_cannot_pass_a_budget_together(tenant, card, node, make_token):
    """Four real HTTP requests at once, each estimated at 1.00 (an H100 for half an hour) against a
    budget of 1.50 that refuses: exactly one is admitted."""
    from django.test import Client

    from metering.models import BudgetLimitAction
    from scheduling.models import Workload
    from tests.metering.conftest import H100

    Budget.objects.create(tenant=tenant, monthly_limit=Decimal("1.50"), limit_action=BudgetLimitAction.REFUSE)
    token = make_token(tenant)
    statuses: list[int] = []

    def submit():
        response = Client(HTTP_AUTHORIZATION=f"Bearer {token}").post(
            "/api/v1/jobs/",
            {"image": "ghcr.io/acme/train:1", "command": ["x"], "gpu_models": [H100], "max_runtime_s": 1800},
            content_type="application/json",
        )
        statuses.append(response.status_code)

    assert together(submit) == []
    assert sorted(statuses) == [201, 403, 403, 403], statuses
    assert Workload.objects.filter(tenant=tenant).count() == 1
