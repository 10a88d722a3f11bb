"""Writes for tenancy: tenants, members, invitations, API tokens, and the audit log.

Every function here is keyword-only, runs in one transaction and records an AuditEvent for a change
a person (or a token) made.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.mail import send_mail
from django.core.validators import validate_email
from django.db import IntegrityError, connection, transaction
from django.db.models import Model, Q, TextChoices
from django.template.loader import render_to_string
from django.utils import timezone

from portal.actors import Actor
from portal.errors import Conflict, NotFound, PermissionDenied, ValidationFailed
from portal.models import (
    ROLE_SCOPES,
    ApiToken,
    AuditEvent,
    Invitation,
    Membership,
    Role,
    Scope,
    Tenant,
    User,
    hash_secret,
    slug_validator,
)
from portal.signals import tenant_suspended

# --- audit ----------------------------------------------------------------------------------------


def audit_record(
    *,
    tenant: Tenant | None,
    actor: Actor,
    action: str,
    target: Model | None = None,
    data: dict[str, Any] | None = None,
) -> AuditEvent:
    return AuditEvent.objects.create(
        tenant=tenant,
        actor_type=actor.kind,
        actor_user=actor.user,
        actor_token=actor.token,
        actor_repr=str(actor)[:200],
        action=action,
        target_type=target._meta.label_lower if target is not None else "",
        target_id=str(target.pk) if target is not None else "",
        target_repr=str(target)[:200] if target is not None else "",
        data=data or {},
    )


# --- users and tenants ------------------------------------------------------------------------------


def _clean_email(email: str, field: str = "email") -> str:
    email = (email or "").strip().lower()
    try:
        validate_email(email)
    except DjangoValidationError:
        raise ValidationFailed(
            f"{email!r} is not a valid email address.", fields={field: ["Enter a valid email address."]}
        ) from None
    return email


def user_get_or_create(*, email: str, password: str | None = None, full_name: str = "") -> tuple[User, bool]:
    email = _clean_email(email)
    user = User.objects.filter(email__iexact=email).first()
    if user is not None:
        return user, False
    user = User.objects.create_user(email=email, password=password, full_name=full_name)
    if password is None:
        user.set_unusable_password()
        user.save(update_fields=["password"])
    return user, True


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
    owner_email = _clean_email(owner_email, "owner_email")
    billing_email = _clean_email(billing_email or owner_email, "billing_email")

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


def user_send_account_setup(*, user: User, tenant: Tenant) -> None:
    """Email a new owner the link to choose a password (a password-reset link: it proves the
    address and works once)."""
    from django.contrib.auth.tokens import default_token_generator
    from django.urls import reverse
    from django.utils.encoding import force_bytes
    from django.utils.http import urlsafe_base64_encode

    path = reverse(
        "portal:password-reset-confirm",
        kwargs={
            "uidb64": urlsafe_base64_encode(force_bytes(user.pk)),
            "token": default_token_generator.make_token(user),
        },
    )
    context = {"user": user, "tenant": tenant, "url": settings.SITE_URL.rstrip("/") + path}
    send_mail(
        subject=f"Your gpupool team {tenant.name} is ready",
        message=render_to_string("portal/email/account_setup.txt", context),
        from_email=settings.DEFAULT_FROM_EMAIL,
        recipient_list=[user.email],
    )


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


# --- members ------------------------------------------------------------------------------------------


def _actor_role(actor: Actor, tenant: Tenant) -> str | None:
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


def _require_can_grant(actor: Actor, tenant: Tenant, role: str) -> None:
    """Only owners may hand out or take away the owner role; system actors may do anything."""
    if actor.kind == "system":
        return
    if role == Role.OWNER and _actor_role(actor, tenant) != Role.OWNER:
        raise PermissionDenied("Only an owner can grant or remove the owner role.")


def _lock_owners(tenant: Tenant) -> int:
    return len(
        list(Membership.objects.select_for_update().filter(tenant=tenant, role=Role.OWNER).values_list("pk"))
    )


def _clean_role(role: str) -> str:
    if role not in Role.values:
        raise ValidationFailed(
            f"{role!r} is not a role.",
            fields={"role": [f"Choose one of: {', '.join(Role.values)}."]},
        )
    return role


@transaction.atomic
def membership_change_role(*, membership: Membership, role: str, actor: Actor) -> Membership:
    role = _clean_role(role)
    tenant = membership.tenant
    if role == membership.role:
        return membership
    _require_can_grant(actor, tenant, role)
    _require_can_grant(actor, tenant, membership.role)
    if membership.role == Role.OWNER and _lock_owners(tenant) <= 1:
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
        if not _role_may_invite(role, invitation.role):
            invitation_revoke(invitation=invitation, actor=actor)


def _role_may_invite(role: str | None, invited_role: str) -> bool:
    """Inviting needs the admin scope; inviting an owner needs the owner role."""
    if role is None or Scope.ADMIN not in ROLE_SCOPES.get(role, frozenset()):
        return False
    return invited_role != Role.OWNER or role == Role.OWNER


@transaction.atomic
def membership_remove(*, membership: Membership, actor: Actor) -> None:
    tenant = membership.tenant
    _require_can_grant(actor, tenant, membership.role)
    if membership.role == Role.OWNER and _lock_owners(tenant) <= 1:
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


# --- invitations ------------------------------------------------------------------------------------


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
    email = _clean_email(email)
    role = _clean_role(role)
    _require_can_grant(actor, tenant, role)
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
    role = _actor_role(Actor(user=inviter), invitation.tenant)
    return _role_may_invite(role, invitation.role)


@transaction.atomic
def invitation_accept(*, token: str, user: User) -> Membership:
    invitation = invitation_lookup(token=token)
    invitation = Invitation.objects.select_for_update().get(pk=invitation.pk)
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


# --- API tokens -----------------------------------------------------------------------------------------


def scopes_clean(scopes: Iterable[str] | None, *, choices: type[TextChoices] = Scope) -> list[str]:
    """A token's scopes from ``choices`` (a tenant token's by default), deduplicated and in the
    choices' order; ValidationFailed naming ``scopes`` for none or an unknown one."""
    scopes = list(dict.fromkeys(scopes or []))
    if not scopes:
        raise ValidationFailed(
            "Choose at least one scope.", fields={"scopes": ["At least one scope is required."]}
        )
    unknown = [s for s in scopes if s not in choices.values]
    if unknown:
        raise ValidationFailed(
            f"Unknown scope {unknown[0]!r}.",
            fields={
                "scopes": [f"Unknown scope {s!r}; choose from {', '.join(choices.values)}." for s in unknown]
            },
        )
    if choices is Scope and Scope.WRITE in scopes and Scope.READ not in scopes:
        scopes.insert(0, Scope.READ)  # writing implies reading
    return [s for s in choices.values if s in scopes]


