"""Encryption of tenant secrets at rest: Fernet (AES-128-CBC with HMAC-SHA256, from the
``cryptography`` package) under a MultiFernet of ``SECRETS_ENCRYPTION_KEYS``.

The first key encrypts; every key decrypts. Rotating a key is three steps: put the new key first in
the list, run ``manage.py rotate_secrets`` (re-encrypts every stored secret under the first key),
then drop the old key. With DEBUG on and no key set, a key derived from SECRET_KEY is used, so a
development checkout works without configuration; a deployment must set its own
(``gpupool.E002``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
from collections.abc import Callable

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

__all__ = [
    "InvalidToken",
    "reencrypt_register",
    "reencrypters",
    "secret_decrypt",
    "secret_encrypt",
    "secret_rotate",
    "secrets_keys",
]

# Other apps that store values under these keys (webhook signing secrets) register how to
# re-encrypt theirs; ``rotate_secrets`` runs each after the tenant secrets. Each returns
# (rotated, unreadable).
_REENCRYPTERS: dict[str, Callable[[], tuple[int, int]]] = {}


def reencrypt_register(what: str, reencrypt: Callable[[], tuple[int, int]]) -> None:
    _REENCRYPTERS[what] = reencrypt


def reencrypters() -> dict[str, Callable[[], tuple[int, int]]]:
    return dict(_REENCRYPTERS)


def secrets_keys() -> tuple[str, ...]:
    """The configured keys, newest first (a derived development key when none is set and DEBUG is on)."""
    keys = tuple(k.strip() for k in settings.SECRETS_ENCRYPTION_KEYS if k.strip())
    if keys:
        return keys
    if not settings.DEBUG:
        raise ImproperlyConfigured("SECRETS_ENCRYPTION_KEYS must be set when DEBUG is off.")
    digest = hashlib.sha256(f"gpupool-dev-secrets:{settings.SECRET_KEY}".encode()).digest()
    return (base64.urlsafe_b64encode(digest).decode(),)


@functools.lru_cache(maxsize=4)
def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    try:
        return MultiFernet([Fernet(k.encode()) for k in keys])
    except ValueError as exc:
        raise ImproperlyConfigured(f"SECRETS_ENCRYPTION_KEYS: not a Fernet key ({exc}).") from None


def secret_encrypt(value: str) -> str:
    return _fernet(secrets_keys()).encrypt(value.encode("utf-8")).decode("ascii")


def secret_decrypt(token: str) -> str:
    """The plaintext; raises ``InvalidToken`` when no configured key opens it."""
    return _fernet(secrets_keys()).decrypt(token.encode("ascii")).decode("utf-8")


def secret_rotate(token: str) -> str:
    """The same plaintext encrypted under the first key (``MultiFernet.rotate``)."""
    return _fernet(secrets_keys()).rotate(token.encode("ascii")).decode("ascii")
