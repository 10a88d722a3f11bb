"""Payments: submitting finalized invoices to the provider, Stripe webhooks, and dunning.

Webhooks (``/webhooks/stripe/``): the signature and timestamp are checked by
``stripe.Webhook.construct_event`` with ``STRIPE_WEBHOOK_SECRET`` (tolerance 300 s). Each event is
stored once by its id (unique) in the same transaction as its effects: a redelivery finds the row
and changes nothing; a failure rolls the row back so Stripe's retry processes it. Events can arrive
in any order, so an event only says *which* object changed: the handler fetches the current Stripe
invoice and acts on its status. Our invoice only ever moves forward (finalized -> paid): a
``invoice.payment_failed`` that arrives after ``invoice.paid`` is recorded and changes nothing.

Dunning (``dunning_run``, beat, hourly): a finalized invoice unpaid past its due date puts its tenant
into GRACE (works as usual; the reason, naming the invoice and the day of suspension, is shown on
every page and e-mailed to the owners and billing members); ``METERING_DUNNING_GRACE_DAYS`` later
it suspends the tenant (new workloads refused by the admission check; running and queued ones kept
or stopped, ``METERING_SUSPEND_RUNNING``). Paying that invoice reactivates the tenant (or moves it
to GRACE or SUSPENDED for its next invoice past due).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import stripe
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction
from django.db.models import Q, Sum
from django.utils import timezone

from metering.locks import (
    lock_billing_account_by_customer,
    lock_invoice_with_tenant,
    lock_tenant,
)
from metering.metrics import STRIPE_WEBHOOKS
from metering.models import (
    BillingAccount,
    BillingAlert,
    CreditNote,
    Invoice,
    InvoiceStatus,
    StripeEvent,
    StripeEventResult,
)
from metering.money import from_minor_units, quantize_money, to_minor_units
from metering.payments import provider_get
from metering.services.invoice_events import invoice_event_publish
from portal.actors import Actor
from portal.errors import DomainError, ValidationFailed
from portal.models import Tenant
from portal.services.audit import audit_record
from portal.services.tenants import tenant_set_status

logger = logging.getLogger(__name__)

INVOICE_EVENTS = frozenset(
    {
        "invoice.paid",
        "invoice.payment_succeeded",
        "invoice.payment_failed",
        "invoice.finalized",
        "invoice.voided",
        "invoice.marked_uncollectible",
    }
)
CUSTOMER_EVENTS = frozenset({"customer.updated", "customer.deleted"})
REFUND_EVENTS = frozenset({"charge.refunded"})
DISPUTE_EVENTS = frozenset(
    {
        "charge.dispute.created",
        "charge.dispute.updated",
        "charge.dispute.closed",
        "charge.dispute.funds_withdrawn",
        "charge.dispute.funds_reinstated",
    }
)


# --- submitting ---------------------------------------------------------------------------------


def invoice_payment_submit(*, invoice_id: int, lookup: bool = False) -> Invoice:
    """Hand a finalized invoice to the payment provider, once. The attempt number is committed
    before the provider is called, so a retry after a crash repeats the same idempotency keys.

    ``lookup`` (the sweeper): first ask the provider for an invoice an earlier attempt sent and we
    never recorded (by our metadata) and adopt it; only if there is none, send it under a new
    attempt number, since the earlier attempt's idempotency keys may have expired at the provider."""
    with transaction.atomic():
        invoice = lock_invoice_with_tenant(invoice_id=invoice_id)
        if invoice.status != InvoiceStatus.FINALIZED or invoice.external_id:
            return invoice
        provider = provider_get(invoice.payment_provider or None)
        tried = invoice.payment_attempt > 0
        if not tried:
            invoice.payment_attempt = 1
        invoice.payment_provider = provider.name
        invoice.save(update_fields=["payment_attempt", "payment_provider"])
    if lookup and tried:
        found = provider.lookup(invoice=invoice)
        if found:
            return _submitted(invoice_id, provider.name, found, adopted=True)
        with transaction.atomic():
            invoice = lock_invoice_with_tenant(invoice_id=invoice_id)
            if invoice.status != InvoiceStatus.FINALIZED or invoice.external_id:
                return invoice
            invoice.payment_attempt += 1
            invoice.save(update_fields=["payment_attempt"])
    submission = provider.collect(invoice=invoice)
    if submission.external_id:
        return _submitted(invoice_id, provider.name, submission.external_id, adopted=False)
    return invoice


