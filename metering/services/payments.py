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
from django.db.models import Q
from django.utils import timezone

from metering.locks import (
    lock_billing_account_by_customer,
    lock_invoice,
    lock_invoice_with_tenant,
    lock_tenant,
)
from metering.metrics import STRIPE_WEBHOOKS
from metering.models import Invoice, InvoiceStatus, StripeEvent, StripeEventResult
from metering.money import quantize_money
from metering.payments import provider_get
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


# --- submitting ---------------------------------------------------------------------------------


def invoice_payment_submit(*, invoice_id: int) -> Invoice:
    """Hand a finalized invoice to the payment provider, once. The attempt number is committed
    before the provider is called, so a retry after a crash repeats the same idempotency keys."""
    with transaction.atomic():
        invoice = lock_invoice_with_tenant(invoice_id=invoice_id)
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
            invoice = lock_invoice(invoice_id=invoice_id)
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
    invoice = lock_invoice_with_tenant(invoice_id=invoice.pk)
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
    """Finalized, unpaid invoices with something to pay, more than ``grace_days`` past due."""
    cutoff = now - timedelta(days=grace_days)
    terms = timedelta(days=settings.METERING_PAYMENT_TERMS_DAYS)
    return Q(status=InvoiceStatus.FINALIZED, total__gt=0) & (
        Q(due_at__lte=cutoff) | Q(due_at__isnull=True, finalized_at__lte=cutoff - terms)
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