@transaction.atomic
def api_token_create(
    *,
    tenant: Tenant,
    name: str,
    scopes: Iterable[str],
    expires_at: datetime | None = None,
    actor: Actor,
) -> tuple[ApiToken, str]:
    """Make a token; the plaintext is returned once and never stored."""
    errors: dict[str, list[str]] = {}
    name = (name or "").strip()
    if not name:
        errors["name"] = ["A name is required."]
    elif len(name) > 100:
        errors["name"] = ["Use at most 100 characters."]
    if expires_at is not None and expires_at <= timezone.now():
        errors["expires_at"] = ["The expiry must be in the future."]
    if errors:
        raise ValidationFailed("The token could not be created.", fields=errors)
    clean = scopes_clean(scopes)
    allowed = _actor_scopes(actor, tenant)
    beyond = [s for s in clean if s not in allowed]
    if beyond:
        raise PermissionDenied(
            f"You cannot grant scopes you do not hold: {', '.join(beyond)}.",
        )
    key_id, plaintext, digest = ApiToken.generate()
    token = ApiToken.objects.create(
        tenant=tenant,
        name=name,
        key_id=key_id,
        token_hash=digest,
        scopes=clean,
        created_by=actor.user,
        expires_at=expires_at,
    )
    audit_record(
        tenant=tenant,
        actor=actor,
        action="token.create",
        target=token,
        data={"scopes": clean, "expires_at": expires_at.isoformat() if expires_at else None},
    )
    return token, plaintext


def _actor_scopes(actor: Actor, tenant: Tenant) -> frozenset[str]:
    if actor.token is not None:
        return actor.token.effective_scopes or frozenset()
    if actor.kind == "system":
        return frozenset(Scope.values)
    role = _actor_role(actor, tenant)
    return ROLE_SCOPES.get(role, frozenset()) if role else frozenset()


@transaction.atomic
def api_token_revoke(*, token: ApiToken, actor: Actor) -> ApiToken:
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        audit_record(tenant=token.tenant, actor=actor, action="token.revoke", target=token)
    return token


def api_token_authenticate(*, plaintext: str) -> ApiToken | None:
    """The token this plaintext names, if it exists (whatever its state); touches last-used."""
    parts = (plaintext or "").split("_", 2)
    if len(parts) != 3 or parts[0] != ApiToken.PREFIX:
        return None
    token = _token_with_tenant(parts[1])
    if token is None or not secrets.compare_digest(token.token_hash, hash_secret(plaintext)):
        return None
    return token