def _submitted(invoice_id: int, provider: str, external_id: str, *, adopted: bool) -> Invoice:
    from metering.services.alerts import billing_alert_resolve

    with transaction.atomic():
        invoice = lock_invoice_with_tenant(invoice_id=invoice_id)
        if invoice.external_id:
            return invoice
        invoice.external_id = external_id
        invoice.save(update_fields=["external_id"])
        audit_record(
            tenant=invoice.tenant,
            actor=Actor.system(),
            action="invoice.payment_submitted",
            target=invoice,
            data={
                "provider": provider,
                "external_id": external_id,
                "attempt": invoice.payment_attempt,
                "adopted": adopted,
            },
        )
        billing_alert_resolve(kind=BillingAlert.Kind.SUBMISSION_FAILED, subject=f"invoice:{invoice.pk}")
    return invoice


def invoice_payments_sweep(*, now: datetime | None = None) -> dict[str, list[int]]:
    """Beat, every few minutes: each finalized invoice of a sending provider (Stripe) that has no
    provider id some minutes after finalization (its on-commit task was lost, or failed for good)
    is submitted again, looking first for what an earlier attempt sent. An invoice whose provider
    refuses it, or that transient errors keep unsent past ``METERING_PAYMENT_SUBMIT_ALERT_AFTER_S``,
    raises a billing alert for staff; a later success resolves it. Returns the invoice ids by
    outcome: ``sent``, ``retry`` (transient error) and ``failed``."""
    from metering.payments.stripe import TRANSIENT_ERRORS
    from metering.services.alerts import billing_alert_raise

    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.METERING_PAYMENT_SWEEP_AFTER_S)
    ids = list(
        Invoice.objects.filter(status=InvoiceStatus.FINALIZED, external_id="", finalized_at__lte=cutoff)
        .exclude(payment_provider__in=["", "manual"])
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    outcome: dict[str, list[int]] = {"sent": [], "retry": [], "failed": []}
    for invoice_id in ids:
        try:
            invoice = invoice_payment_submit(invoice_id=invoice_id, lookup=True)
        except TRANSIENT_ERRORS as e:
            invoice = Invoice.objects.get(pk=invoice_id)
            outcome["retry"].append(invoice_id)
            late = invoice.finalized_at <= now - timedelta(
                seconds=settings.METERING_PAYMENT_SUBMIT_ALERT_AFTER_S
            )
            if late:
                _submission_alert(billing_alert_raise, invoice, e, transient=True)
            continue
        except (stripe.StripeError, DomainError) as e:
            invoice = Invoice.objects.get(pk=invoice_id)
            outcome["failed"].append(invoice_id)
            _submission_alert(billing_alert_raise, invoice, e, transient=False)
            continue
        if invoice.external_id:
            outcome["sent"].append(invoice_id)
            try:
                invoice_provider_sync(invoice_id=invoice_id)
            except (stripe.StripeError, DomainError):  # its webhook, or the next look, brings it
                logger.exception("invoice %s: sent, but its Stripe state could not be read", invoice_id)
    return outcome


def _submission_alert(raise_alert, invoice: Invoice, error: Exception, *, transient: bool) -> None:
    why = "still unreachable" if transient else "refused it"
    raise_alert(
        kind=BillingAlert.Kind.SUBMISSION_FAILED,
        subject=f"invoice:{invoice.pk}",
        invoice=invoice,
        message=(
            f"Invoice #{invoice.pk} ({invoice.period_start:%Y-%m}, {_amount(invoice)}) finalized "
            f"{invoice.finalized_at:%Y-%m-%d %H:%M} UTC was not sent: the provider ({invoice.payment_provider}) "
            f"{why}: {str(error)[:500]}. Dunning leaves it alone until it is sent."
        ),
        data={"error": type(error).__name__, "transient": transient, "attempt": invoice.payment_attempt},
    )


def invoice_provider_sync(*, invoice_id: int) -> str:
    """Bring an invoice in line with the Stripe invoice sent for it, as a webhook would (the sweeper
    after it adopts one an earlier attempt sent, which may already be paid)."""
    invoice = Invoice.objects.get(pk=invoice_id)
    if invoice.payment_provider != "stripe" or not invoice.external_id:
        return StripeEventResult.IGNORED
    from metering.payments.stripe import stripe_client

    current = stripe_client().v1.invoices.retrieve(invoice.external_id).to_dict()
    with transaction.atomic():
        return _apply_stripe_invoice(invoice, current, event=None, event_type="sync")


# --- webhooks -----------------------------------------------------------------------------------


class WebhookRejected(ValidationFailed):
    code = "bad_signature"


class WebhookFailed(DomainError):
    """Processing failed (e.g. Stripe could not be reached to fetch the object): nothing was
    stored, so Stripe's redelivery is processed in full."""

    status_code = 503
    code = "webhook_failed"


def stripe_webhook_receive(*, payload: bytes, signature: str) -> StripeEvent | None:
    """Verify, store once and process one delivery. Returns the stored event (None: a redelivery
    of an event already processed). Raises :class:`WebhookRejected` or :class:`WebhookFailed`."""
    secret = settings.STRIPE_WEBHOOK_SECRET
    try:
        if not secret:
            raise ValueError("STRIPE_WEBHOOK_SECRET is not set; no signature can be trusted.")
        event = stripe.Webhook.construct_event(payload, signature, secret).to_dict()
    except (ValueError, stripe.SignatureVerificationError) as e:
        STRIPE_WEBHOOKS.labels(event_type="unknown", result="bad_signature").inc()
        logger.warning("stripe webhook refused: %s", e)
        raise WebhookRejected(
            "Stripe-Signature: not a valid signature of this payload within the tolerance.",
            fields={"Stripe-Signature": [str(e)[:200]]},
        ) from None
    event_type = str(event.get("type", ""))[:100]
    try:
        with transaction.atomic():
            try:
                with transaction.atomic():
                    stored = StripeEvent.objects.create(
                        event_id=event["id"],
                        type=event_type,
                        created=datetime.fromtimestamp(int(event.get("created") or 0), tz=UTC),
                        livemode=bool(event.get("livemode")),
                        result=StripeEventResult.IGNORED,
                        payload=event,
                    )
            except IntegrityError:
                STRIPE_WEBHOOKS.labels(event_type=event_type, result="ok").inc()
                return None
            stored.invoice, stored.result = _process(event, event_type)
            stored.save(update_fields=["invoice", "result"])
    except (stripe.StripeError, DomainError) as e:
        STRIPE_WEBHOOKS.labels(event_type=event_type, result="failed").inc()
        logger.exception("stripe webhook %s (%s) failed", event["id"], event_type)
        raise WebhookFailed(f"Event {event['id']} could not be processed: {e}") from e
    STRIPE_WEBHOOKS.labels(event_type=event_type, result="ok").inc()
    return stored


def _process(event, event_type: str) -> tuple[Invoice | None, str]:
    obj = event["data"]["object"]
    if event_type in INVOICE_EVENTS:
        return _invoice_event(event, event_type, obj)
    if event_type in REFUND_EVENTS:
        return _refund_event(event, event_type, obj)
    if event_type in DISPUTE_EVENTS:
        return _dispute_event(event, event_type, obj)
    if event_type in CUSTOMER_EVENTS:
        return None, _customer_event(event, event_type, obj)
    return None, StripeEventResult.IGNORED


def _unmatched(event, event_type: str, what: str) -> tuple[None, str]:
    """An event about an object we cannot tie to one of our invoices: the event row keeps it (with
    its payload) and staff are alerted."""
    from metering.services.alerts import billing_alert_raise

    billing_alert_raise(
        kind=BillingAlert.Kind.UNMATCHED_EVENT,
        subject=f"event:{event['id']}"[:255],
        message=f"Stripe event {event['id']} ({event_type}) is about {what}, which gpupool does not know.",
        data={"event": event["id"], "type": event_type, "object": (event["data"]["object"] or {}).get("id")},
    )
    return None, StripeEventResult.UNMATCHED


def _candidate(obj) -> Invoice | None:
    """Our invoice an invoice event may be about: the one with its Stripe id, or (only if it has
    none yet) the one its metadata names; the latter is bound only after :func:`_bind` checks it."""
    stripe_id = str(obj.get("id") or "")
    invoice = Invoice.objects.filter(external_id=stripe_id).first() if stripe_id else None
    if invoice is None:
        ours = str((obj.get("metadata") or {}).get("gpupool_invoice_id", ""))
        if ours.isdigit():
            invoice = Invoice.objects.filter(pk=int(ours), external_id="").first()
    return invoice


def _bind(invoice: Invoice, current: dict, event_id: str) -> bool:
    """Adopt a Stripe invoice our records lack (a submission that crashed before storing its id),
    not by metadata alone: its customer must be the tenant's, its metadata must name the tenant,
    and it must have been sent (not a draft or a voided earlier attempt)."""
    from metering.payments.stripe import SENT_STATUSES

    if invoice.external_id:
        return invoice.external_id == current.get("id")
    account = BillingAccount.objects.filter(tenant_id=invoice.tenant_id).first()
    metadata = current.get("metadata") or {}
    if (
        account is None
        or not account.stripe_customer_id
        or current.get("customer") != account.stripe_customer_id
        or str(metadata.get("gpupool_tenant_id")) != str(invoice.tenant_id)
        or current.get("status") not in SENT_STATUSES
    ):
        return False
    invoice = lock_invoice_with_tenant(invoice_id=invoice.pk)
    if invoice.external_id:
        return invoice.external_id == current.get("id")
    invoice.external_id = current["id"]
    invoice.save(update_fields=["external_id"])
    audit_record(
        tenant=invoice.tenant,
        actor=Actor.system(),
        action="invoice.payment_submitted",
        target=invoice,
        data={"provider": "stripe", "external_id": current["id"], "adopted": True, "event": event_id},
    )
    return True


def _invoice_event(event, event_type: str, obj) -> tuple[Invoice | None, str]:
    from metering.payments.stripe import stripe_client

    invoice = _candidate(obj)
    if invoice is None:
        return _unmatched(event, event_type, f"Stripe invoice {obj.get('id')}")
    current = stripe_client().v1.invoices.retrieve(obj["id"]).to_dict()  # the state now, not the event's
    if not _bind(invoice, current, event["id"]):
        return _unmatched(
            event, event_type, f"Stripe invoice {obj.get('id')} (its metadata names #{invoice.pk})"
        )
    invoice = Invoice.objects.get(pk=invoice.pk)
    return invoice, _apply_stripe_invoice(invoice, current, event=event, event_type=event_type)


def _paid_mismatch(invoice: Invoice, current: dict) -> list[str]:
    """Why Stripe's paid invoice does not pay ours ([] when it does)."""
    account = BillingAccount.objects.filter(tenant_id=invoice.tenant_id).first()
    customer = account.stripe_customer_id if account else ""
    wrong = []
    if str(current.get("currency") or "").lower() != invoice.currency.lower():
        wrong.append(f"currency {current.get('currency')!r}, ours {invoice.currency}")
    if current.get("amount_paid") != to_minor_units(invoice.total, invoice.currency):
        wrong.append(
            f"amount paid {current.get('amount_paid')} minor units, ours "
            f"{to_minor_units(invoice.total, invoice.currency)}"
        )
    if not customer or current.get("customer") != customer:
        wrong.append(f"customer {current.get('customer')!r}, the tenant's {customer!r}")
    return wrong


def _apply_stripe_invoice(invoice: Invoice, current: dict, *, event, event_type: str) -> str:
    """Move our invoice to match the Stripe invoice as it is now (inside a transaction). Ours only
    moves forward (finalized -> paid, void, uncollectible); what would move it back is alerted."""
    from metering.services.alerts import billing_alert_raise
    from metering.services.invoices import invoice_mark_paid, invoice_void

    invoice = lock_invoice_with_tenant(invoice_id=invoice.pk)
    status = current.get("status")
    source = {"provider": "stripe", "event": event["id"] if event else "", "stripe_invoice": current["id"]}
    transitions = current.get("status_transitions") or {}
    if status == "paid" and invoice.status == InvoiceStatus.FINALIZED:
        wrong = _paid_mismatch(invoice, current)
        if wrong:
            billing_alert_raise(
                kind=BillingAlert.Kind.PAYMENT_MISMATCH,
                subject=f"invoice:{invoice.pk}",
                invoice=invoice,
                message=f"Stripe invoice {current['id']} is paid but does not pay invoice #{invoice.pk}: "
                + "; ".join(wrong)
                + ". It stays unpaid here until staff decide.",
                data={**source, "wrong": wrong},
            )
            return StripeEventResult.HELD
        paid_at = transitions.get("paid_at")
        invoice_mark_paid(
            invoice=invoice,
            actor=Actor.system(),
            now=datetime.fromtimestamp(paid_at, tz=UTC) if paid_at else timezone.now(),
            data=source,
        )
    elif status == "void" and invoice.status == InvoiceStatus.FINALIZED:
        invoice_void(invoice=invoice, actor=Actor.system(), reason="voided at Stripe", provider_done=True)
    elif (
        status == "uncollectible"
        and invoice.status == InvoiceStatus.FINALIZED
        and not invoice.uncollectible_at
    ):
        at = transitions.get("marked_uncollectible_at")
        invoice.uncollectible_at = datetime.fromtimestamp(at, tz=UTC) if at else timezone.now()
        invoice.save(update_fields=["uncollectible_at"])
        audit_record(
            tenant=invoice.tenant,
            actor=Actor.system(),
            action="invoice.uncollectible",
            target=invoice,
            data=source,
        )
    elif (status == "paid" and invoice.status == InvoiceStatus.VOID) or (
        status == "void" and invoice.status == InvoiceStatus.PAID
    ):
        billing_alert_raise(
            kind=BillingAlert.Kind.PROVIDER_STATE,
            subject=f"invoice:{invoice.pk}",
            invoice=invoice,
            message=f"Stripe invoice {current['id']} is {status} but invoice #{invoice.pk} is {invoice.status} here.",
            data=source,
        )
    elif event_type == "invoice.payment_failed" and invoice.status == InvoiceStatus.FINALIZED:
        audit_record(
            tenant=invoice.tenant,
            actor=Actor.system(),
            action="invoice.payment_failed",
            target=invoice,
            data={**source, "stripe_status": status, "attempt_count": current.get("attempt_count")},
        )
    return StripeEventResult.OK


def _retrieve_or_none(service, object_id) -> dict | None:
    """The object now, or None when Stripe has no such object (another account's, or a test
    event): a permanent answer, so the event is kept as unmatched rather than retried forever."""
    if not object_id:
        return None
    try:
        return service.retrieve(str(object_id)).to_dict()
    except stripe.InvalidRequestError as e:
        if e.code == "resource_missing":
            return None
        raise


def _invoice_of_charge(client, charge: dict) -> Invoice | None:
    """Our invoice that a Stripe charge paid: the charge's PaymentIntent, through Stripe's invoice
    payments, to the Stripe invoice we recorded."""
    intent = charge.get("payment_intent")
    intent = intent.get("id") if isinstance(intent, dict) else intent
    if not intent:
        return None
    payments = client.v1.invoice_payments.list(
        params={"payment": {"type": "payment_intent", "payment_intent": intent}, "limit": 10}
    ).to_dict()
    for payment in payments.get("data") or []:
        stripe_invoice = payment.get("invoice")
        stripe_invoice = stripe_invoice.get("id") if isinstance(stripe_invoice, dict) else stripe_invoice
        found = Invoice.objects.filter(external_id=stripe_invoice).first() if stripe_invoice else None
        if found is not None:
            return found
    return None


def _refund_event(event, event_type: str, obj) -> tuple[Invoice | None, str]:
    """``charge.refunded``: the part of the charge refunded at Stripe that no credit note records
    yet becomes one (the money went back to the card, so no prepaid credit is added)."""
    from metering.payments.stripe import stripe_client
    from metering.services.alerts import billing_alert_raise

    client = stripe_client()
    charge = _retrieve_or_none(client.v1.charges, obj.get("id"))
    invoice = _invoice_of_charge(client, charge) if charge else None
    if invoice is None:
        return _unmatched(event, event_type, f"charge {obj.get('id')}")
    invoice = lock_invoice_with_tenant(invoice_id=invoice.pk)
    recorded = CreditNote.objects.filter(invoice=invoice, refund_of=charge["id"]).aggregate(s=Sum("amount"))[
        "s"
    ]
    recorded_minor = to_minor_units(recorded or 0, invoice.currency)
    missing_minor = int(charge.get("amount_refunded") or 0) - recorded_minor
    if missing_minor <= 0:
        return invoice, StripeEventResult.OK
    amount = from_minor_units(missing_minor, invoice.currency)
    issued = CreditNote.objects.filter(invoice=invoice).aggregate(s=Sum("amount"))["s"] or 0
    if (
        str(charge.get("currency") or "").lower() != invoice.currency.lower()
        or issued + amount > invoice.total
    ):
        billing_alert_raise(
            kind=BillingAlert.Kind.PAYMENT_MISMATCH,
            subject=f"charge:{charge['id']}",
            invoice=invoice,
            message=(
                f"Stripe refunded {missing_minor} minor units ({charge.get('currency')}) of charge "
                f"{charge['id']} for invoice #{invoice.pk}, more than is left to credit on it "
                f"({invoice.total - issued} {invoice.currency}); no credit note was made."
            ),
            data={
                "event": event["id"],
                "charge": charge["id"],
                "amount_refunded": charge.get("amount_refunded"),
            },
        )
        return invoice, StripeEventResult.HELD
    note = CreditNote.objects.create(
        tenant_id=invoice.tenant_id,
        invoice=invoice,
        amount=amount,
        reason=f"Refunded at Stripe (charge {charge['id']})"[:255],
        refund_of=charge["id"],
    )
    audit_record(
        tenant=invoice.tenant,
        actor=Actor.system(),
        action="invoice.refunded",
        target=invoice,
        data={"event": event["id"], "charge": charge["id"], "amount": str(amount), "credit_note": note.pk},
    )
    return invoice, StripeEventResult.OK


DISPUTE_OPEN = frozenset({"warning_needs_response", "warning_under_review", "needs_response", "under_review"})


def _dispute_event(event, event_type: str, obj) -> tuple[Invoice | None, str]:
    """A dispute of the charge that paid one of our invoices: the invoice carries the dispute's
    status; while it is open dunning leaves the invoice alone (a tenant in grace or suspended for
    it is released); staff are alerted when it opens and when it is lost."""
    from metering.payments.stripe import stripe_client
    from metering.services.alerts import billing_alert_raise, billing_alert_resolve

    client = stripe_client()
    dispute = _retrieve_or_none(client.v1.disputes, obj.get("id")) or {}
    charge_id = dispute.get("charge")
    charge_id = charge_id.get("id") if isinstance(charge_id, dict) else charge_id
    charge = _retrieve_or_none(client.v1.charges, charge_id)
    invoice = _invoice_of_charge(client, charge) if charge else None
    if invoice is None:
        return _unmatched(event, event_type, f"dispute {obj.get('id')}")
    invoice = lock_invoice_with_tenant(invoice_id=invoice.pk)
    status = str(dispute.get("status") or "")[:32]
    is_open = status in DISPUTE_OPEN
    if invoice.dispute_status != status:
        invoice.dispute_status = status
        invoice.disputed_at = (invoice.disputed_at or timezone.now()) if is_open else None
        invoice.save(update_fields=["dispute_status", "disputed_at"])
        audit_record(
            tenant=invoice.tenant,
            actor=Actor.system(),
            action="invoice.dispute",
            target=invoice,
            data={
                "event": event["id"],
                "dispute": dispute["id"],
                "status": status,
                "reason": dispute.get("reason"),
            },
        )
    subject = f"dispute:{dispute['id']}"
    if is_open or status == "lost":
        billing_alert_raise(
            kind=BillingAlert.Kind.DISPUTE,
            subject=subject,
            invoice=invoice,
            message=(
                f"The payment of invoice #{invoice.pk} ({_amount(invoice)}) is disputed at Stripe "
                f"({dispute['id']}, {status}, reason {dispute.get('reason')!r}); dunning leaves it alone"
                + (" until the dispute closes." if is_open else "; the dispute was lost.")
            ),
            data={"dispute": dispute["id"], "status": status, "amount": dispute.get("amount")},
        )
    else:
        billing_alert_resolve(kind=BillingAlert.Kind.DISPUTE, subject=subject)
    if is_open:
        dunning_release(invoice=invoice)
    return invoice, StripeEventResult.OK


def _customer_event(event, event_type: str, obj) -> str:
    account = lock_billing_account_by_customer(customer_id=obj.get("id") or "-")
    if account is None:
        return StripeEventResult.IGNORED
    changed = sorted((event["data"].get("previous_attributes") or {}).keys())
    if event_type == "customer.deleted":
        # A new customer is created the next time an invoice is submitted.
        account.stripe_customer_id = ""
        account.save(update_fields=["stripe_customer_id"])
    audit_record(
        tenant=account.tenant,
        actor=Actor.system(),
        action=f"billing.stripe_{event_type.replace('.', '_')}",
        target=account,
        data={"event": event["id"], "customer": obj.get("id"), "changed": changed},
    )
    return StripeEventResult.OK


# --- dunning ------------------------------------------------------------------------------------

SUSPEND_RUNNING_CHOICES = ("keep", "stop")
SUSPENDED_STOP_REASON = "tenant_suspended"  # the workload events' reason when suspension stops them


def _due(invoice: Invoice) -> datetime:
    return invoice.due_at or invoice.finalized_at + timedelta(days=settings.METERING_PAYMENT_TERMS_DAYS)


def _suspension_date(invoice: Invoice) -> datetime:
    return _due(invoice) + timedelta(days=settings.METERING_DUNNING_GRACE_DAYS)


def _amount(invoice: Invoice) -> str:
    return f"{quantize_money(invoice.total, invoice.currency)} {invoice.currency}"


def dunning_reason(invoice: Invoice) -> str:
    """Why the tenant is suspended (SUSPENDED)."""
    return (
        f"Unpaid invoice #{invoice.pk} for {invoice.period_start:%Y-%m} ({_amount(invoice)}), "
        f"due {_due(invoice):%Y-%m-%d}"
    )


def grace_reason(invoice: Invoice) -> str:
    """Why the tenant is warned (GRACE): the invoice is past its due date, not yet past the grace."""
    return (
        f"Invoice #{invoice.pk} for {invoice.period_start:%Y-%m} ({_amount(invoice)}) was due "
        f"{_due(invoice):%Y-%m-%d}; the team will be suspended on {_suspension_date(invoice):%Y-%m-%d} "
        "unless it is paid"
    )


def _names(tenant: Tenant, invoice: Invoice) -> bool:
    """Whether the tenant's status is due to ``invoice`` (its reason is dunning's for it)."""
    reason = tenant.suspended_reason or ""
    return reason.startswith((f"Unpaid invoice #{invoice.pk} ", f"Invoice #{invoice.pk} "))


def invoices_past_due(*, now: datetime, grace_days: int = 0) -> Q:
    """Finalized, unpaid invoices with something to pay, more than ``grace_days`` past due. Left
    out: an invoice under an open dispute, and one a sending provider (Stripe) never received (the
    sweeper sends it, or alerts staff): the customer cannot pay what was never presented."""
    cutoff = now - timedelta(days=grace_days)
    terms = timedelta(days=settings.METERING_PAYMENT_TERMS_DAYS)
    sent = ~Q(external_id="") | Q(payment_provider__in=["", "manual"])
    return (
        Q(status=InvoiceStatus.FINALIZED, total__gt=0, disputed_at__isnull=True)
        & sent
        & (Q(due_at__lte=cutoff) | Q(due_at__isnull=True, finalized_at__lte=cutoff - terms))
    )


def invoices_overdue(*, now: datetime) -> Q:
    """Past their due date plus the grace: these suspend their tenant."""
    return invoices_past_due(now=now, grace_days=settings.METERING_DUNNING_GRACE_DAYS)


def _standing(tenant: Tenant, *, now: datetime, paid: Invoice | None = None) -> tuple[str, Invoice | None]:
    """What dunning says the tenant's status should be, and the invoice (its oldest) that says so."""
    invoices = Invoice.objects.filter(tenant=tenant).order_by("period_start", "pk")
    if paid is not None:
        invoices = invoices.exclude(pk=paid.pk)
    overdue = invoices.filter(invoices_overdue(now=now)).first()
    if overdue is not None:
        return Tenant.Status.SUSPENDED, overdue
    late = invoices.filter(invoices_past_due(now=now)).first()
    if late is not None:
        return Tenant.Status.GRACE, late
    return Tenant.Status.ACTIVE, None


def suspend_running_setting() -> str:
    value = settings.METERING_SUSPEND_RUNNING
    if value not in SUSPEND_RUNNING_CHOICES:
        raise ImproperlyConfigured(
            f"METERING_SUSPEND_RUNNING must be one of {', '.join(SUSPEND_RUNNING_CHOICES)}, not {value!r}."
        )
    return value


def _stoppable(tenant: Tenant):
    """The tenant's workloads that suspension stops: running and queued, not already stopping."""
    from scheduling.models import TERMINAL_STATES, Workload, WorkloadState

    return (
        Workload.objects.for_tenant(tenant)
        .filter(stop_requested_at__isnull=True)
        .exclude(state__in=[*TERMINAL_STATES, WorkloadState.STOPPING])
        .order_by("pk")
    )


def workloads_stop_on_suspension(*, tenant: Tenant, reason: str, **kwargs) -> None:
    """portal's ``tenant_suspended``: with ``METERING_SUSPEND_RUNNING=stop`` the tenant's running
    and queued workloads are stopped through scheduling's stop service, whoever suspended it
    (dunning, or staff in the admin)."""
    if suspend_running_setting() != "stop":
        return
    from scheduling.services.lifecycle import workload_stop

    for w in _stoppable(tenant):
        workload_stop(
            workload=w,
            actor=Actor.system(),
            reason=SUSPENDED_STOP_REASON,
            message=f"Stopped: the team is suspended ({reason}).",
        )


def _mail(tenant_id: int, status: str, invoice_id: int) -> None:
    from metering.services.notify import billing_contacts_mail

    tenant = Tenant.objects.get(pk=tenant_id)
    if tenant.status != status or not tenant.suspended_reason.startswith(("Unpaid invoice #", "Invoice #")):
        return  # changed again before the mail went out
    link = f"{settings.SITE_URL.rstrip('/')}/billing/invoices/"
    if status == Tenant.Status.GRACE:
        subject, body = (
            f"payment overdue (invoice #{invoice_id})",
            (f"{tenant.suspended_reason}.\n\nWhile it is unpaid the team works as usual. Invoices: {link}\n"),
        )
    else:
        running = (
            "Its running and queued workloads are being stopped."
            if settings.METERING_SUSPEND_RUNNING == "stop"
            else "Its running workloads continue and are billed."
        )
        subject, body = (
            f"suspended (invoice #{invoice_id} unpaid)",
            (
                f"{tenant.name} is suspended: {tenant.suspended_reason}.\n\n"
                f"New workloads are refused until the invoice is paid. {running}\nInvoices: {link}\n"
            ),
        )
    billing_contacts_mail(tenant=tenant, subject=subject, message=body)


def _dunning_apply(tenant: Tenant, *, status: str, invoice: Invoice) -> None:
    """Move a locked tenant to GRACE or SUSPENDED for ``invoice``: status, audit, e-mail after
    commit, and (``METERING_SUSPEND_RUNNING=stop``) its workloads stopped when it is suspended."""
    was = tenant.status
    stop = status == Tenant.Status.SUSPENDED and was != Tenant.Status.SUSPENDED
    stop = stop and suspend_running_setting() == "stop"
    reason = dunning_reason(invoice) if status == Tenant.Status.SUSPENDED else grace_reason(invoice)
    data = {
        "due_at": _due(invoice).isoformat(),
        "total": str(invoice.total),
        "suspend_on": _suspension_date(invoice).isoformat(),
    }
    if stop:  # counted before: the suspension stops them (workloads_stop_on_suspension)
        data["workloads_stopped"] = _stoppable(tenant).count()
    tenant_set_status(tenant=tenant, status=status, reason=reason, actor=Actor.system())
    invoice_event_publish(
        invoice=invoice,
        type="invoice.overdue",
        now=timezone.now(),
        tenant_status=status,
        suspend_on=data["suspend_on"],
    )
    audit_record(
        tenant=tenant,
        actor=Actor.system(),
        action="invoice.dunning_suspend" if status == Tenant.Status.SUSPENDED else "invoice.dunning_grace",
        target=invoice,
        data=data,
    )
    tenant_id, invoice_id = tenant.pk, invoice.pk
    transaction.on_commit(lambda: _mail(tenant_id, status, invoice_id))


def dunning_run(*, now: datetime | None = None) -> list[Tenant]:
    """Each tenant that is not suspended and has an invoice past its due date goes to GRACE (a
    warning, e-mailed) or, past the grace days, to SUSPENDED; the oldest such invoice is named.
    Returns the tenants whose status changed. Safe to run twice: a tenant already in that status
    for that invoice is left alone (and not e-mailed again)."""
    suspend_running_setting()
    now = now or timezone.now()
    tenant_ids = (
        Invoice.objects.filter(
            invoices_past_due(now=now), tenant__status__in=[Tenant.Status.ACTIVE, Tenant.Status.GRACE]
        )
        .order_by("tenant_id")
        .values_list("tenant_id", flat=True)
        .distinct()
    )
    changed = []
    for tenant_id in list(tenant_ids):
        with transaction.atomic():
            tenant = lock_tenant(tenant_id=tenant_id)
            if tenant.status == Tenant.Status.SUSPENDED:
                continue  # suspended meanwhile, by dunning or by hand
            status, invoice = _standing(tenant, now=now)
            if invoice is None or (tenant.status == status and _names(tenant, invoice)):
                continue
            _dunning_apply(tenant, status=status, invoice=invoice)
        changed.append(tenant)
    return changed


def dunning_release(*, invoice: Invoice, now: datetime | None = None) -> None:
    """Called when ``invoice`` is paid (inside its transaction): if it is why the tenant is in GRACE
    or SUSPENDED, the tenant is reactivated, or moves to GRACE or SUSPENDED for its next invoice
    past due."""
    now = now or timezone.now()
    tenant = lock_tenant(tenant_id=invoice.tenant_id)
    invoice.tenant = tenant
    if tenant.status == Tenant.Status.ACTIVE or not _names(tenant, invoice):
        return
    status, following = _standing(tenant, now=now, paid=invoice)
    if following is None:
        tenant_set_status(tenant=tenant, status=Tenant.Status.ACTIVE, actor=Actor.system())
    else:
        _dunning_apply(tenant, status=status, invoice=following)
