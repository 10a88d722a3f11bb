"""Invitations: sent by email, carrying their sender's authority, accepted once by the invited address
(signed in, or by signing up), revoked, or purged when expired."""

from __future__ import annotations

import secrets
from datetime import datetime

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.template.loader import render_to_string
from django.utils import timezone

from portal.actors import Actor
from portal.errors import Conflict, NotFound, PermissionDenied, ValidationFailed
from portal.locks import lock_invitation, lock_user_by_email
from portal.models import Invitation, Membership, Tenant, User, hash_secret
from portal.services.accounts import check_new_password, clean_email
from portal.services.audit import audit_record
from portal.services.roles import actor_role, clean_role, require_can_grant, role_may_invite


def _send_invitation_email(invitation: Invitation, plaintext: str) -> None:
    from django.urls import reverse

    url = settings.SITE_URL.rstrip("/") + reverse("portal:invitation-accept", args=[plaintext])
    context = {"invitation": invitation, "url": url}
    send_mail(
        subject=f"You are invited to {invitation.tenant.name} on gpupool",
        message=render_to_string("portal/email/invitation.txt", context),
        from_email=settings.DEFAULT_FROM_EMAIL,
        recipient_list=[invitation.email],
    )


@transaction.atomic
def invitation_create(*, tenant: Tenant, email: str, role: str, actor: Actor) -> tuple[Invitation, str]:
    """Invite someone by email; an open invitation to the same address is replaced (a resend)."""
    email = clean_email(email)
    role = clean_role(role)
    require_can_grant(actor, tenant, role)
    if Membership.objects.filter(tenant=tenant, user__email__iexact=email).exists():
        raise Conflict(f"{email} is already a member.", fields={"email": ["Already a member."]})
    Invitation.objects.filter(tenant=tenant, email=email, accepted_at__isnull=True).delete()
    plaintext = secrets.token_urlsafe(32)
    invitation = Invitation.objects.create(
        tenant=tenant,
        email=email,
        role=role,
        token_hash=hash_secret(plaintext),
        invited_by=actor.user,
        expires_at=timezone.now() + settings.GPUPOOL_INVITATION_TTL,
    )
    audit_record(
        tenant=tenant,
        actor=actor,
        action="invitation.create",
        target=invitation,
        data={"email": email, "role": role},
    )
    transaction.on_commit(lambda: _send_invitation_email(invitation, plaintext))
    return invitation, plaintext


def invitation_lookup(*, token: str) -> Invitation:
    invitation = (
        Invitation.objects.select_related("tenant", "invited_by")
        .filter(token_hash=hash_secret(token or ""))
        .first()
    )
    if invitation is None or not invitation.is_open:
        raise NotFound("This invitation does not exist, was already used or has expired.")
    if not _inviter_may_still_invite(invitation):
        raise NotFound("This invitation is no longer valid: whoever sent it can no longer invite.")
    return invitation


def _inviter_may_still_invite(invitation: Invitation) -> bool:
    """An invitation carries its sender's authority, now: an active person who may still grant its
    role in the tenant (staff outside it act as owners). One the system sent has no sender."""
    inviter = invitation.invited_by
    if inviter is None:
        return True
    if not inviter.is_active:
        return False
    role = actor_role(Actor(user=inviter), invitation.tenant)
    return role_may_invite(role, invitation.role)


@transaction.atomic
def invitation_accept(*, token: str, user: User) -> Membership:
    invitation = invitation_lookup(token=token)
    invitation = lock_invitation(invitation_id=invitation.pk)
    if not invitation.is_open:
        raise NotFound("This invitation was already used or has expired.")
    if user.email.lower() != invitation.email.lower():
        raise PermissionDenied(
            f"This invitation is for {invitation.email}; you are signed in as {user.email}."
        )
    membership, created = Membership.objects.get_or_create(
        tenant=invitation.tenant, user=user, defaults={"role": invitation.role}
    )
    invitation.accepted_at = timezone.now()
    invitation.accepted_by = user
    invitation.save(update_fields=["accepted_at", "accepted_by"])
    if created:
        audit_record(
            tenant=invitation.tenant,
            actor=Actor(user=user),
            action="member.add",
            target=membership,
            data={"role": membership.role, "invitation": invitation.pk},
        )
    return membership


@transaction.atomic
def invitation_revoke(*, invitation: Invitation, actor: Actor) -> None:
    audit_record(
        tenant=invitation.tenant,
        actor=actor,
        action="invitation.revoke",
        target=invitation,
        data={"email": invitation.email},
    )
    invitation.delete()


def invitations_purge_expired(*, now: datetime | None = None) -> int:
    deleted, _ = Invitation.objects.filter(
        accepted_at__isnull=True, expires_at__lte=now or timezone.now()
    ).delete()
    return deleted


@transaction.atomic
def invitation_accept_signup(*, token: str, password: str, full_name: str = "") -> Membership:
    """Accept an invitation by creating the invited person's account, in one transaction.

    The email address is the invitation's. An account that already has a password must sign in and
    accept instead (Conflict); one without a usable password (made by an operator) gets this one.
    """
    invitation = invitation_lookup(token=token)
    full_name = (full_name or "").strip()
    if len(full_name) > 150:
        raise ValidationFailed("The name is too long.", fields={"full_name": ["Use at most 150 characters."]})
    user = lock_user_by_email(email=invitation.email)
    if user is not None and user.has_usable_password():
        raise Conflict(
            f"An account for {invitation.email} already exists: sign in to accept the invitation.",
            code="account_exists",
        )
    candidate = user or User(email=invitation.email, full_name=full_name)
    candidate.full_name = full_name or candidate.full_name
    check_new_password(password, candidate)
    if user is None:
        try:
            with transaction.atomic():
                user = User.objects.create_user(
                    email=invitation.email, password=password, full_name=full_name
                )
        except IntegrityError:  # the same person submitted twice at once
            raise Conflict(
                f"An account for {invitation.email} was just created: sign in to accept the invitation.",
                code="account_exists",
            ) from None
    else:
        user.set_password(password)
        user.full_name = candidate.full_name
        user.save(update_fields=["password", "full_name"])
    return invitation_accept(token=token, user=user)
