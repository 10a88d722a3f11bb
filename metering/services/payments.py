"""Payments: submitting finalized invoices to the provider, Stripe webhooks, and dunning.

Webhooks (``/webhooks/stripe/``): the signature and timestamp are checked by
``stripe.Webhook.construct_event`` with ``STRIPE_WEBHOOK_SECRET`` (tolerance 300 s). Each event is
stored once by its id (unique) in the same transaction as its effects: a redelivery finds the row
and changes nothing; a failure rolls the row back so Stripe's retry processes it. Events can arrive
in any order, so an event only says *which* object changed: the handler fetches the current Stripe
invoice and acts on its status. Our invoice only ever moves forward (finalized -> paid): a
``invoice.payment_failed`` that arrives after ``invoice.paid`` is recorded and changes nothing.

Dunning: a finalized invoice unpaid ``METERING_DUNNING_GRACE_DAYS`` after its due date suspends its
tenant (``portal.services.tenant_set_status``) with a reason naming the invoice; paying that invoice
reactivates the tenant (or moves the reason to its next overdue invoice).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from metering.metrics import STRIPE_WEBHOOKS
from metering.models import BillingAccount, Invoice, InvoiceStatus, StripeEvent, StripeEventResult
from metering.money import quantize_money
from metering.payments import provider_get
from portal.actors import Actor
from portal.errors import DomainError, ValidationFailed
from portal.models import Tenant
from portal.services import audit_record, tenant_set_status

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


# --- submitting ---------------------------------------------------------------------------------


def invoice_payment_submit(*, invoice_id: int) -> Invoice:
    """Hand a finalized invoice to the payment provider, once. The attempt number is committed
    before the provider is called, so a retry after a crash repeats the same idempotency keys."""
    with transaction.atomic():
        invoice = Invoice.objects.select_for_update().select_related("tenant").get(pk=invoice_id)
        if invoice.status != InvoiceStatus.FINALIZED or invoice.external_id:
            return invoice
        provider = provider_get(invoice.payment_provider or None)
        if invoice.payment_attempt == 0:
            invoice.payment_attempt = 1
        invoice.payment_provider = provider.name
        invoice.save(update_fields=["payment_attempt", "payment_provider"])
    submission = provider.collect(invoice=invoice)
    if submission.external_id:
        with transaction.atomic():
            invoice = Invoice.objects.select_for_update().get(pk=invoice_id)
            invoice.external_id = submission.external_id
            invoice.save(update_fields=["external_id"])
            audit_record(
                tenant=invoice.tenant,
                actor=Actor.system(),
                action="invoice.payment_submitted",
                target=invoice,
                data={
                    "provider": provider.name,
                    "external_id": submission.external_id,
                    "attempt": invoice.payment_attempt,
                },
            )
    return invoice


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
    if event_type in CUSTOMER_EVENTS:
        return None, _customer_event(event, event_type, obj)
    return None, StripeEventResult.IGNORED


def _our_invoice(obj) -> Invoice | None:
    stripe_id = obj.get("id") or ""
    invoice = Invoice.objects.filter(external_id=stripe_id).first() if stripe_id else None
    if invoice is None:
        ours = (obj.get("metadata") or {}).get("gpupool_invoice_id", "")
        if str(ours).isdigit():
            invoice = Invoice.objects.filter(pk=int(ours)).first()
    return invoice


def _invoice_event(event, event_type: str, obj) -> tuple[Invoice | None, str]:
    from metering.payments.stripe import stripe_client
    from metering.services.invoices import invoice_mark_paid

    invoice = _our_invoice(obj)
    if invoice is None:
        return None, StripeEventResult.IGNORED
    current = stripe_client().v1.invoices.retrieve(obj["id"]).to_dict()  # the state now, not the event's
    invoice = Invoice.objects.select_for_update().select_related("tenant").get(pk=invoice.pk)
    if current.get("status") == "paid" and invoice.status == InvoiceStatus.FINALIZED:
        transitions = current.get("status_transitions") or {}
        paid_at = transitions.get("paid_at")
        invoice_mark_paid(
            invoice=invoice,
            actor=Actor.system(),
            now=datetime.fromtimestamp(paid_at, tz=UTC) if paid_at else timezone.now(),
            data={"provider": "stripe", "event": event["id"], "stripe_invoice": current["id"]},
        )
    elif event_type == "invoice.payment_failed" and invoice.status == InvoiceStatus.FINALIZED:
        audit_record(
            tenant=invoice.tenant,
            actor=Actor.system(),
            action="invoice.payment_failed",
            target=invoice,
            data={
                "provider": "stripe",
                "event": event["id"],
                "stripe_status": current.get("status"),
                "attempt_count": current.get("attempt_count"),
            },
        )
    return invoice, StripeEventResult.OK


def _customer_event(event, event_type: str, obj) -> str:
    account = (
        BillingAccount.objects.select_for_update().filter(stripe_customer_id=obj.get("id") or "-").first()
    )
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


def dunning_reason(invoice: Invoice) -> str:
    due = invoice.due_at or invoice.finalized_at
    return (
        f"Unpaid invoice #{invoice.pk} for {invoice.period_start:%Y-%m} "
        f"({quantize_money(invoice.total, invoice.currency)} {invoice.currency}), due {due:%Y-%m-%d}"
    )


def _suspends(invoice: Invoice) -> bool:
    return (invoice.tenant.suspended_reason or "").startswith(f"Unpaid invoice #{invoice.pk} ")


def invoices_overdue(*, now: datetime) -> Q:
    """Finalized, unpaid invoices with something to pay, past their due date plus the grace."""
    cutoff = now - timedelta(days=settings.METERING_DUNNING_GRACE_DAYS)
    terms = timedelta(days=settings.METERING_PAYMENT_TERMS_DAYS)
    return Q(status=InvoiceStatus.FINALIZED, total__gt=0) & (
        Q(due_at__lte=cutoff) | Q(due_at__isnull=True, finalized_at__lte=cutoff - terms)
    )


def dunning_run(*, now: datetime | None = None) -> list[Tenant]:
    """Suspend each active tenant with an overdue invoice (its oldest named). Safe to run twice."""
    now = now or timezone.now()
    overdue = (
        Invoice.objects.filter(invoices_overdue(now=now), tenant__status=Tenant.Status.ACTIVE)
        .select_related("tenant")
        .order_by("tenant_id", "period_start")
    )
    suspended = []
    seen: set[int] = set()
    for invoice in overdue:
        if invoice.tenant_id in seen:
            continue
        seen.add(invoice.tenant_id)
        with transaction.atomic():
            tenant = Tenant.objects.select_for_update().get(pk=invoice.tenant_id)
            if tenant.status != Tenant.Status.ACTIVE:
                continue
            tenant_set_status(
                tenant=tenant,
                status=Tenant.Status.SUSPENDED,
                reason=dunning_reason(invoice),
                actor=Actor.system(),
            )
            audit_record(
                tenant=tenant,
                actor=Actor.system(),
                action="invoice.dunning_suspend",
                target=invoice,
                data={
                    "due_at": (invoice.due_at or invoice.finalized_at).isoformat(),
                    "total": str(invoice.total),
                },
            )
        suspended.append(tenant)
    return suspended


def dunning_release(*, invoice: Invoice, now: datetime | None = None) -> None:
    """Called when ``invoice`` is paid (inside its transaction): if it is why the tenant is
    suspended, reactivate the tenant, or name its next overdue invoice instead."""
    now = now or timezone.now()
    tenant = Tenant.objects.select_for_update().get(pk=invoice.tenant_id)
    invoice.tenant = tenant
    if tenant.status != Tenant.Status.SUSPENDED or not _suspends(invoice):
        return
    following = (
        Invoice.objects.filter(invoices_overdue(now=now), tenant=tenant)
        .exclude(pk=invoice.pk)
        .order_by("period_start")
        .first()
    )
    if following is not None:
        tenant_set_status(
            tenant=tenant,
            status=Tenant.Status.SUSPENDED,
            reason=dunning_reason(following),
            actor=Actor.system(),
        )
    else:
        tenant_set_status(tenant=tenant, status=Tenant.Status.ACTIVE, actor=Actor.system())
