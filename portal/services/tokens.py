"""API tokens: scopes, creation (never beyond what the maker holds), revocation, and the lookup every
API request makes."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Iterable
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q, TextChoices
from django.utils import timezone

from portal.actors import Actor
from portal.errors import PermissionDenied, ValidationFailed
from portal.models import ROLE_SCOPES, ApiToken, Membership, Scope, Tenant, hash_secret
from portal.services.audit import audit_record
from portal.services.roles import actor_role


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
def token_name_and_expiry_check(name: str | None, expires_at: datetime | None, *, what: str) -> str:
    """A new token's name (stripped, 1-100 characters) and expiry (in the future, or none), for
    tenant and staff tokens alike; 400 naming each field that is wrong."""
    errors: dict[str, list[str]] = {}
    name = (name or "").strip()
    if not name:
        errors["name"] = ["A name is required."]
    elif len(name) > 100:
        errors["name"] = ["Use at most 100 characters."]
    if expires_at is not None and expires_at <= timezone.now():
        errors["expires_at"] = ["The expiry must be in the future."]
    if errors:
        raise ValidationFailed(f"The {what} could not be created.", fields=errors)
    return name


def api_token_create(
    *,
    tenant: Tenant,
    name: str,
    scopes: Iterable[str],
    expires_at: datetime | None = None,
    actor: Actor,
) -> tuple[ApiToken, str]:
    """Make a token; the plaintext is returned once and never stored."""
    name = token_name_and_expiry_check(name, expires_at, what="token")
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
    role = actor_role(actor, tenant)
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
    """The token of ``key_id`` with its effective scopes (its creator's current role and state) and
    its tenant (every request needs it), in one statement. The creator (``created_by``), which only
    writes and a few views ask for, is loaded when first asked.

    A ``raw()`` statement: every API request makes it, and compiling the ORM's form (a subquery for
    the role, a join for the creator's state, the tenant joined) cost more CPU than the rest of a
    small list read. The tenant's columns come back under prefixed names and become its model
    through ``Model.from_db``."""
    token = next(iter(ApiToken.objects.raw(_token_statement(), [key_id])), None)
    if token is None:
        return None
    names = _tenant_attnames()
    token.tenant = Tenant.from_db(
        connection.alias, names, [getattr(token, TENANT_COLUMN_PREFIX + name) for name in names]
    )
    token.effective_scopes = _effective_scopes(
        token, role=token.creator_role, creator_active=bool(token.creator_active)
    )
    return token


TENANT_COLUMN_PREFIX = "tenant__"


@functools.cache
def _tenant_attnames() -> list[str]:
    return [field.attname for field in Tenant._meta.concrete_fields]


@functools.cache
def _token_statement() -> str:
    """SQL for ``_token_with_tenant``, its names from the models' ``_meta``."""
    from django.contrib.auth import get_user_model

    q = connection.ops.quote_name
    user = get_user_model()._meta
    column = Membership._meta.get_field
    token_tenant, token_creator = (q(ApiToken._meta.get_field(n).column) for n in ("tenant", "created_by"))
    tenant_columns = ", ".join(
        f"ten.{q(field.column)} AS {q(TENANT_COLUMN_PREFIX + field.attname)}"
        for field in Tenant._meta.concrete_fields
    )
    return (
        f"SELECT tok.*, mem.{q(column('role').column)} AS creator_role, usr.{q(user.get_field('is_active').column)}"
        f" AS creator_active, {tenant_columns} FROM {q(ApiToken._meta.db_table)} tok"
        f" JOIN {q(Tenant._meta.db_table)} ten ON ten.{q(Tenant._meta.pk.column)} = tok.{token_tenant}"
        f" LEFT JOIN {q(Membership._meta.db_table)} mem ON mem.{q(column('tenant').column)} = tok.{token_tenant}"
        f" AND mem.{q(column('user').column)} = tok.{token_creator}"
        f" LEFT JOIN {q(user.db_table)} usr ON usr.{q(user.pk.column)} = tok.{token_creator}"
        f" WHERE tok.{q(ApiToken._meta.get_field('key_id').column)} = %s"
    )


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
