"""Stripe through the ``stripe`` library: a Customer per tenant and a Stripe Invoice per invoice.

Every POST carries an idempotency key built from our ids, so a retried task (or the library's own
network retries) never creates a second customer, item or invoice:

- ``gpupool-customer-<tenant id>``
- ``gpupool-invoice-<invoice id>-<attempt>-create``, ``...-item-<line position>``, ``...-finalize``

``attempt`` is ``Invoice.payment_attempt``: a new attempt (new keys) is only made on purpose, by
the sweeper (``metering.services.payments.invoice_payments_sweep``) after :meth:`StripeProvider.lookup`
found no usable Stripe invoice for ours (Stripe keeps idempotency keys for 24 hours only, so a
resubmission days later must look before it creates).

A Stripe invoice is ours when its ``metadata.gpupool_invoice_id`` names our invoice and its customer
is the tenant's; the lookup lists the customer's invoices (the list is consistent at once, the
search API is not).

``settings.STRIPE_API_BASE``, when set, replaces ``https://api.stripe.com`` (tests point it at a
local server).
"""

from __future__ import annotations

import stripe
from django.conf import settings
from django.db import transaction

from metering.locks import lock_billing_account
from metering.models import BillingAccount, Invoice, InvoiceLine
from metering.money import to_minor_units
from metering.payments import Submission
from portal.errors import Conflict, DomainError, ValidationFailed

# Transient failures a task may retry (same idempotency keys); anything else is a real refusal.
TRANSIENT_ERRORS = (stripe.APIConnectionError, stripe.RateLimitError)


def stripe_client() -> stripe.StripeClient:
    if not settings.STRIPE_SECRET_KEY:
        raise ValidationFailed(
            "Stripe is the payment provider but STRIPE_SECRET_KEY is not set.",
            fields={"STRIPE_SECRET_KEY": ["Required for the stripe provider."]},
        )
    extra = {"base_addresses": {"api": settings.STRIPE_API_BASE}} if settings.STRIPE_API_BASE else {}
    return stripe.StripeClient(settings.STRIPE_SECRET_KEY, max_network_retries=2, **extra)


def idempotency_key(invoice: Invoice, step: str) -> str:
    return f"gpupool-invoice-{invoice.pk}-{invoice.payment_attempt}-{step}"


def stripe_customer_ensure(*, client: stripe.StripeClient, tenant) -> str:
    """The tenant's Stripe customer id, creating the customer on first use."""
    account = BillingAccount.objects.filter(tenant=tenant).first()
    if account is not None and account.stripe_customer_id:
        return account.stripe_customer_id
    customer = client.v1.customers.create(
        params={
            "name": tenant.name,
            "email": tenant.billing_email,
            "metadata": {"gpupool_tenant_id": str(tenant.pk), "gpupool_tenant_slug": tenant.slug},
        },
        options={"idempotency_key": f"gpupool-customer-{tenant.pk}"},
    )
    with transaction.atomic():
        account = lock_billing_account(tenant=tenant)
        if not account.stripe_customer_id:
            account.stripe_customer_id = customer.id
            account.save(update_fields=["stripe_customer_id"])
    return account.stripe_customer_id


class ProviderFailed(DomainError):
    """The provider could not do what was asked (unreachable, or it refused); nothing changed here."""

    status_code = 502
    code = "provider_failed"


# Stripe statuses of an invoice that stand for ours: it was sent and is (or was) being collected.
SENT_STATUSES = ("open", "paid", "uncollectible")


def stripe_invoices_of(*, client: stripe.StripeClient, invoice: Invoice) -> list[dict]:
    """Every Stripe invoice of the tenant's customer whose metadata names ``invoice``."""
    account = BillingAccount.objects.filter(tenant_id=invoice.tenant_id).first()
    if account is None or not account.stripe_customer_id:
        return []
    listed = client.v1.invoices.list(params={"customer": account.stripe_customer_id, "limit": 100})
    ours = []
    for found in listed.auto_paging_iter():
        data = found.to_dict()
        if (data.get("metadata") or {}).get("gpupool_invoice_id") == str(invoice.pk):
            ours.append(data)
    return ours


