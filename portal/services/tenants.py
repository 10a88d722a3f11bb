"""Tenants: creation with their first owner, and status changes (active, grace, suspended)."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import transaction

from portal.actors import Actor
from portal.errors import ValidationFailed
from portal.models import Membership, Role, Tenant, slug_validator
from portal.services.accounts import clean_email, user_get_or_create, user_send_account_setup
from portal.services.audit import audit_record
from portal.signals import tenant_suspended


@transaction.atomic
def tenant_create(
    *,
    slug: str,
    name: str,
    owner_email: str,
    billing_email: str | None = None,
    currency: str = "USD",
    owner_password: str | None = None,
    actor: Actor,
) -> Tenant:
    errors: dict[str, list[str]] = {}
    slug = (slug or "").strip().lower()
    try:
        slug_validator(slug)
    except DjangoValidationError as exc:
        errors["slug"] = list(exc.messages)
    if not errors.get("slug") and Tenant.objects.filter(slug=slug).exists():
        errors["slug"] = [f"A tenant with slug {slug!r} already exists."]
    name = (name or "").strip()
    if not name:
        errors["name"] = ["A name is required."]
    currency = (currency or "").strip().upper()
    if len(currency) != 3 or not currency.isalpha():
        errors["currency"] = ["Use a three-letter ISO 4217 code such as USD or EUR."]
    if errors:
        raise ValidationFailed("The tenant could not be created.", fields=errors)
    owner_email = clean_email(owner_email, "owner_email")
    billing_email = clean_email(billing_email or owner_email, "billing_email")

    tenant = Tenant.objects.create(slug=slug, name=name, billing_email=billing_email, currency=currency)
    owner, _ = user_get_or_create(email=owner_email, password=owner_password)
    membership = Membership.objects.create(tenant=tenant, user=owner, role=Role.OWNER)
    if not owner.has_usable_password():
        transaction.on_commit(lambda: user_send_account_setup(user=owner, tenant=tenant))
    audit_record(tenant=tenant, actor=actor, action="tenant.create", target=tenant, data={"slug": slug})
    audit_record(
        tenant=tenant, actor=actor, action="member.add", target=membership, data={"role": Role.OWNER}
    )
    return tenant


@transaction.atomic
def tenant_set_status(*, tenant: Tenant, status: str, reason: str = "", actor: Actor) -> Tenant:
    """ACTIVE, GRACE (payment overdue: works as ACTIVE, with a warning) or SUSPENDED. GRACE and
    SUSPENDED need a reason (kept in ``suspended_reason``, shown to the tenant)."""
    if status not in Tenant.Status.values:
        raise ValidationFailed(f"Unknown status {status!r}.", fields={"status": ["Not a valid choice."]})
    if status != Tenant.Status.ACTIVE and not reason.strip():
        raise ValidationFailed(
            f"Say why the tenant is {Tenant.Status(status).label.lower()}.",
            fields={"reason": ["A reason is required."]},
        )
    old = tenant.status
    tenant.status = status
    tenant.suspended_reason = reason.strip()[:255] if status != Tenant.Status.ACTIVE else ""
    tenant.save(update_fields=["status", "suspended_reason"])
    action = {Tenant.Status.SUSPENDED: "suspend", Tenant.Status.GRACE: "grace"}.get(status, "reactivate")
    audit_record(
        tenant=tenant,
        actor=actor,
        action=f"tenant.{action}",
        target=tenant,
        data={"from": old, "to": status, "reason": tenant.suspended_reason},
    )
    if status == Tenant.Status.SUSPENDED and old != Tenant.Status.SUSPENDED:
        tenant_suspended.send(sender=Tenant, tenant=tenant, reason=tenant.suspended_reason, actor=actor)
    return tenant
