"""Every row lock metering takes, in one place (Saleor's ``lock_objects.py``).

Lock order, to keep deadlocks out: Invoice rows (several: in id order), then the Tenant row (a
paid invoice may reactivate its tenant; an invoice locked with its tenant locks both). A rate card
and a billing account are locked on their own. Code that needs several takes them in that order.
Suspending a tenant (dunning) stops its workloads inside the transaction, so scheduling's locks
(``scheduling/locks.py``) come after these.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import date

from metering.models import BillingAccount, Invoice, RateCard
from portal.models import Tenant


def lock_invoice(*, invoice_id: int) -> Invoice:
    """One invoice row, locked until the transaction ends (every status change goes through this)."""
    return Invoice.objects.select_for_update().get(pk=invoice_id)


def lock_invoice_with_tenant(*, invoice_id: int) -> Invoice:
    """One invoice with its tenant loaded; both rows are locked (``FOR UPDATE`` covers the join)."""
    return Invoice.objects.select_for_update().select_related("tenant").get(pk=invoice_id)


def lock_period_invoices(*, tenant_ids: Iterable[int], period_start: date) -> list[Invoice]:
    """The invoices of these tenants for the period starting ``period_start``, locked in id order."""
    return list(
        Invoice.objects.select_for_update()
        .filter(tenant_id__in=list(tenant_ids), period_start=period_start)
        .order_by("pk")
    )


def lock_tenant(*, tenant_id: int) -> Tenant:
    """A tenant row, locked while dunning reads its standing and changes its status, so a payment
    and a dunning run cannot both act on a stale status."""
    return Tenant.objects.select_for_update().get(pk=tenant_id)


def lock_rate_card(*, rate_card_id: int) -> RateCard:
    """A rate card, locked while its versions are rewritten, so two price changes do not interleave."""
    return RateCard.objects.select_for_update().get(pk=rate_card_id)


def lock_billing_account(*, tenant: Tenant) -> BillingAccount:
    """The tenant's billing account, made on first use, locked: the Stripe customer id is written once."""
    account, _ = BillingAccount.objects.select_for_update().get_or_create(tenant=tenant)
    return account


def lock_billing_account_by_customer(*, customer_id: str) -> BillingAccount | None:
    """The billing account of a Stripe customer id, if any, locked while a customer event updates it."""
    return BillingAccount.objects.select_for_update().filter(stripe_customer_id=customer_id).first()
