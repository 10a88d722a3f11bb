"""Payment providers behind one interface.

A provider is asked to *collect* a finalized invoice; it tells us the outcome later (the Stripe
webhook) or never (manual: finance marks the invoice paid). Which one is used:
``settings.METERING_PAYMENT_PROVIDER`` (``manual``, the default, or ``stripe``).

- :mod:`metering.payments.manual`: nothing is sent anywhere; staff use "Mark paid" in the admin.
- :mod:`metering.payments.stripe`: a Stripe Customer per tenant (created on first use) and a
  Stripe **Invoice** per invoice (not a bare PaymentIntent): one invoice item per line, amounts in
  minor units, then finalized with ``auto_advance`` so Stripe charges the customer's default
  payment method, retries and emails receipts. Our lines, credits and tax stay the record; the Stripe
  invoice is a copy whose total equals ours to the minor unit. ``invoice.paid`` (and friends) reach
  ``/webhooks/stripe/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from django.conf import settings

from portal.errors import ValidationFailed


@dataclass(frozen=True)
class Submission:
    """What a provider did with an invoice: its id at the provider ('' when nothing was sent)."""

    external_id: str = ""


class PaymentProvider(Protocol):
    name: str

    def collect(self, *, invoice) -> Submission:
        """Ask for payment of a finalized invoice. Must be safe to call again for the same
        ``invoice.payment_attempt`` (idempotent at the provider)."""
        ...

    def lookup(self, *, invoice) -> str:
        """The provider's id of an invoice already sent for ours by an earlier attempt ('')."""
        ...

    def void(self, *, invoice) -> str:
        """Void ours at the provider (before it is voided here); the ids voided."""
        ...


def provider_get(name: str | None = None) -> PaymentProvider:
    from metering.payments.manual import ManualProvider
    from metering.payments.stripe import StripeProvider

    name = name or settings.METERING_PAYMENT_PROVIDER
    providers: dict[str, type] = {"manual": ManualProvider, "stripe": StripeProvider}
    if name not in providers:
        raise ValidationFailed(
            f"Unknown payment provider {name!r}.",
            fields={"METERING_PAYMENT_PROVIDER": [f"One of {', '.join(sorted(providers))}."]},
        )
    return providers[name]()
