"""Stripe through the ``stripe`` library: a Customer per tenant and a Stripe Invoice per invoice.

Every POST carries an idempotency key built from our ids, so a retried task (or the library's own
network retries) never creates a second customer, item or invoice:

- ``gpupool-customer-<tenant id>``
- ``gpupool-invoice-<invoice id>-<attempt>-create``, ``...-item-<line position>``, ``...-finalize``

``attempt`` is ``Invoice.payment_attempt``: a new attempt (new keys) is only made on purpose, when
the Stripe invoice of the previous one was voided there.

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
from portal.errors import ValidationFailed

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


class StripeProvider:
    name = "stripe"

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
