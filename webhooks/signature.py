"""Signing and verifying webhook deliveries, like Stripe's: plain Python, no Django.

A delivery carries ``Gpupool-Signature: t=<unix seconds>,v1=<hex>``, where the hex is the
HMAC-SHA256, keyed by the endpoint's secret (the whole ``whsec_...`` text, as UTF-8), of
``"<t>." + body`` (the raw request body, byte for byte). A receiver recomputes it over the body it
got, compares in constant time, and refuses a timestamp further than ``tolerance_s`` from its clock,
so a captured delivery cannot be replayed later. Several ``v1`` entries may be present (a header
signed with more than one secret); one match is enough.

This module imports nothing outside the standard library, so the client package can expose
``verify`` to receivers as it is.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable

HEADER = "Gpupool-Signature"
SCHEME = "v1"
DEFAULT_TOLERANCE_S = 300

__all__ = ["DEFAULT_TOLERANCE_S", "HEADER", "SignatureError", "compute", "sign", "verify"]


class SignatureError(ValueError):
    """The header is missing or malformed, no signature matches, or the timestamp is too old."""


def compute(secret: str, body: bytes, timestamp: int) -> str:
    """The hex HMAC-SHA256 of ``"<timestamp>." + body`` under ``secret``."""
    message = str(int(timestamp)).encode("ascii") + b"." + body
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def sign(secret: str | Iterable[str], body: bytes, timestamp: int | None = None) -> str:
    """The header value for ``body``: ``t=<timestamp>,v1=<hex>`` (``timestamp`` defaults to now);
    with several secrets (the new one and the one it replaces), one ``v1`` under each, in order."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    secrets = [secret] if isinstance(secret, str) else list(secret)
    if not secrets:
        raise ValueError("No secret to sign with.")
    return ",".join([f"t={t}", *(f"{SCHEME}={compute(s, body, t)}" for s in secrets)])


def _parse(header: str) -> tuple[int, list[str]]:
    timestamp: int | None = None
    signatures: list[str] = []
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            continue
        if key == "t":
            if not value.isascii() or not value.isdigit() or len(value) > 12:
                raise SignatureError("The timestamp is not a whole number of seconds.")
            timestamp = int(value)
        elif key == SCHEME:
            signatures.append(value)
    if timestamp is None:
        raise SignatureError("The header has no timestamp (t=).")
    if not signatures:
        raise SignatureError(f"The header has no {SCHEME} signature.")
    return timestamp, signatures


def verify(
    secret: str | Iterable[str],
    body: bytes,
    header: str | None,
    *,
    tolerance_s: int = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> int:
    """Check ``header`` (the ``Gpupool-Signature`` value) against ``body`` and the secret (or any
    of several secrets, while rotating one). Returns the signed timestamp; raises
    ``SignatureError`` saying why otherwise. ``tolerance_s=0`` skips the age check."""
    if not header:
        raise SignatureError(f"No {HEADER} header.")
    if isinstance(body, str):
        raise TypeError("body must be the raw bytes received, not text.")
    timestamp, signatures = _parse(header)
    secrets = [secret] if isinstance(secret, str) else list(secret)
    if not secrets:
        raise SignatureError("No secret to verify with.")
    matched = False
    for s in secrets:
        expected = compute(s, body, timestamp)
        for candidate in signatures:
            # compare_digest on ASCII text; a non-ASCII candidate never matches.
            if candidate.isascii() and hmac.compare_digest(expected, candidate):
                matched = True
    if not matched:
        raise SignatureError("No signature matches the body under the given secret.")
    if tolerance_s > 0:
        clock = time.time() if now is None else now
        if abs(clock - timestamp) > tolerance_s:
            raise SignatureError(f"The timestamp is more than {tolerance_s} s from now.")
    return timestamp
