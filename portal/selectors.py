"""Reads shared by views and the API for tenancy."""

from __future__ import annotations

from django.db.models import QuerySet
from django.utils import timezone

from portal.models import ApiToken, AuditEvent, Invitation, Membership, Role, Tenant, User


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


def invitations_open(*, tenant: Tenant) -> QuerySet[Invitation]:
    return (
        Invitation.objects.for_tenant(tenant)
        .filter(accepted_at__isnull=True, expires_at__gt=timezone.now())
        .select_related("invited_by")
        .order_by("-created")
    )


def api_tokens_for_tenant(*, tenant: Tenant) -> QuerySet[ApiToken]:
    return ApiToken.objects.for_tenant(tenant).select_related("created_by").order_by("-created", "-id")


def tenant_team_summary(*, tenant: Tenant) -> dict[str, object]:
    """Counts for the dashboard: members by role, open invitations, usable tokens."""
    members = tenant_members(tenant=tenant)
    by_role = dict.fromkeys(Role.values, 0)
    for role in members.values_list("role", flat=True):
        by_role[role] += 1
    return {
        "members": sum(by_role.values()),
        "by_role": [(Role(role).label, count) for role, count in by_role.items() if count],
        "open_invitations": invitations_open(tenant=tenant).count(),
        "active_tokens": ApiToken.objects.for_tenant(tenant).usable().count(),
    }


def membership_for_user(*, user: User, tenant_id: int) -> Membership | None:
    """The person's membership in that tenant, if they have one."""
    return memberships_for_user(user=user).filter(tenant_id=tenant_id).first()
