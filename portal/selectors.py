"""Reads shared by views and the API for tenancy."""

from __future__ import annotations

from django.db.models import QuerySet

from portal.models import AuditEvent, Membership, Tenant, User


def memberships_for_user(*, user: User) -> QuerySet[Membership]:
    return Membership.objects.filter(user=user).select_related("tenant").order_by("tenant__name")


def membership_active(*, user: User, tenant_id: int | str | None) -> Membership | None:
    """The membership for the tenant chosen in the session, else the user's first tenant."""
    qs = memberships_for_user(user=user)
    if tenant_id:
        chosen = qs.filter(tenant_id=tenant_id).first()
        if chosen is not None:
            return chosen
    return qs.first()


def tenant_members(*, tenant: Tenant) -> QuerySet[Membership]:
    return Membership.objects.for_tenant(tenant).select_related("user").order_by("user__email")


def audit_events_recent(*, tenant: Tenant, limit: int = 20) -> QuerySet[AuditEvent]:
    return AuditEvent.objects.for_tenant(tenant).select_related("actor_user")[:limit]
