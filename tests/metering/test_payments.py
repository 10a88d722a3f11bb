"""Payment providers (manual, Stripe against a local server), Stripe webhooks and dunning."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from datetime import date, timedelta
from decimal import Decimal

import pytest
import stripe
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from metering import tasks
from metering.models import BillingAccount, Invoice, InvoiceStatus, StripeEvent
from metering.money import to_minor_units
from metering.services.invoices import invoice_build, invoice_finalize, invoice_mark_paid, invoice_run
from metering.services.payments import dunning_run, invoice_payment_submit
from metering.services.usage import usage_build
from portal.actors import Actor
from portal.models import AuditEvent, Tenant
from portal.services.tenants import tenant_set_status
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db
MARCH = date(2024, 3, 1)
from tests.metering.conftest import STRIPE_WEBHOOK_SECRET as SECRET  # noqa: E402

URL = "/webhooks/stripe/"


# --- money in minor units ---------------------------------------------------------------------


def test_minor_units_for_usd_jpy_and_bhd():
    assert to_minor_units(Decimal("12.34"), "USD") == 1234
    assert to_minor_units(Decimal("-0.05"), "usd") == -5
    assert to_minor_units(Decimal("1234"), "JPY") == 1234
    assert to_minor_units(Decimal("1234.000"), "JPY") == 1234  # the database keeps 3 places
    assert to_minor_units(Decimal("1.234"), "BHD") == 1234
    with pytest.raises(ValueError, match="JPY"):
        to_minor_units(Decimal("1234.5"), "JPY")
    with pytest.raises(ValueError, match="USD"):
        to_minor_units(Decimal("0.005"), "USD")
    with pytest.raises(TypeError):
        to_minor_units(12.34, "USD")


@given(
    cents=st.integers(min_value=-(10**12), max_value=10**12), currency=st.sampled_from(["USD", "JPY", "BHD"])
)
def test_minor_units_round_trip(cents, currency):
    places = {"USD": 2, "JPY": 0, "BHD": 3}[currency]
    assert to_minor_units(Decimal(cents).scaleb(-places), currency) == cents


# --- fixtures ---------------------------------------------------------------------------------


def counter(event_type: str, result: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "gpupool_stripe_webhooks_total", {"event_type": event_type, "result": result}
        )
        or 0.0
    )


def sign(payload: str, *, secret: str = SECRET, at: int | None = None) -> str:
    at = int(time.time()) if at is None else at
    mac = hmac.new(secret.encode(), f"{at}.{payload}".encode(), hashlib.sha256).hexdigest()
    return f"t={at},v1={mac}"


def event(event_id: str, event_type: str, obj: dict, **extra) -> str:
    body = {
        "id": event_id,
        "object": "event",
        "api_version": stripe.api_version,
        "created": int(time.time()),
        "livemode": False,
        "type": event_type,
        "data": {"object": obj, **extra},
    }
    return json.dumps(body)


def deliver(client, payload: str, signature: str | None = None):
    return client.post(
        URL, payload, content_type="application/json", HTTP_STRIPE_SIGNATURE=signature or sign(payload)
    )


# --- providers --------------------------------------------------------------------------------


def test_manual_provider_sends_nothing_and_finance_marks_paid(finalized, django_capture_on_commit_callbacks):
    assert finalized.payment_provider == "manual" and finalized.due_at == utc(2024, 4, 19)
    assert invoice_payment_submit(invoice_id=finalized.pk).external_id == ""
    paid = invoice_mark_paid(invoice=finalized, actor=Actor.system(), now=utc(2024, 4, 10))
    assert paid.status == InvoiceStatus.PAID
    assert AuditEvent.objects.get(action="invoice.paid").data == {"total": "2.64"}


def test_stripe_customer_invoice_items_and_finalize_with_idempotency_keys(
    tenant, card, run, stripe_api, django_capture_on_commit_callbacks
):
    BillingAccount.objects.create(tenant=tenant, tax_rate_percent=Decimal("10"))
    run(tenant, utc(2024, 3, 1), utc(2024, 3, 1, 1))
    run(tenant, utc(2024, 3, 2), utc(2024, 3, 2, 0, 30), plan="spot")
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    draft = invoice_build(tenant=tenant, period_start=MARCH, now=utc(2024, 4, 1))
    with django_capture_on_commit_callbacks() as callbacks:
        invoice = invoice_finalize(invoice=draft, actor=Actor.system(), now=utc(2024, 4, 5))
    # After commit: the submit task, and the invoice.finalized live event.
    assert len(callbacks) == 2 and invoice.payment_provider == "stripe"
    assert stripe_api.requests == []

    assert tasks.invoice_payment_submit.run(invoice.pk) == "in_test2"
    customer, created, *items, final = stripe_api.requests
    assert (customer.method, customer.path) == ("POST", "/v1/customers")
    assert customer.headers["Idempotency-Key"] == f"gpupool-customer-{tenant.pk}"
    assert customer.headers["Authorization"] == "Bearer sk_test_gpupool"
    assert customer.one("email") == tenant.billing_email and customer.one(
        "metadata[gpupool_tenant_id]"
    ) == str(tenant.pk)
    assert created.path == "/v1/invoices"
    assert created.headers["Idempotency-Key"] == f"gpupool-invoice-{invoice.pk}-1-create"
    assert {k: created.one(k) for k in ("customer", "currency", "collection_method", "auto_advance")} == {
        "customer": "cus_test1",
        "currency": "usd",
        "collection_method": "charge_automatically",
        "auto_advance": "false",
    }
    assert created.one("metadata[gpupool_invoice_id]") == str(invoice.pk)
    assert [(i.path, i.one("amount"), i.one("currency"), i.one("invoice")) for i in items] == [
        ("/v1/invoiceitems", "200", "usd", "in_test2"),  # on-demand 2.00
        ("/v1/invoiceitems", "40", "usd", "in_test2"),  # spot 0.40
        ("/v1/invoiceitems", "24", "usd", "in_test2"),  # tax 10 %
    ]
    assert [i.headers["Idempotency-Key"] for i in items] == [
        f"gpupool-invoice-{invoice.pk}-1-item-{n}" for n in (1, 2, 3)
    ]
    assert sum(int(i.one("amount")) for i in items) == to_minor_units(invoice.total, "USD") == 264
    assert (final.path, final.one("auto_advance")) == ("/v1/invoices/in_test2/finalize", "true")
    assert final.headers["Idempotency-Key"] == f"gpupool-invoice-{invoice.pk}-1-finalize"

    invoice.refresh_from_db()
    assert invoice.external_id == "in_test2" and invoice.payment_attempt == 1
    assert BillingAccount.objects.get(tenant=tenant).stripe_customer_id == "cus_test1"
    assert (
        AuditEvent.objects.filter(action="invoice.payment_submitted", target_id=str(invoice.pk)).count() == 1
    )
    tasks.invoice_payment_submit.run(invoice.pk)  # again: already submitted, nothing sent
    assert len(stripe_api.requests) == 6


def test_a_failed_submission_is_retried_with_the_same_keys_and_the_customer_is_reused(
    stripe_api, finalized, tenant, card, run
):
    stripe_api.fail_next("POST", "/v1/invoices/", status=400)  # the finalize call is refused once
    with pytest.raises(stripe.InvalidRequestError):
        invoice_payment_submit(invoice_id=finalized.pk)
    finalized.refresh_from_db()
    assert finalized.external_id == "" and finalized.payment_attempt == 1
    first = [r.headers["Idempotency-Key"] for r in stripe_api.posts("/v1/")]
    invoice_payment_submit(invoice_id=finalized.pk)
    second = [r.headers["Idempotency-Key"] for r in stripe_api.posts("/v1/")][len(first) :]
    assert first[0] == f"gpupool-customer-{tenant.pk}"
    assert second == first[1:]  # the same invoice, items and finalize keys; the customer is stored
    assert len(stripe_api.invoices) == 1 and len(stripe_api.customers) == 1  # replayed, not duplicated
    finalized.refresh_from_db()
    assert finalized.external_id == "in_test2" and stripe_api.invoices["in_test2"]["status"] == "open"

    # April's invoice: the customer exists, so no customer call is made.
    run(tenant, utc(2024, 4, 1), utc(2024, 4, 1, 1))
    invoice_run(period_start=date(2024, 4, 1), now=utc(2024, 5, 5))
    april = Invoice.objects.get(tenant=tenant, period_start=date(2024, 4, 1))
    n = len(stripe_api.customers)
    invoice_payment_submit(invoice_id=april.pk)
    assert len(stripe_api.customers) == n and len(stripe_api.posts("/v1/customers")) == 1


def test_a_jpy_invoice_is_sent_in_whole_yen(stripe_api, tenant, card, run):
    BillingAccount.objects.create(tenant=tenant, tax_rate_percent=Decimal("10"))
    run(tenant, utc(2024, 4, 1), utc(2024, 4, 1, 3))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 5, 1))
    draft = invoice_build(tenant=tenant, period_start=date(2024, 4, 1), now=utc(2024, 5, 1))
    Invoice.objects.filter(pk=draft.pk).update(currency="JPY")
    draft = invoice_build(tenant=tenant, period_start=date(2024, 4, 1), now=utc(2024, 5, 1))
    invoice = invoice_finalize(invoice=draft, actor=Actor.system(), now=utc(2024, 5, 5))
    assert invoice.total == Decimal("7")  # 6.00 rounded to 6 yen, tax 0.6 -> 1 yen (half-up per line)
    invoice_payment_submit(invoice_id=invoice.pk)
    items = stripe_api.posts("/v1/invoiceitems")
    assert [(i.one("amount"), i.one("currency")) for i in items] == [("6", "jpy"), ("1", "jpy")]


# --- webhooks ---------------------------------------------------------------------------------


def _stripe_paid(state, stripe_id: str, at: int = 1712700000) -> dict:
    inv = state.invoices[stripe_id]
    inv.update(status="paid", amount_paid=inv["amount_due"], attempt_count=1)
    inv["status_transitions"]["paid_at"] = at
    return inv


def test_a_signed_invoice_paid_event_pays_the_invoice_once(client, submitted, stripe_api):
    ok = counter("invoice.paid", "ok")
    obj = _stripe_paid(stripe_api, submitted.external_id)
    payload = event("evt_paid_1", "invoice.paid", obj)
    response = deliver(client, payload)
    assert response.status_code == 200 and response.json() == {"received": True, "result": "ok"}
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.PAID and submitted.paid_at == utc(2024, 4, 9, 22, 0)
    audit = AuditEvent.objects.get(action="invoice.paid")
    assert audit.data["event"] == "evt_paid_1" and audit.data["provider"] == "stripe"
    assert counter("invoice.paid", "ok") == ok + 1
    fetched = [r for r in stripe_api.requests if r.method == "GET"]
    assert [r.path for r in fetched] == [f"/v1/invoices/{submitted.external_id}"]

    again = deliver(client, payload)  # Stripe redelivers the same event
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert StripeEvent.objects.filter(event_id="evt_paid_1").count() == 1
    assert AuditEvent.objects.filter(action="invoice.paid").count() == 1
    assert len([r for r in stripe_api.requests if r.method == "GET"]) == 1


def test_tampered_stale_and_unsigned_deliveries_are_refused_and_change_nothing(
    client, submitted, stripe_api, settings
):
    obj = _stripe_paid(stripe_api, submitted.external_id)
    payload = event("evt_x", "invoice.paid", obj)
    bad = counter("unknown", "bad_signature")
    tampered = payload.replace('"livemode": false', '"livemode": true')
    assert tampered != payload
    stale = sign(payload, at=int(time.time()) - 301)  # past the 300 s tolerance
    wrong_secret = sign(payload, secret="whsec_other")
    for body, signature in (
        (tampered, sign(payload)),
        (payload, stale),
        (payload, wrong_secret),
        (payload, ""),
    ):
        response = (
            deliver(client, body, signature)
            if signature
            else client.post(URL, body, content_type="application/json")
        )
        assert response.status_code == 400, response.content
        assert response.json()["error"]["code"] == "bad_signature"
    settings.STRIPE_WEBHOOK_SECRET = ""  # no secret: nothing can be trusted
    assert deliver(client, payload, sign(payload, secret="")).status_code == 400
    assert counter("unknown", "bad_signature") == bad + 5
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.FINALIZED and submitted.paid_at is None
    assert not StripeEvent.objects.exists() and not AuditEvent.objects.filter(action="invoice.paid").exists()
    assert [r for r in stripe_api.requests if r.method == "GET"] == []
    assert client.get(URL).status_code == 405


def test_events_out_of_order_never_unpay_an_invoice(client, submitted, stripe_api):
    sid = submitted.external_id
    failed_first = dict(stripe_api.invoices[sid], status="open", attempt_count=1)
    # A failure while the invoice is open at Stripe: recorded, nothing else.
    assert deliver(client, event("evt_fail_1", "invoice.payment_failed", failed_first)).status_code == 200
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.FINALIZED
    assert AuditEvent.objects.get(action="invoice.payment_failed").data["stripe_status"] == "open"

    # The retry succeeded; then an older failure event arrives late (its snapshot says "open").
    paid = _stripe_paid(stripe_api, sid)
    assert deliver(client, event("evt_paid_2", "invoice.paid", paid)).status_code == 200
    late = event("evt_fail_0", "invoice.payment_failed", failed_first)
    assert deliver(client, late).status_code == 200
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.PAID and submitted.paid_at == utc(2024, 4, 9, 22, 0)
    assert AuditEvent.objects.filter(action="invoice.payment_failed").count() == 1
    assert StripeEvent.objects.count() == 3


def test_a_paid_event_whose_invoice_stripe_still_shows_open_changes_nothing(client, submitted, stripe_api):
    snapshot = dict(stripe_api.invoices[submitted.external_id], status="paid")  # the event says paid...
    assert deliver(client, event("evt_paid_3", "invoice.paid", snapshot)).status_code == 200
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.FINALIZED  # ...but the current object is open


def test_a_failure_to_fetch_stores_nothing_so_the_redelivery_is_processed(client, submitted, stripe_api):
    failed = counter("invoice.paid", "failed")
    obj = _stripe_paid(stripe_api, submitted.external_id)
    payload = event("evt_paid_4", "invoice.paid", obj)
    stripe_api.fail_next("GET", "/v1/invoices/", status=404)
    response = deliver(client, payload)
    assert response.status_code == 503 and response.json()["error"]["code"] == "webhook_failed"
    assert counter("invoice.paid", "failed") == failed + 1
    assert not StripeEvent.objects.exists()
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.FINALIZED
    assert deliver(client, payload).status_code == 200
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.PAID


def test_unknown_objects_and_customer_events(client, submitted, stripe_api, tenant):
    # Objects gpupool does not know are kept and alerted (tests/metering/test_stripe_answers.py).
    other = event("evt_other", "invoice.paid", {"id": "in_elsewhere", "object": "invoice", "metadata": {}})
    assert deliver(client, other).json()["result"] == "unmatched"
    assert (
        deliver(client, event("evt_charge", "charge.refunded", {"id": "ch_1"})).json()["result"]
        == "unmatched"
    )
    assert deliver(client, event("evt_plan", "plan.created", {"id": "plan_1"})).json()["result"] == "ignored"
    cus = BillingAccount.objects.get(tenant=tenant).stripe_customer_id
    updated = event(
        "evt_cus_1",
        "customer.updated",
        {"id": cus, "object": "customer"},
        previous_attributes={"email": "a@b"},
    )
    assert deliver(client, updated).json()["result"] == "ok"
    assert AuditEvent.objects.get(action="billing.stripe_customer_updated").data["changed"] == ["email"]
    deleted = event("evt_cus_2", "customer.deleted", {"id": cus, "object": "customer"})
    assert deliver(client, deleted).json()["result"] == "ok"
    assert BillingAccount.objects.get(tenant=tenant).stripe_customer_id == ""


def test_the_webhook_counter_is_exported_with_its_labels(client, submitted, stripe_api):
    deliver(client, event("evt_metric", "charge.refunded", {"id": "ch_2"}))
    text = client.get("/metrics").content.decode()
    assert 'gpupool_stripe_webhooks_total{event_type="charge.refunded",result="ok"}' in text


# --- dunning ----------------------------------------------------------------------------------


def test_an_overdue_invoice_suspends_the_tenant_and_paying_it_reactivates(finalized, tenant):
    # Due 19 April (14 days after finalization): in grace from then, suspended 7 days later.
    assert dunning_run(now=utc(2024, 4, 18, 23)) == []
    assert [t.status for t in dunning_run(now=utc(2024, 4, 25, 23))] == [Tenant.Status.GRACE]
    assert [t.pk for t in dunning_run(now=utc(2024, 4, 26))] == [tenant.pk]
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.SUSPENDED
    assert tenant.suspended_reason == f"Unpaid invoice #{finalized.pk} for 2024-03 (2.64 USD), due 2024-04-19"
    assert AuditEvent.objects.filter(action="tenant.suspend", target_id=str(tenant.pk)).count() == 1
    assert AuditEvent.objects.get(action="invoice.dunning_suspend").target_id == str(finalized.pk)
    assert dunning_run(now=utc(2024, 4, 27)) == []  # safe to run twice

    invoice_mark_paid(invoice=finalized, actor=Actor.system(), now=utc(2024, 4, 28))
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.ACTIVE and tenant.suspended_reason == ""
    assert AuditEvent.objects.filter(action="tenant.reactivate").count() == 1
    assert dunning_run(now=utc(2024, 5, 30)) == []


def test_paying_reactivates_only_when_it_was_the_reason(finalized, tenant, run):
    run(tenant, utc(2024, 4, 1), utc(2024, 4, 1, 1))
    invoice_run(period_start=date(2024, 4, 1), now=utc(2024, 5, 5))
    april = Invoice.objects.get(tenant=tenant, period_start=date(2024, 4, 1))
    dunning_run(now=utc(2024, 5, 30))  # both overdue: the oldest is named
    tenant.refresh_from_db()
    assert tenant.suspended_reason.startswith(f"Unpaid invoice #{finalized.pk} ")
    invoice_mark_paid(invoice=april, actor=Actor.system(), now=utc(2024, 5, 30))
    tenant.refresh_from_db()
    assert tenant.suspended_reason.startswith(f"Unpaid invoice #{finalized.pk} ")  # not the reason
    invoice_mark_paid(invoice=finalized, actor=Actor.system(), now=utc(2024, 5, 30))
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.ACTIVE

    tenant_set_status(tenant=tenant, status=Tenant.Status.SUSPENDED, reason="abuse", actor=Actor.system())
    run(tenant, utc(2024, 5, 1), utc(2024, 5, 1, 1))
    invoice_run(period_start=date(2024, 5, 1), now=utc(2024, 6, 5))
    may = Invoice.objects.get(tenant=tenant, period_start=date(2024, 5, 1))
    assert dunning_run(now=utc(2024, 7, 1)) == []  # already suspended, for another reason
    invoice_mark_paid(invoice=may, actor=Actor.system(), now=utc(2024, 7, 1))
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.SUSPENDED and tenant.suspended_reason == "abuse"


def test_the_stripe_payment_of_an_overdue_invoice_reactivates_the_tenant(
    client, submitted, stripe_api, tenant
):
    dunning_run(now=submitted.due_at + timedelta(days=8))
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.SUSPENDED
    obj = _stripe_paid(stripe_api, submitted.external_id)
    assert deliver(client, event("evt_paid_5", "invoice.paid", obj)).status_code == 200
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.ACTIVE


def test_the_dunning_beat_task(finalized, tenant, settings):
    assert settings.CELERY_BEAT_SCHEDULE["metering-dunning"]["task"] == "metering.tasks.dunning_run"
    assert tasks.dunning_run.run() == 1  # the invoice is long overdue by now
    assert tasks.dunning_run.run() == 0
