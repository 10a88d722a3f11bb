"""Invoices that reach Stripe (the sweeper) and Stripe's answers that reach us (void, uncollectible,
refunds, disputes, checked payments, unknown objects), with the real stripe library against the
local server (tests/metering/stripe_server.py)."""

from __future__ import annotations

import random
from datetime import timedelta
from decimal import Decimal

import pytest

from metering import tasks
from metering.models import (
    BillingAccount,
    BillingAlert,
    CreditEntry,
    CreditNote,
    Invoice,
    InvoiceStatus,
    StripeEvent,
)
from metering.payments.stripe import ProviderFailed, StripeProvider
from metering.services.invoices import credit_grant, invoice_run, invoice_void
from metering.services.payments import dunning_run, invoice_payment_submit, invoice_payments_sweep
from portal.actors import Actor
from portal.errors import Conflict
from portal.models import AuditEvent, Tenant
from tests.metering.conftest import utc
from tests.metering.test_payments import MARCH, deliver, event

pytestmark = pytest.mark.django_db


def _alerts(kind: str) -> list[BillingAlert]:
    return list(BillingAlert.objects.filter(kind=kind, resolved_at__isnull=True))


def _sweep_after(invoice: Invoice, minutes: int = 11):
    return invoice_payments_sweep(now=invoice.finalized_at + timedelta(minutes=minutes))


# --- the sweeper ------------------------------------------------------------------------------


def test_a_lost_enqueue_is_swept_and_sent(stripe_api, finalized):
    # Finalized with the stripe provider; its on-commit submission never ran.
    assert finalized.payment_provider == "stripe" and finalized.external_id == ""
    assert invoice_payments_sweep(now=finalized.finalized_at + timedelta(minutes=5)) == {
        "sent": [],
        "retry": [],
        "failed": [],
    }  # too early: its own task may still be on the way
    assert stripe_api.requests == []
    assert _sweep_after(finalized)["sent"] == [finalized.pk]
    finalized.refresh_from_db()
    assert finalized.external_id == "in_test2" and stripe_api.invoices["in_test2"]["status"] == "open"
    assert _sweep_after(finalized) == {"sent": [], "retry": [], "failed": []}  # nothing left to send
    assert len(stripe_api.invoices) == 1


def test_the_sweeper_adopts_what_a_crashed_submission_sent_after_its_keys_expired(stripe_api, finalized):
    Invoice.objects.filter(pk=finalized.pk).update(payment_provider="stripe", payment_attempt=1)
    finalized.refresh_from_db()
    sent = StripeProvider().collect(invoice=finalized)  # sent, then the worker died before saving the id
    stripe_api.by_key.clear()  # a day later: Stripe no longer remembers the idempotency keys
    assert _sweep_after(finalized, minutes=60 * 25)["sent"] == [finalized.pk]
    finalized.refresh_from_db()
    assert finalized.external_id == sent.external_id and len(stripe_api.invoices) == 1  # no second bill
    audit = AuditEvent.objects.get(action="invoice.payment_submitted")
    assert audit.data["adopted"] is True


def test_the_sweeper_syncs_an_adopted_invoice_already_paid(stripe_api, finalized):
    Invoice.objects.filter(pk=finalized.pk).update(payment_provider="stripe", payment_attempt=1)
    finalized.refresh_from_db()
    sent = StripeProvider().collect(invoice=finalized)
    stripe_api.pay(sent.external_id)  # paid at Stripe; its webhook found no id here
    _sweep_after(finalized)
    finalized.refresh_from_db()
    assert finalized.status == InvoiceStatus.PAID and finalized.external_id == sent.external_id


def test_a_draft_left_at_stripe_is_deleted_and_sent_again_under_new_keys(stripe_api, finalized):
    Invoice.objects.filter(pk=finalized.pk).update(payment_provider="stripe")
    stripe_api.fail_next("POST", "/v1/invoices/", status=400)  # the finalize call is refused
    with pytest.raises(Exception, match="test failure"):
        invoice_payment_submit(invoice_id=finalized.pk)
    assert [i["status"] for i in stripe_api.invoices.values()] == ["draft"]
    draft = next(iter(stripe_api.invoices))
    stripe_api.by_key.clear()
    assert _sweep_after(finalized)["sent"] == [finalized.pk]
    finalized.refresh_from_db()
    assert stripe_api.deleted == [draft] and finalized.payment_attempt == 2
    assert [i["status"] for i in stripe_api.invoices.values()] == ["open"]
    keys = [r.headers["Idempotency-Key"] for r in stripe_api.posts("/v1/invoices")]
    assert keys[-1] == f"gpupool-invoice-{finalized.pk}-2-finalize"


