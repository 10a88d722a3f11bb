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
