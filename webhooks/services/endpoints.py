"""Webhook endpoints: create, change, roll the secret, delete (each audited, never with the secret).

The URL is checked by ``webhooks.targets.target_parse`` here and again before every delivery; the
event types must be names of ``webhooks.catalog.EVENT_TYPES`` (or ``["*"]``). The signing secret
(``whsec_`` and 32 random bytes, URL-safe base64) is encrypted with the tenant secrets' keys
(``portal.crypto``) and returned once, to the caller that made or rolled it. A roll may keep the
previous secret for up to a week (``expire_previous_in_s``, like Stripe's): until then every
delivery carries a ``v1`` signature under each, so the receiver can take the new secret in its own
time; with 0 (the default) the old one stops at once.
"""

from __future__ import annotations

import contextlib
import secrets
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.actors import Actor
from portal.crypto import InvalidToken, secret_decrypt, secret_encrypt, secret_rotate
from portal.errors import ValidationFailed
from portal.models import Tenant
from portal.services.audit import audit_record
from webhooks.catalog import ALL, EVENT_TYPES
from webhooks.locks import lock_endpoints_after, lock_tenant_endpoints
from webhooks.models import WebhookEndpoint
from webhooks.targets import TargetRefused, target_parse

SECRET_PREFIX = "whsec_"
MAX_DESCRIPTION = 200
MAX_PREVIOUS_SECRET_S = 7 * 86400


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def endpoint_url_check(url: Any) -> str:
    try:
        target_parse(url, allow_loopback=settings.WEBHOOK_ALLOW_LOOPBACK)
    except TargetRefused as exc:
        raise _fail("url", str(exc)) from None
    return url