def _token_with_tenant(key_id: str) -> ApiToken | None:
    """The token of ``key_id`` with its effective scopes (its creator's current role and state) in
    one statement, then its tenant (every request needs it). The creator (``created_by``), which
    only writes and a few views ask for, is loaded when first asked.

    Both are ``raw()`` statements: every API request makes them, and compiling the ORM's form of the
    first (a subquery for the role, a join for the creator's state, the tenant joined) took 1.2 ms
    of CPU a request, more than the rest of a small list read (bench/api_read.py)."""
    token = next(iter(ApiToken.objects.raw(_token_statement(), [key_id])), None)
    if token is None:
        return None
    token.tenant = next(iter(Tenant.objects.raw(_tenant_statement(), [token.tenant_id])))
    token.effective_scopes = _effective_scopes(
        token, role=token.creator_role, creator_active=bool(token.creator_active)
    )
    return token


@functools.cache
def _token_statement() -> str:
    """SQL for ``_token_with_tenant``, its names from the models' ``_meta``."""
    from django.contrib.auth import get_user_model

    q = connection.ops.quote_name
    user = get_user_model()._meta
    column = Membership._meta.get_field
    token_tenant, token_creator = (q(ApiToken._meta.get_field(n).column) for n in ("tenant", "created_by"))
    return (
        f"SELECT tok.*, mem.{q(column('role').column)} AS creator_role, usr.{q(user.get_field('is_active').column)}"
        f" AS creator_active FROM {q(ApiToken._meta.db_table)} tok"
        f" LEFT JOIN {q(Membership._meta.db_table)} mem ON mem.{q(column('tenant').column)} = tok.{token_tenant}"
        f" AND mem.{q(column('user').column)} = tok.{token_creator}"
        f" LEFT JOIN {q(user.db_table)} usr ON usr.{q(user.pk.column)} = tok.{token_creator}"
        f" WHERE tok.{q(ApiToken._meta.get_field('key_id').column)} = %s"
    )


@functools.cache
def _tenant_statement() -> str:
    q = connection.ops.quote_name
    return f"SELECT * FROM {q(Tenant._meta.db_table)} WHERE {q(Tenant._meta.pk.column)} = %s"


def _effective_scopes(token: ApiToken, *, role: str | None, creator_active: bool) -> frozenset[str] | None:
    """A token's scopes within what its creator's current role allows; None (no authority) when the
    creator is inactive or not a member. A token the system made (no creator) has its own scopes."""
    if token.created_by_id is None:
        return frozenset(token.scopes)
    if not creator_active or role is None:
        return None
    return frozenset(token.scopes) & ROLE_SCOPES.get(role, frozenset())


def api_token_touch(*, token: ApiToken, now: datetime | None = None) -> None:
    """Record use, at most once per resolution window (one cheap conditional UPDATE)."""
    now = now or timezone.now()
    threshold = now - settings.GPUPOOL_TOKEN_LAST_USED_RESOLUTION
    if token.last_used_at is not None and token.last_used_at > threshold:
        return
    ApiToken.objects.filter(pk=token.pk).filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lte=threshold)
    ).update(last_used_at=now)
    token.last_used_at = now


# --- web shell: accounts ------------------------------------------------------------------------------


def _check_password(password: str, user: User) -> None:
    from django.contrib.auth import password_validation

    if not password:
        raise ValidationFailed("Choose a password.", fields={"password": ["A password is required."]})
    try:
        password_validation.validate_password(password, user=user)
    except DjangoValidationError as exc:
        raise ValidationFailed(
            "Choose a stronger password.", fields={"password": list(exc.messages)}
        ) from None


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
    user = User.objects.select_for_update().filter(email__iexact=invitation.email).first()
    if user is not None and user.has_usable_password():
        raise Conflict(
            f"An account for {invitation.email} already exists: sign in to accept the invitation.",
            code="account_exists",
        )
    candidate = user or User(email=invitation.email, full_name=full_name)
    candidate.full_name = full_name or candidate.full_name
    _check_password(password, candidate)
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


@transaction.atomic
def user_update_profile(*, user: User, full_name: str, time_zone: str) -> User:
    """Change a person's display name and the time zone their pages show times in."""
    from zoneinfo import available_timezones

    errors: dict[str, list[str]] = {}
    full_name = (full_name or "").strip()
    if len(full_name) > 150:
        errors["full_name"] = ["Use at most 150 characters."]
    time_zone = (time_zone or "").strip()
    if time_zone not in available_timezones():
        errors["time_zone"] = [f"{time_zone[:64]!r} is not a time zone such as Europe/Berlin."]
    if errors:
        raise ValidationFailed("The profile could not be saved.", fields=errors)
    user.full_name = full_name
    user.time_zone = time_zone
    user.save(update_fields=["full_name", "time_zone"])
    return user
