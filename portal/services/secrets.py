"""Tenant secrets: create, replace, delete (each audited, never with the value), and resolve.

A secret's value is encrypted when it is written (``portal.crypto``) and decrypted in one place
only, ``secrets_resolve``, which the start of a workload on a node calls (through the command
delivery of ``nodes.services.commands``). Pages and the API list names and times, never values.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from django.db import IntegrityError, transaction
from django.utils import timezone

from portal.actors import Actor
from portal.crypto import InvalidToken, secret_decrypt, secret_encrypt, secret_rotate
from portal.errors import DomainError, ValidationFailed
from portal.locks import lock_secrets_after
from portal.models import SECRET_NAME_RE, Tenant, TenantSecret
from portal.services.audit import audit_record

MAX_SECRET_BYTES = 16 * 1024  # a workload's whole environment is at most 64 KiB
_NAME = re.compile(SECRET_NAME_RE, re.ASCII)


class SecretMissing(DomainError):
    """A workload refers to a secret its tenant does not have (any more)."""

    status_code = 400
    code = "secret_missing"


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def secret_name_check(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _fail("name", "1-64 of letters, digits and _ . -, starting with a letter or digit.")
    return name


def _value_check(value: object) -> str:
    if not isinstance(value, str):
        raise _fail("value", "Must be a string.")
    if value == "":
        raise _fail("value", "Must not be empty.")
    if "\x00" in value:
        raise _fail("value", "Must not contain NUL (it becomes an environment variable).")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _fail("value", "Must be valid Unicode text.") from None
    if size > MAX_SECRET_BYTES:
        raise _fail("value", f"At most {MAX_SECRET_BYTES // 1024} KiB.")
    return value


def secret_create(*, tenant: Tenant, name: str, value: str, actor: Actor) -> TenantSecret:
    name = secret_name_check(name)
    ciphertext = secret_encrypt(_value_check(value))
    now = timezone.now()
    try:
        with transaction.atomic():
            secret = TenantSecret.objects.create(
                tenant=tenant, name=name, ciphertext=ciphertext, created_at=now, updated_at=now
            )
            audit_record(
                tenant=tenant, actor=actor, action="secret.create", target=secret, data={"name": name}
            )
    except IntegrityError:
        raise _fail("name", f"A secret named {name!r} exists; replace its value instead.") from None
    return secret


def secret_update(*, secret: TenantSecret, value: str, actor: Actor) -> TenantSecret:
    """Replace the value. Workloads that refer to it get the new value at their next start."""
    secret.ciphertext = secret_encrypt(_value_check(value))
    secret.updated_at = timezone.now()
    with transaction.atomic():
        secret.save(update_fields=["ciphertext", "updated_at"])
        audit_record(
            tenant=secret.tenant,
            actor=actor,
            action="secret.update",
            target=secret,
            data={"name": secret.name},
        )
    return secret


def secret_delete(*, secret: TenantSecret, actor: Actor) -> None:
    """Delete it. A workload that refers to it and starts later fails its start, saying so."""
    with transaction.atomic():
        audit_record(
            tenant=secret.tenant,
            actor=actor,
            action="secret.delete",
            target=secret,
            data={"name": secret.name},
        )
        secret.delete()


def secrets_missing(*, tenant: Tenant, names: Iterable[str]) -> list[str]:
    """Of ``names``, those the tenant has no secret by (sorted)."""
    wanted = set(names)
    if not wanted:
        return []
    have = set(TenantSecret.objects.for_tenant(tenant).filter(name__in=wanted).values_list("name", flat=True))
    return sorted(wanted - have)


def secrets_resolve(*, tenant_id: int, names: Iterable[str]) -> dict[str, str]:
    """The values of the named secrets of a tenant, decrypted. Raises ``SecretMissing`` naming the
    first that is gone, or that no configured key opens (a key dropped before ``rotate_secrets``)."""
    wanted = set(names)
    rows = dict(
        TenantSecret.objects.filter(tenant_id=tenant_id, name__in=wanted).values_list("name", "ciphertext")
    )
    values = {}
    for name in sorted(wanted):
        if name not in rows:
            raise SecretMissing(f"The secret {name!r} does not exist.", fields={"secret": [name]})
        try:
            values[name] = secret_decrypt(rows[name])
        except InvalidToken:
            raise SecretMissing(
                f"The secret {name!r} cannot be decrypted with the configured keys.",
                fields={"secret": [name]},
            ) from None
    return values


def secrets_reencrypt(*, batch: int = 500) -> tuple[int, int]:
    """Re-encrypt every stored secret under the first configured key (``MultiFernet.rotate``).
    Returns (rotated, unreadable): a secret no configured key opens is left as it is and counted."""
    rotated = unreadable = 0
    last = 0
    while True:
        with transaction.atomic():
            rows = lock_secrets_after(after_id=last, limit=batch)
            if not rows:
                return rotated, unreadable
            for secret in rows:
                try:
                    secret.ciphertext = secret_rotate(secret.ciphertext)
                except InvalidToken:
                    unreadable += 1
                    continue
                secret.save(update_fields=["ciphertext"])
                rotated += 1
            last = rows[-1].pk