def test_a_refused_submission_alerts_staff_keeps_dunning_off_and_resolves_when_sent(
    stripe_api, finalized, tenant
):
    Invoice.objects.filter(pk=finalized.pk).update(payment_provider="stripe")
    stripe_api.fail_next("POST", "/v1/customers", status=400, code="parameter_invalid_string")
    assert _sweep_after(finalized)["failed"] == [finalized.pk]
    (alert,) = _alerts(BillingAlert.Kind.SUBMISSION_FAILED)
    assert alert.invoice_id == finalized.pk and "refused it" in alert.message
    # Never presented to the customer: dunning does not suspend the tenant for it.
    assert dunning_run(now=finalized.due_at + timedelta(days=30)) == []
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.ACTIVE

    assert _sweep_after(finalized)["sent"] == [finalized.pk]
    assert _alerts(BillingAlert.Kind.SUBMISSION_FAILED) == []
    assert [t.pk for t in dunning_run(now=finalized.due_at + timedelta(days=30))] == [tenant.pk]


def test_open_billing_alerts_are_exported_for_prometheus(client, stripe_api, finalized):
    from metering.metrics import _cache

    _cache.clear()
    line = 'gpupool_billing_alerts_open{kind="submission_failed"}'
    assert f"{line} 0.0" in client.get("/metrics").content.decode()
    stripe_api.fail_next("POST", "/v1/customers", status=400, code="parameter_invalid_string")
    _sweep_after(finalized)
    _cache.clear()  # the figure is cached for a minute
    assert f"{line} 1.0" in client.get("/metrics").content.decode()


def test_transient_errors_alert_only_once_the_invoice_is_late(stripe_api, finalized, settings):
    Invoice.objects.filter(pk=finalized.pk).update(payment_provider="stripe")
    for _ in range(3):  # the library's own retries see 429s too
        stripe_api.fail_next("POST", "/v1/customers", status=429, code="rate_limit")
    assert _sweep_after(finalized)["retry"] == [finalized.pk]
    assert _alerts(BillingAlert.Kind.SUBMISSION_FAILED) == []
    for _ in range(3):
        stripe_api.fail_next("POST", "/v1/customers", status=429, code="rate_limit")
    late = settings.METERING_PAYMENT_SUBMIT_ALERT_AFTER_S // 60 + 1
    assert _sweep_after(finalized, minutes=late)["retry"] == [finalized.pk]
    (alert,) = _alerts(BillingAlert.Kind.SUBMISSION_FAILED)
    assert "still unreachable" in alert.message and alert.data["transient"] is True


def test_a_sent_invoice_whose_state_cannot_be_read_counts_as_sent(stripe_api, finalized):
    stripe_api.fail_next("GET", "/v1/invoices/", status=404)  # the read after sending fails
    assert _sweep_after(finalized)["sent"] == [finalized.pk]
    finalized.refresh_from_db()
    assert finalized.external_id == "in_test2" and finalized.status == InvoiceStatus.FINALIZED


def test_manual_invoices_are_not_swept(finalized):
    assert finalized.payment_provider == "manual" and finalized.external_id == ""
    assert _sweep_after(finalized) == {"sent": [], "retry": [], "failed": []}
    finalized.refresh_from_db()
    assert finalized.payment_attempt == 0


# --- voiding ----------------------------------------------------------------------------------


def test_voiding_here_voids_at_stripe_first(submitted, stripe_api, tenant):
    credit_grant(tenant=tenant, kind="promotional", amount="1", actor=Actor.system())
    invoice_void(invoice=submitted, actor=Actor.system(), reason="billed twice")
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.VOID
    assert stripe_api.invoices[submitted.external_id]["status"] == "void"
    void_call = stripe_api.posts(f"/v1/invoices/{submitted.external_id}/void")
    assert len(void_call) == 1


