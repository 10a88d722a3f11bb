"""E-mail to a tenant's billing contacts: its owners and billing members, and its billing address.

Used by budget alerts and dunning. A mail server outage is logged, never raised: what the e-mail
tells is already recorded and shown in the portal.
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.core.mail import send_mail

from portal.models import Membership, Role, Tenant

logger = logging.getLogger(__name__)


def billing_recipients(*, tenant: Tenant) -> list[str]:
    emails = list(
        Membership.objects.filter(tenant=tenant, role__in=[Role.OWNER, Role.BILLING])
        .order_by("user__email")
        .values_list("user__email", flat=True)
    )
    if tenant.billing_email and tenant.billing_email not in emails:
        emails.append(tenant.billing_email)
    return emails


def billing_contacts_mail(*, tenant: Tenant, subject: str, message: str) -> int:
    """Send one e-mail to the tenant's billing contacts; returns how many were addressed (0 when
    there are none or the mail server failed)."""
    to = billing_recipients(tenant=tenant)
    if not to:
        return 0
    try:
        send_mail(
            subject=f"[gpupool] {tenant.name}: {subject}",
            message=message,
            from_email=settings.DEFAULT_FROM_EMAIL,
            recipient_list=to,
        )
    except Exception:  # recorded and shown already; a mail server outage must not undo it
        logger.exception("Could not e-mail %s (%s) to tenant %s", subject, len(to), tenant.pk)
        return 0
    return len(to)
