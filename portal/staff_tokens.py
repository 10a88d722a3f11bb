"""Writes and the lookup for staff tokens, the only tokens the staff APIs (``/api/staff/v1/``) accept.

A staff token is made by a staff person for themselves (the Django admin, or ``createstafftoken``
run by an operator), carries staff scopes (``StaffScope``) and no tenant, and works only while its
person is active staff: authority follows the person, checked at every request. Creation and
revocation are audited (tenant-less audit events).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from portal.actors import Actor
from portal.errors import PermissionDenied
from portal.models import StaffScope, StaffToken, User, hash_secret
from portal.services.audit import audit_record
from portal.services.tokens import scopes_clean, token_name_and_expiry_check


@transaction.atomic
def staff_token_create(
    *,
    user: User,
    name: str,
    scopes: Iterable[str],
    expires_at: datetime | None = None,
    actor: Actor,
) -> tuple[StaffToken, str]:
    """A token for staff person ``user``; the plaintext is returned once and never stored. Only
    that person (or the system, for the management command) may make it."""
    if not (user.is_active and user.is_staff):
        raise PermissionDenied(f"{user.email} is not active gpupool staff: only staff have staff tokens.")
    if actor.kind != "system" and (actor.token is not None or actor.user is None or actor.user.pk != user.pk):
        raise PermissionDenied("Staff make their own staff tokens, signed in as themselves.")
    name = token_name_and_expiry_check(name, expires_at, what="staff token")
    clean = scopes_clean(scopes, choices=StaffScope)
    key_id, plaintext, digest = StaffToken.generate()
    token = StaffToken.objects.create(
        name=name, key_id=key_id, token_hash=digest, scopes=clean, user=user, expires_at=expires_at
    )
    audit_record(
        tenant=None,
        actor=actor,
        action="staff_token.create",
        target=token,
        data={
            "user": user.email,
            "scopes": clean,
            "expires_at": expires_at.isoformat() if expires_at else None,
        },
    )
    return token, plaintext


@transaction.atomic
def staff_token_revoke(*, token: StaffToken, actor: Actor) -> StaffToken:
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        audit_record(tenant=None, actor=actor, action="staff_token.revoke", target=token)
    return token


def staff_token_authenticate(*, plaintext: str) -> StaffToken | None:
    """The usable staff token this plaintext names, with its person loaded; None when the token is
    unknown, revoked or expired, or its person is no longer active staff."""
    parts = (plaintext or "").split("_", 2)
    if len(parts) != 3 or parts[0] != StaffToken.PREFIX:
        return None
    token = StaffToken.objects.select_related("user").filter(key_id=parts[1]).first()
    if token is None or not secrets.compare_digest(token.token_hash, hash_secret(plaintext)):
        return None
    if token.is_revoked or token.is_expired or not (token.user.is_active and token.user.is_staff):
        return None
    now = timezone.now()
    threshold = now - settings.GPUPOOL_TOKEN_LAST_USED_RESOLUTION
    if token.last_used_at is None or token.last_used_at <= threshold:  # as api_token_touch
        StaffToken.objects.filter(pk=token.pk).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lte=threshold)
        ).update(last_used_at=now)
    return token