def test_an_invoice_paid_at_stripe_is_not_voided(submitted, stripe_api):
    stripe_api.pay(submitted.external_id)
    with pytest.raises(Conflict, match="paid at Stripe"):
        invoice_void(invoice=submitted, actor=Actor.system(), reason="oops")
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.FINALIZED


def test_a_stripe_error_while_voiding_leaves_the_invoice_finalized(submitted, stripe_api):
    stripe_api.fail_next("POST", f"/v1/invoices/{submitted.external_id}/void", status=400)
    with pytest.raises(ProviderFailed, match="test failure"):
        invoice_void(invoice=submitted, actor=Actor.system(), reason="oops")
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.FINALIZED


def test_the_admin_void_action_voids_at_stripe_and_reports_a_refusal(admin_client, submitted, stripe_api):
    url = "/admin/metering/invoice/"
    stripe_api.fail_next("POST", f"/v1/invoices/{submitted.external_id}/void", status=400)
    response = admin_client.post(url, {"action": "void", "_selected_action": [submitted.pk]}, follow=True)
    assert response.status_code == 200 and "Stripe did not void" in response.content.decode()
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.FINALIZED
    response = admin_client.post(url, {"action": "void", "_selected_action": [submitted.pk]}, follow=True)
    assert response.status_code == 200
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.VOID
    assert stripe_api.invoices[submitted.external_id]["status"] == "void"


def test_the_sweeper_task(stripe_api, finalized):
    assert tasks.invoice_payments_sweep.run() == {"sent": 1, "retry": 0, "failed": 0}  # long overdue
    assert tasks.invoice_payments_sweep.run() == {"sent": 0, "retry": 0, "failed": 0}


# --- Stripe's answers -------------------------------------------------------------------------


def test_invoice_voided_at_stripe_voids_ours(client, submitted, stripe_api):
    stripe_api.invoices[submitted.external_id]["status"] = "void"
    obj = stripe_api.invoices[submitted.external_id]
    assert deliver(client, event("evt_void", "invoice.voided", obj)).json()["result"] == "ok"
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.VOID
    assert AuditEvent.objects.get(action="invoice.void").data == {"reason": "voided at Stripe"}


def test_marked_uncollectible_flags_the_invoice_and_it_stays_owed(client, submitted, stripe_api, tenant):
    inv = stripe_api.invoices[submitted.external_id]
    inv["status"] = "uncollectible"
    inv["status_transitions"]["marked_uncollectible_at"] = 1714000000
    assert deliver(client, event("evt_unc", "invoice.marked_uncollectible", inv)).json()["result"] == "ok"
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.FINALIZED and submitted.uncollectible_at == utc(
        2024, 4, 24, 23, 6, 40
    )
    assert [t.pk for t in dunning_run(now=submitted.due_at + timedelta(days=8))] == [tenant.pk]


def test_a_refund_becomes_a_credit_note_once_and_no_prepaid_credit(client, submitted, stripe_api):
    charge = stripe_api.pay(submitted.external_id)
    deliver(client, event("evt_paid", "invoice.paid", stripe_api.invoices[submitted.external_id]))
    stripe_api.refund(charge["id"], 100)
    first = event("evt_ref_1", "charge.refunded", charge)
    assert deliver(client, first).json()["result"] == "ok"
    assert deliver(client, event("evt_ref_1b", "charge.refunded", charge)).json()["result"] == "ok"
    assert [n.amount for n in CreditNote.objects.filter(invoice=submitted)] == [Decimal("1.000")]
    stripe_api.refund(charge["id"], 164)  # the rest: the whole 2.64 is back on the card
    deliver(client, event("evt_ref_2", "charge.refunded", charge))
    notes = CreditNote.objects.filter(invoice=submitted)
    assert sum(n.amount for n in notes) == submitted.total and {n.refund_of for n in notes} == {charge["id"]}
    assert not CreditEntry.objects.filter(note__contains="Credit note").exists()  # no double refund