def event_types_check(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise _fail("event_types", 'A non-empty list of event type names, or ["*"] for all.')
    if not all(isinstance(v, str) for v in value):
        raise _fail("event_types", "Each must be a string.")
    if ALL in value:
        if len(value) != 1:
            raise _fail("event_types", '"*" (every type) stands alone.')
        return [ALL]
    unknown = sorted({v for v in value if v not in EVENT_TYPES})
    if unknown:
        shown = ", ".join(repr(u[:64]) for u in unknown[:5])
        raise _fail("event_types", f"Unknown event type(s): {shown}. Known: {', '.join(EVENT_TYPES)}.")
    return sorted(set(value))


def _description_check(value: Any) -> str:
    if not isinstance(value, str):
        raise _fail("description", "Must be a string.")
    if len(value) > MAX_DESCRIPTION or any(not c.isprintable() for c in value):
        raise _fail("description", f"At most {MAX_DESCRIPTION} printable characters.")
    return value


def _enabled_check(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail("enabled", "Must be true or false.")
    return value


def _new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def endpoint_secret(endpoint: WebhookEndpoint) -> str:
    """The plaintext signing secret (for the sender only)."""
    return secret_decrypt(endpoint.secret_ciphertext)


def endpoint_signing_secrets(endpoint: WebhookEndpoint, *, now=None) -> list[str]:
    """The secrets a delivery is signed with now: the current one, then the previous one while a
    roll keeps it. Raises ``InvalidToken`` when the current one cannot be decrypted; a previous
    one that cannot is left out (the current signature still holds)."""
    secrets = [secret_decrypt(endpoint.secret_ciphertext)]
    expires = endpoint.previous_secret_expires_at
    if endpoint.previous_secret_ciphertext and expires is not None and expires > (now or timezone.now()):
        with contextlib.suppress(InvalidToken):
            secrets.append(secret_decrypt(endpoint.previous_secret_ciphertext))
    return secrets


def _expire_previous_check(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail("expire_previous_in_s", "Must be a whole number of seconds.")
    if not 0 <= value <= MAX_PREVIOUS_SECRET_S:
        raise _fail(
            "expire_previous_in_s", f"From 0 (the old secret stops now) to {MAX_PREVIOUS_SECRET_S} (7 days)."
        )
    return value


def endpoint_create(
    *, tenant: Tenant, url: Any, event_types: Any, description: Any = "", enabled: Any = True, actor: Actor
) -> tuple[WebhookEndpoint, str]:
    """Make an endpoint (``enabled=False``: made, but sent nothing until enabled); returns it and
    its secret (shown this once)."""
    url = endpoint_url_check(url)
    types = event_types_check(event_types)
    description = _description_check(description)
    enabled = _enabled_check(enabled)
    plaintext = _new_secret()
    now = timezone.now()
    with transaction.atomic():
        lock_tenant_endpoints(tenant_id=tenant.pk)
        if WebhookEndpoint.objects.for_tenant(tenant).count() >= settings.WEBHOOK_MAX_ENDPOINTS:
            raise _fail("url", f"A team has at most {settings.WEBHOOK_MAX_ENDPOINTS} webhook endpoints.")
        endpoint = WebhookEndpoint.objects.create(
            tenant=tenant,
            url=url,
            event_types=types,
            description=description,
            enabled=enabled,
            secret_ciphertext=secret_encrypt(plaintext),
            created_at=now,
            updated_at=now,
        )
        audit_record(
            tenant=tenant,
            actor=actor,
            action="webhook.create",
            target=endpoint,
            data={"url": url, "event_types": types},
        )
    return endpoint, plaintext


def endpoint_update(*, endpoint: WebhookEndpoint, changes: dict[str, Any], actor: Actor) -> WebhookEndpoint:
    """Change ``url``, ``event_types``, ``description`` or ``enabled`` (any others are refused)."""
    checks = {
        "url": endpoint_url_check,
        "event_types": event_types_check,
        "description": _description_check,
        "enabled": _enabled_check,
    }
    unknown = sorted(set(changes) - set(checks))
    if unknown:
        raise _fail(unknown[0], "Not a field that can be changed.")
    values = {name: checks[name](value) for name, value in changes.items()}
    if not values:
        return endpoint
    with transaction.atomic():
        for name, value in values.items():
            setattr(endpoint, name, value)
        endpoint.updated_at = timezone.now()
        endpoint.save(update_fields=[*values, "updated_at"])
        audit_record(
            tenant=endpoint.tenant,
            actor=actor,
            action="webhook.update",
            target=endpoint,
            data={k: v for k, v in values.items() if k != "description"},
        )
    return endpoint


def endpoint_roll_secret(
    *, endpoint: WebhookEndpoint, actor: Actor, expire_previous_in_s: Any = 0
) -> tuple[WebhookEndpoint, str]:
    """A new secret (shown this once); deliveries from now on are signed with it, and with the
    secret it replaces for ``expire_previous_in_s`` seconds more (0: not at all). A roll during
    another's overlap keeps only the secret it replaces."""
    keep_s = _expire_previous_check(expire_previous_in_s)
    plaintext = _new_secret()
    now = timezone.now()
    with transaction.atomic():
        if keep_s:
            endpoint.previous_secret_ciphertext = endpoint.secret_ciphertext
            endpoint.previous_secret_expires_at = now + timedelta(seconds=keep_s)
        else:
            endpoint.previous_secret_ciphertext, endpoint.previous_secret_expires_at = "", None
        endpoint.secret_ciphertext = secret_encrypt(plaintext)
        endpoint.updated_at = now
        endpoint.save(
            update_fields=[
                "secret_ciphertext",
                "previous_secret_ciphertext",
                "previous_secret_expires_at",
                "updated_at",
            ]
        )
        audit_record(
            tenant=endpoint.tenant,
            actor=actor,
            action="webhook.roll_secret",
            target=endpoint,
            data={"expire_previous_in_s": keep_s},
        )
    return endpoint, plaintext


def endpoint_delete(*, endpoint: WebhookEndpoint, actor: Actor) -> None:
    """Delete it with its deliveries' log (pending ones are never sent)."""
    with transaction.atomic():
        audit_record(
            tenant=endpoint.tenant,
            actor=actor,
            action="webhook.delete",
            target=endpoint,
            data={"url": endpoint.url},
        )
        endpoint.delete()


def endpoints_reencrypt(*, batch: int = 500) -> tuple[int, int]:
    """``rotate_secrets``' part for webhooks: every endpoint's secret under the first key.
    Returns (rotated, unreadable)."""
    rotated = unreadable = last = 0
    while True:
        with transaction.atomic():
            rows = lock_endpoints_after(after_id=last, limit=batch)
            if not rows:
                return rotated, unreadable
            for endpoint in rows:
                try:
                    endpoint.secret_ciphertext = secret_rotate(endpoint.secret_ciphertext)
                    if endpoint.previous_secret_ciphertext:
                        endpoint.previous_secret_ciphertext = secret_rotate(
                            endpoint.previous_secret_ciphertext
                        )
                except InvalidToken:
                    unreadable += 1
                    continue
                endpoint.save(update_fields=["secret_ciphertext", "previous_secret_ciphertext"])
                rotated += 1
            last = rows[-1].pk