class StripeProvider:
    name = "stripe"

    def lookup(self, *, invoice: Invoice) -> str:
        """The id of a Stripe invoice already sent for ours ('' if none). Drafts a crashed
        submission left behind are deleted, so the next attempt starts clean."""
        client = stripe_client()
        found = stripe_invoices_of(client=client, invoice=invoice)
        sent = [f for f in found if f.get("status") in SENT_STATUSES]
        for draft in (f for f in found if f.get("status") == "draft"):
            client.v1.invoices.delete(draft["id"])
        if not sent:
            return ""
        rank = {status: n for n, status in enumerate(SENT_STATUSES[::-1])}  # paid, then open, ...
        return max(sent, key=lambda f: (rank[f["status"]], f.get("created") or 0))["id"]

    def void(self, *, invoice: Invoice) -> str:
        """Void ours at Stripe before it is voided here: the Stripe invoice (its id, or found by
        metadata) is voided, a draft deleted. Refused (Conflict) when Stripe has it paid, or
        (ProviderFailed) when Stripe cannot be reached or refuses: ours stays finalized."""
        try:
            return self._void(invoice)
        except stripe.StripeError as e:
            raise ProviderFailed(f"Stripe did not void invoice {invoice.pk}: {e}") from e

    def _void(self, invoice: Invoice) -> str:
        client = stripe_client()
        targets = [invoice.external_id] if invoice.external_id else []
        if not targets:
            targets = [f["id"] for f in stripe_invoices_of(client=client, invoice=invoice)]
        for stripe_id in targets:
            current = client.v1.invoices.retrieve(stripe_id).to_dict()
            status = current.get("status")
            if status == "paid":
                raise Conflict(
                    f"Invoice {invoice.pk} is paid at Stripe ({stripe_id}); refund it there, or issue a "
                    "credit note, instead of voiding it."
                )
            if status == "draft":
                client.v1.invoices.delete(stripe_id)
            elif status in ("open", "uncollectible"):
                client.v1.invoices.void_invoice(
                    stripe_id, options={"idempotency_key": f"gpupool-void-{invoice.pk}-{stripe_id}"}
                )
        return ", ".join(targets)

    def collect(self, *, invoice: Invoice) -> Submission:
        client = stripe_client()
        tenant = invoice.tenant
        customer = stripe_customer_ensure(client=client, tenant=tenant)
        currency = invoice.currency.lower()
        created = client.v1.invoices.create(
            params={
                "customer": customer,
                "currency": currency,
                "collection_method": "charge_automatically",
                "auto_advance": False,
                "pending_invoice_items_behavior": "exclude",
                "description": f"GPU usage {invoice.period_start:%Y-%m}",
                "metadata": {
                    "gpupool_invoice_id": str(invoice.pk),
                    "gpupool_tenant_id": str(tenant.pk),
                    "gpupool_period": f"{invoice.period_start:%Y-%m}",
                },
            },
            options={"idempotency_key": idempotency_key(invoice, "create")},
        )
        for line in InvoiceLine.objects.filter(invoice=invoice).order_by("position"):
            amount = to_minor_units(line.amount, invoice.currency)
            if amount == 0:
                continue
            client.v1.invoice_items.create(
                params={
                    "customer": customer,
                    "invoice": created.id,
                    "amount": amount,
                    "currency": currency,
                    "description": line.description[:500],
                    "metadata": {"gpupool_invoice_id": str(invoice.pk), "position": str(line.position)},
                },
                options={"idempotency_key": idempotency_key(invoice, f"item-{line.position}")},
            )
        client.v1.invoices.finalize_invoice(
            created.id,
            params={"auto_advance": True},
            options={"idempotency_key": idempotency_key(invoice, "finalize")},
        )
        return Submission(external_id=created.id)
