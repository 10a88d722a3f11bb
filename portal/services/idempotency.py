"""Idempotent creates: a client's ``Idempotency-Key`` header makes a repeated ``POST`` create safe.

The rule, once: the first request with a key (per tenant) runs and its answer is stored with the
key, the route and a hash of the body; a later request with the same key, route and body gets that
answer back without running again; the same key with another route or body is refused (422). Keys
expire after ``IDEMPOTENCY_KEY_TTL``; an expired key is forgotten and may be used again. Only
successful answers (2xx) are kept: a refused request leaves no key, so the client can fix it and
retry with the same one.

Race safety: the key's row is inserted in the same transaction as the create itself
(``portal.api.viewsets.TenantScopedViewSet.dispatch``), so a concurrent request with the same key
waits on the unique index until the first commits (then replays its answer) or rolls back (then
runs itself).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from cryptography.fernet import InvalidToken
from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal.crypto import secret_decrypt, secret_encrypt
from portal.errors import DomainError, ValidationFailed
from portal.models import IdempotencyKey, Tenant

HEADER = "Idempotency-Key"
# Printable ASCII without spaces, as Stripe's and the IETF draft's keys are (UUIDs fit).
KEY_RE = re.compile(r"^[\x21-\x7e]{1,255}$")


class KeyReused(DomainError):
    status_code = 422
    code = "idempotency_key_reused"


@dataclass(frozen=True)
class Replay:
    status_code: int
    body: object


def idempotency_key_validate(value: str) -> str:
    if not KEY_RE.match(value):
        raise ValidationFailed(
            f"{HEADER} must be 1 to 255 printable ASCII characters without spaces.",
            fields={HEADER: ["Invalid key."]},
        )
    return value


def idempotency_key_claim(*, tenant: Tenant, key: str, route: str, body: bytes) -> Replay | IdempotencyKey:
    """Inside the create's transaction: the stored answer to replay, or the new row (claimed until
    the transaction ends) that ``idempotency_key_store`` completes."""
    idempotency_key_validate(key)
    request_hash = hashlib.sha256(body).hexdigest()
    now = timezone.now()
    expired_before = now - settings.IDEMPOTENCY_KEY_TTL
    IdempotencyKey.objects.filter(tenant=tenant, key=key, created_at__lt=expired_before).delete()
    try:
        with transaction.atomic():  # a savepoint: the outer transaction survives a lost race
            return IdempotencyKey.objects.create(
                tenant=tenant, key=key, route=route, request_hash=request_hash, created_at=now
            )
    except IntegrityError:
        pass
    # Another request made it: the unique index waited for its transaction, which committed.
    row = IdempotencyKey.objects.for_tenant(tenant).get(key=key)
    if row.route != route or row.request_hash != request_hash:
        raise KeyReused(
            f"This {HEADER} was used for another request ({row.route}, another body); use a new key.",
            fields={HEADER: ["Already used for another request."]},
        )
    if row.status_code is None:  # only while its own transaction runs, which the insert waited for
        raise DomainError("A request with this Idempotency-Key is still running.", code="conflict")
    try:
        body = json.loads(secret_decrypt(row.response_encrypted))
    except InvalidToken:  # stored under a key since removed from SECRETS_ENCRYPTION_KEYS
        raise KeyReused(
            f"The first answer to this {HEADER} can no longer be read; use a new key.",
            fields={HEADER: ["Its answer is unreadable."]},
        ) from None
    return Replay(status_code=row.status_code, body=body)


def idempotency_key_store(*, row: IdempotencyKey, status_code: int, body: object) -> None:
    """Keep a successful answer; forget the key of a refused one."""
    if 200 <= status_code < 300:
        row.status_code = status_code
        row.response_encrypted = secret_encrypt(json.dumps(body, cls=DjangoJSONEncoder))
        row.save(update_fields=["status_code", "response_encrypted"])
    else:
        row.delete()


def idempotency_keys_purge_expired() -> int:
    cutoff = timezone.now() - settings.IDEMPOTENCY_KEY_TTL
    return IdempotencyKey.objects.filter(created_at__lt=cutoff).delete()[0]