def test_a_dispute_flags_the_invoice_and_stops_dunning_until_it_closes(client, submitted, stripe_api, tenant):
    charge = stripe_api.pay(submitted.external_id)  # paid at Stripe, but the paid event is not here yet
    dunning_run(now=submitted.due_at + timedelta(days=8))
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.SUSPENDED
    dispute = stripe_api.dispute(charge["id"])
    assert deliver(client, event("evt_dp_1", "charge.dispute.created", dispute)).json()["result"] == "ok"
    submitted.refresh_from_db()
    tenant.refresh_from_db()
    assert submitted.dispute_status == "needs_response" and submitted.disputed_at is not None
    assert tenant.status == Tenant.Status.ACTIVE  # dunning stops for a disputed invoice
    assert dunning_run(now=submitted.due_at + timedelta(days=9)) == []
    (alert,) = _alerts(BillingAlert.Kind.DISPUTE)
    assert alert.invoice_id == submitted.pk
    stripe_api.dispute(charge["id"], status="won", dispute_id=dispute["id"])
    deliver(client, event("evt_dp_2", "charge.dispute.closed", dispute))
    submitted.refresh_from_db()
    assert submitted.dispute_status == "won" and submitted.disputed_at is None
    assert _alerts(BillingAlert.Kind.DISPUTE) == []


@pytest.mark.parametrize(
    "change, wrong",
    [
        ({"amount_paid": 1}, "amount paid 1"),
        ({"currency": "eur"}, "currency 'eur'"),
        ({"customer": "cus_someone_else"}, "customer 'cus_someone_else'"),
    ],
)
def test_a_payment_that_does_not_match_the_invoice_is_held(client, submitted, stripe_api, change, wrong):
    stripe_api.pay(submitted.external_id)
    stripe_api.invoices[submitted.external_id].update(change)
    response = deliver(
        client, event("evt_paid_x", "invoice.paid", stripe_api.invoices[submitted.external_id])
    )
    assert response.json()["result"] == "held"
    submitted.refresh_from_db()
    assert submitted.status == InvoiceStatus.FINALIZED
    (alert,) = _alerts(BillingAlert.Kind.PAYMENT_MISMATCH)
    assert wrong in alert.message


def test_an_event_for_an_unknown_invoice_is_kept_and_alerted(client, submitted, stripe_api):
    other = {"id": "in_elsewhere", "object": "invoice", "metadata": {}}
    assert deliver(client, event("evt_other", "invoice.paid", other)).json()["result"] == "unmatched"
    stored = StripeEvent.objects.get(event_id="evt_other")
    assert stored.payload["data"]["object"]["id"] == "in_elsewhere"
    (alert,) = _alerts(BillingAlert.Kind.UNMATCHED_EVENT)
    assert "in_elsewhere" in alert.message


def test_metadata_alone_does_not_bind_an_event_to_our_invoice(client, finalized, stripe_api, tenant):
    # A Stripe invoice of another customer whose metadata names our invoice: not ours.
    BillingAccount.objects.filter(tenant=tenant).update(stripe_customer_id="cus_ours")
    stripe_api.invoices["in_forged"] = dict(
        stripe_api.invoices.get("in_forged", {}),
        id="in_forged",
        object="invoice",
        customer="cus_other",
        currency="usd",
        status="paid",
        amount_paid=264,
        metadata={"gpupool_invoice_id": str(finalized.pk), "gpupool_tenant_id": str(tenant.pk)},
        status_transitions={"paid_at": 1712700000},
    )
    response = deliver(client, event("evt_forged", "invoice.paid", stripe_api.invoices["in_forged"]))
    assert response.json()["result"] == "unmatched"
    finalized.refresh_from_db()
    assert finalized.status == InvoiceStatus.FINALIZED and finalized.external_id == ""

    # The tenant's own customer, sent and paid, its id never stored here: bound and paid.
    stripe_api.invoices["in_forged"]["customer"] = "cus_ours"
    assert (
        deliver(client, event("evt_real", "invoice.paid", stripe_api.invoices["in_forged"])).json()["result"]
        == "ok"
    )
    finalized.refresh_from_db()
    assert finalized.status == InvoiceStatus.PAID and finalized.external_id == "in_forged"


def test_a_refund_of_an_unknown_charge_is_kept_and_alerted(client, submitted, stripe_api):
    stripe_api.charges["ch_x"] = {
        "id": "ch_x",
        "object": "charge",
        "payment_intent": "pi_x",
        "amount_refunded": 5,
    }
    assert (
        deliver(client, event("evt_ch_x", "charge.refunded", {"id": "ch_x"})).json()["result"] == "unmatched"
    )
    assert _alerts(BillingAlert.Kind.UNMATCHED_EVENT)


