"""Every row lock tenancy takes, in one place (Saleor's ``lock_objects.py``).

Lock order, to keep deadlocks out: a User row, then an Invitation row, then a tenant's owner
Membership rows. Code that needs several takes them in that order (accepting an invitation by
signing up locks the invited address's account, then the invitation). Metering also locks Tenant
rows, in its own order (``metering/locks.py``).
"""

from __future__ import annotations

from portal.models import Invitation, Membership, Role, Tenant, TenantSecret, User


def lock_user_by_email(*, email: str) -> User | None:
    """The account of ``email`` (any case), if there is one, locked: two sign-ups for one invited
    address give it one password."""
    return User.objects.select_for_update().filter(email__iexact=email).first()


def lock_invitation(*, invitation_id: int) -> Invitation:
    """One invitation row, locked until the transaction ends, so it is accepted once."""
    return Invitation.objects.select_for_update().get(pk=invitation_id)


def lock_owners(*, tenant: Tenant) -> int:
    """The tenant's owner memberships, locked; returns how many there are. Taken before an owner is
    demoted or removed, so two such changes cannot together leave the tenant without an owner."""
    return len(
        list(Membership.objects.select_for_update().filter(tenant=tenant, role=Role.OWNER).values_list("pk"))
    )


def lock_secrets_after(*, after_id: int, limit: int) -> list[TenantSecret]:
    """The next ``limit`` tenant secrets by id, locked: ``rotate_secrets`` re-encrypts them while a
    concurrent replace of one waits, so neither overwrites the other's ciphertext."""
    return list(TenantSecret.objects.select_for_update().filter(pk__gt=after_id).order_by("pk")[:limit])
