"""Members: role changes and removal. A tenant keeps at least one owner, and what a person's role no
longer allows (tokens, open invitations) is revoked with the change."""

from __future__ import annotations

from django.db import transaction

from portal.actors import Actor
from portal.errors import Conflict
from portal.locks import lock_owners
from portal.models import ROLE_SCOPES, ApiToken, Invitation, Membership, Role, Tenant, User
from portal.services.audit import audit_record
from portal.services.invitations import invitation_revoke
from portal.services.roles import clean_role, require_can_grant, role_may_invite
from portal.services.tokens import api_token_revoke


@transaction.atomic
def membership_change_role(*, membership: Membership, role: str, actor: Actor) -> Membership:
    role = clean_role(role)
    tenant = membership.tenant
    if role == membership.role:
        return membership
    require_can_grant(actor, tenant, role)
    require_can_grant(actor, tenant, membership.role)
    if membership.role == Role.OWNER and lock_owners(tenant=tenant) <= 1:
        raise Conflict(
            "A tenant needs at least one owner: make someone else an owner first.",
            fields={"role": ["This is the last owner."]},
            code="last_owner",
        )
    old = membership.role
    membership.role = role
    membership.save(update_fields=["role"])
    audit_record(
        tenant=tenant,
        actor=actor,
        action="member.role_change",
        target=membership,
        data={"from": old, "to": role},
    )
    _revoke_beyond_role(tenant=tenant, user=membership.user, role=role, actor=actor)
    return membership


def _revoke_beyond_role(*, tenant: Tenant, user: User, role: str | None, actor: Actor) -> None:
    """What a person made that their role (None: removed) no longer allows: tokens with a scope
    beyond it and open invitations they could not send now. Each revocation is audited."""
    allowed = ROLE_SCOPES.get(role, frozenset()) if role else frozenset()
    tokens = ApiToken.objects.filter(tenant=tenant, created_by=user, revoked_at__isnull=True)
    for token in tokens:
        if not set(token.scopes) <= allowed:
            api_token_revoke(token=token, actor=actor)
    for invitation in Invitation.objects.filter(tenant=tenant, invited_by=user, accepted_at__isnull=True):
        if not role_may_invite(role, invitation.role):
            invitation_revoke(invitation=invitation, actor=actor)


@transaction.atomic
def membership_remove(*, membership: Membership, actor: Actor) -> None:
    tenant = membership.tenant
    require_can_grant(actor, tenant, membership.role)
    if membership.role == Role.OWNER and lock_owners(tenant=tenant) <= 1:
        raise Conflict(
            "The last owner cannot be removed: make someone else an owner first.",
            code="last_owner",
        )
    audit_record(
        tenant=tenant,
        actor=actor,
        action="member.remove",
        target=membership,
        data={"email": membership.user.email, "role": membership.role},
    )
    # Tokens the member made and invitations they sent end with their membership.
    _revoke_beyond_role(tenant=tenant, user=membership.user, role=None, actor=actor)
    membership.delete()
