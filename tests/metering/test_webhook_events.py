"""Metering's events reach webhook endpoints: invoice finalized, paid and overdue, budget alerts;
recorded in the transaction of the change (delivery itself: tests/webhooks/)."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest

from metering.models import Budget, Invoice, InvoiceStatus
from metering.money import quantize_money
from metering.services.budgets import budget_alert_fire
from metering.services.invoices import invoice_mark_paid, invoice_run
from metering.services.payments import dunning_run
from portal.actors import Actor
from tests.metering.conftest import utc
from webhooks.models import WebhookDelivery, WebhookEvent
from webhooks.services.endpoints import endpoint_create

MARCH = date(2024, 3, 1)


@pytest.fixture(autouse=True)
def _no_cycle_tasks(settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False


@pytest.fixture
def hook(tenant, settings):
    settings.WEBHOOK_ALLOW_LOOPBACK = True

    def make(types):
        return endpoint_create(
            tenant=tenant, url="http://127.0.0.1:9/hook", event_types=list(types), actor=Actor.system()
        )[0]

    return make


def _events(type_: str) -> list[dict]:
    return [e.payload for e in WebhookEvent.objects.filter(type=type_).order_by("id")]


def test_an_invoice_finalized_paid_and_overdue(tenant, card, run, hook):
    endpoint = hook(["invoice.finalized", "invoice.paid", "invoice.overdue"])
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 1))
    invoice_run(period_start=MARCH, now=utc(2024, 4, 5))
    invoice = Invoice.objects.get(tenant=tenant, period_start=MARCH)
    assert invoice.status == InvoiceStatus.FINALIZED
    [finalized] = _events("invoice.finalized")
    assert finalized["invoice_id"] == invoice.pk and finalized["status"] == "finalized"
    assert (
        finalized["total"] == str(quantize_money(invoice.total, "USD")) == "2.00"
    )  # at the currency's places
    assert finalized["currency"] == "USD" and finalized["period"] == "2024-03"
    assert finalized["due_at"] == invoice.due_at.isoformat() and finalized["number"].startswith("INV-202403-")
    # Past its due date: the team is warned (grace), then suspended; each is an overdue event.
    dunning_run(now=utc(2024, 4, 20))
    dunning_run(now=utc(2024, 4, 20, 12))  # a rerun changes nothing and announces nothing
    dunning_run(now=utc(2024, 4, 27))
    overdue = _events("invoice.overdue")
    assert [(e["invoice_id"], e["tenant_status"]) for e in overdue] == [
        (invoice.pk, "grace"),
        (invoice.pk, "suspended"),
    ]
    invoice_mark_paid(invoice=invoice, actor=Actor.system(), now=utc(2024, 4, 28))
    [paid] = _events("invoice.paid")
    assert paid["invoice_id"] == invoice.pk and paid["status"] == "paid"
    assert WebhookDelivery.objects.filter(endpoint=endpoint).count() == 4


def test_a_budget_alert(tenant, hook):
    hook(["budget.alert"])
    budget = Budget.objects.create(tenant=tenant, monthly_limit=Decimal("100"))
    now = utc(2024, 3, 10)
    assert budget_alert_fire(budget=budget, threshold=80, amount=Decimal("81.5"), currency="USD", now=now)
    assert (
        budget_alert_fire(budget=budget, threshold=80, amount=Decimal("82"), currency="USD", now=now) is None
    )
    [alert] = _events("budget.alert")
    assert alert["threshold"] == 80 and alert["amount"] == "81.50" and alert["monthly_limit"] == "100.00"
    assert alert["period"] == "2024-03"


def test_workload_events_do_not_reach_a_billing_only_endpoint(tenant, card, run, hook):
    endpoint = hook(["invoice.finalized"])
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 1))
    assert not WebhookDelivery.objects.filter(endpoint=endpoint).exists()
    assert WebhookEvent.objects.filter(type="workload.state").count() == 0