# --- a whole month, out of order --------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_month_of_events_replayed_out_of_order_ends_in_one_state(
    client, stripe_api, make_tenant, card, run, seed
):
    """Four tenants' March invoices at Stripe: paid; paid, partly refunded and disputed (won);
    failed then marked uncollectible; voided there. Every event of the month arrives shuffled,
    some twice; each handler reads Stripe's current object, so any order gives the same end."""
    tenants = [make_tenant(f"t{n}") for n in range(4)]
    for t in tenants:
        BillingAccount.objects.create(tenant=t, tax_rate_percent=Decimal("10"))
        run(t, utc(2024, 3, 1), utc(2024, 3, 1, 1))
    invoice_run(period_start=MARCH, now=utc(2024, 4, 5))
    invoices = [Invoice.objects.get(tenant=t, period_start=MARCH) for t in tenants]
    for inv in invoices:
        Invoice.objects.filter(pk=inv.pk).update(payment_provider="stripe")
        invoice_payment_submit(invoice_id=inv.pk)
        inv.refresh_from_db()
    paid, refunded, uncollectible, voided = (i.external_id for i in invoices)
    S = stripe_api.invoices
    events = [event(f"evt_fin_{n}", "invoice.finalized", S[sid]) for n, sid in enumerate(S)]
    events += [event("evt_fail_a", "invoice.payment_failed", dict(S[paid], status="open"))]
    stripe_api.pay(paid, at=1712000000)
    events += [event("evt_paid_a", "invoice.paid", S[paid])]
    charge = stripe_api.pay(refunded, at=1712100000)
    events += [event("evt_paid_b", "invoice.paid", S[refunded])]
    stripe_api.refund(charge["id"], 50)
    events += [event("evt_ref_b1", "charge.refunded", dict(charge))]
    stripe_api.refund(charge["id"], 70)
    events += [event("evt_ref_b2", "charge.refunded", dict(charge))]
    dispute = stripe_api.dispute(charge["id"])
    events += [event("evt_dp_b1", "charge.dispute.created", dict(dispute))]
    stripe_api.dispute(charge["id"], status="won", dispute_id=dispute["id"])
    events += [event("evt_dp_b2", "charge.dispute.closed", dict(dispute))]
    events += [event("evt_fail_c", "invoice.payment_failed", S[uncollectible])]
    S[uncollectible]["status"] = "uncollectible"
    S[uncollectible]["status_transitions"]["marked_uncollectible_at"] = 1712200000
    events += [event("evt_unc_c", "invoice.marked_uncollectible", S[uncollectible])]
    S[voided]["status"] = "void"
    events += [event("evt_void_d", "invoice.voided", S[voided])]
    events += [event("evt_stranger", "invoice.paid", {"id": "in_nobody", "object": "invoice"})]

    rng = random.Random(seed)
    deliveries = events + rng.sample(events, 5)  # some redelivered
    rng.shuffle(deliveries)
    for payload in deliveries:
        assert deliver(client, payload).status_code == 200

    for inv in invoices:
        inv.refresh_from_db()
    a, b, c, d = invoices
    assert (a.status, a.paid_at) == (InvoiceStatus.PAID, utc(2024, 4, 1, 19, 33, 20))
    assert (b.status, b.dispute_status, b.disputed_at) == (InvoiceStatus.PAID, "won", None)
    # Whichever refund event comes first reads the charge as it is now: one note for both refunds.
    assert [n.amount for n in CreditNote.objects.filter(invoice=b)] == [Decimal("1.200")]
    assert (c.status, c.uncollectible_at) == (InvoiceStatus.FINALIZED, utc(2024, 4, 4, 3, 6, 40))
    assert d.status == InvoiceStatus.VOID
    assert StripeEvent.objects.count() == len(events)
    assert AuditEvent.objects.filter(action="invoice.paid").count() == 2
    # Each failure event found its invoice already paid or uncollectible at Stripe: nothing to record.
    assert AuditEvent.objects.filter(action="invoice.payment_failed").count() == 0
    assert [al.subject for al in _alerts(BillingAlert.Kind.UNMATCHED_EVENT)] == ["event:evt_stranger"]
    assert _alerts(BillingAlert.Kind.DISPUTE) == [] and _alerts(BillingAlert.Kind.PAYMENT_MISMATCH) == []
