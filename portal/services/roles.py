"""What an actor's role in a tenant allows it to grant: the rules members, invitations and tokens share."""

from __future__ import annotations

from portal.actors import Actor
from portal.errors import PermissionDenied, ValidationFailed
from portal.models import ROLE_SCOPES, Membership, Role, Scope, Tenant


def actor_role(actor: Actor, tenant: Tenant) -> str | None:
    """The actor's role in ``tenant`` now (staff outside it act as owners); None without one."""
    if actor.user is None:
        return None
    if (
        actor.token is None
        and actor.user.is_staff
        and not actor.user.memberships.filter(tenant=tenant).exists()
    ):
        return Role.OWNER  # staff acting through the admin
    m = Membership.objects.filter(tenant=tenant, user=actor.user).only("role").first()
    return m.role if m else None


def require_can_grant(actor: Actor, tenant: Tenant, role: str) -> None:
    """Only owners may hand out or take away the owner role; system actors may do anything."""
    if actor.kind == "system":
        return
    if role == Role.OWNER and actor_role(actor, tenant) != Role.OWNER:
        raise PermissionDenied("Only an owner can grant or remove the owner role.")


def clean_role(role: str) -> str:
    """``role`` if it is a role, else ValidationFailed naming the ``role`` field."""
    if role not in Role.values:
        raise ValidationFailed(
            f"{role!r} is not a role.",
            fields={"role": [f"Choose one of: {', '.join(Role.values)}."]},
        )
    return role


def role_may_invite(role: str | None, invited_role: str) -> bool:
    """Inviting needs the admin scope; inviting an owner needs the owner role."""
    if role is None or Scope.ADMIN not in ROLE_SCOPES.get(role, frozenset()):
        return False
    return invited_role != Role.OWNER or role == Role.OWNER
