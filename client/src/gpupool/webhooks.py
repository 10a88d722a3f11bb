"""Verifying gpupool's webhook deliveries in a receiver (no Django, no server code).

Each delivery is a POST whose body is one JSON event, ``{"id": "evt_…", "type": "workload.state",
"created": "<ISO 8601>", "data": {…}}``, signed like Stripe's: the ``Gpupool-Signature`` header is
``t=<unix seconds>,v1=<hex>``, where the hex is the HMAC-SHA256, keyed by the endpoint's secret (the
whole ``whsec_…`` text, as UTF-8), of ``"<t>." + body`` (the raw body, byte for byte). ``verify``
recomputes it over the body received, compares in constant time, and refuses a timestamp more than
``tolerance_s`` from this machine's clock, so a captured delivery cannot be replayed later.

A header may carry several ``v1`` entries: after a roll that keeps the old secret a while
(``gpupool webhooks roll-secret ID --keep-old 24h``), the portal signs each delivery with both, so a
receiver accepts it whichever secret it holds. ``secret`` may be several secrets too (the new and
the old, while you switch). One match is enough.

    from gpupool.webhooks import HEADER, verify
    from gpupool.errors import WebhookSignatureError

    try:
        event = verify(request.body, request.headers.get(HEADER), secret)
    except WebhookSignatureError as exc:
        return 400, str(exc)
    if event["type"] == "workload.state": ...

``sign`` makes the header for a body, for testing your own receiver.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Iterable
from typing import Any

from gpupool.errors import WebhookSignatureError

__all__ = [
    "DEFAULT_TOLERANCE_S",
    "HEADER",
    "WebhookSignatureError",
    "sign",
    "signature_timestamp",
    "verify",
]

HEADER = "Gpupool-Signature"
SCHEME = "v1"
DEFAULT_TOLERANCE_S = 300
_MAX_TIMESTAMP_DIGITS = 12


def _compute(secret: str, payload: bytes, timestamp: int) -> str:
    message = str(int(timestamp)).encode("ascii") + b"." + payload
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def _payload_bytes(payload: Any) -> bytes:
    if isinstance(payload, str):
        raise TypeError("payload must be the raw bytes received (request.body), not decoded text.")
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise TypeError(f"payload must be bytes, not {type(payload).__name__}.")
    return bytes(payload)


def _secrets(secret: str | Iterable[str]) -> list[str]:
    if isinstance(secret, str):
        secrets = [secret]
    elif isinstance(secret, Iterable):
        secrets = list(secret)
    else:
        secrets = []
    if not secrets or not all(isinstance(s, str) and s for s in secrets):
        raise ValueError("secret must be the endpoint's signing secret (whsec_…), or a list of them.")
    return secrets


def _parse(header: str) -> tuple[int, list[str]]:
    timestamp: int | None = None
    signatures: list[str] = []
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            continue
        if key == "t":
            if not value.isascii() or not value.isdigit() or len(value) > _MAX_TIMESTAMP_DIGITS:
                raise WebhookSignatureError("malformed", "The timestamp is not a whole number of seconds.")
            timestamp = int(value)
        elif key == SCHEME:
            signatures.append(value)
    if timestamp is None:
        raise WebhookSignatureError("malformed", "The header has no timestamp (t=).")
    if not signatures:
        raise WebhookSignatureError("malformed", f"The header has no {SCHEME} signature.")
    return timestamp, signatures


def sign(payload: bytes, secret: str, timestamp: int | None = None) -> str:
    """The ``Gpupool-Signature`` value the portal would send with ``payload`` (``timestamp``:
    now by default). For tests of a receiver."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    return f"t={t},{SCHEME}={_compute(_secrets(secret)[0], _payload_bytes(payload), t)}"


def signature_timestamp(
    payload: bytes,
    header: str | None,
    secret: str | Iterable[str],
    *,
    tolerance_s: float | None = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> int:
    """Checks the signature as ``verify`` does, without parsing the body; returns the signed
    timestamp (unix seconds)."""
    payload = _payload_bytes(payload)
    keys = _secrets(secret)
    if tolerance_s is not None and tolerance_s < 0:
        raise ValueError("tolerance_s must be positive (or None to skip the age check).")
    if not header:
        raise WebhookSignatureError("missing", f"No {HEADER} header.")
    if isinstance(header, bytes | bytearray):  # some servers hand headers over as bytes
        header = bytes(header).decode("latin-1")
    if not isinstance(header, str):
        raise TypeError(f"header must be the {HEADER} header's text.")
    timestamp, signatures = _parse(header)
    # Every secret against every candidate, so the time taken does not say which one matched.
    matched = False
    for key in keys:
        expected = _compute(key, payload, timestamp)
        for candidate in signatures:
            # compare_digest wants ASCII text; a non-ASCII candidate never matches.
            if candidate.isascii() and hmac.compare_digest(expected, candidate):
                matched = True
    if not matched:
        raise WebhookSignatureError("mismatch", "No signature matches the payload under the given secret.")
    if tolerance_s:
        clock = time.time() if now is None else now
        if abs(clock - timestamp) > tolerance_s:
            raise WebhookSignatureError(
                "too_old", f"The timestamp is more than {tolerance_s:g} s from this machine's clock."
            )
    return timestamp


def verify(
    payload: bytes,
    header: str | None,
    secret: str | Iterable[str],
    tolerance_s: float | None = DEFAULT_TOLERANCE_S,
    *,
    now: float | None = None,
) -> dict:
    """The delivery's event (``id``, ``type``, ``created``, ``data``) once ``header`` (the
    ``Gpupool-Signature`` value) proves that ``payload`` (the raw request body) was signed with
    ``secret`` (or one of several, while rolling it) no more than ``tolerance_s`` seconds from now
    (``None`` or 0: no age check; a receiver that does so should refuse repeated event ids).
    Raises ``WebhookSignatureError`` saying why otherwise; its ``reason`` is ``missing``,
    ``malformed``, ``mismatch``, ``too_old`` or ``not_json``."""
    signature_timestamp(payload, header, secret, tolerance_s=tolerance_s, now=now)
    try:
        event = json.loads(bytes(payload))
    except (UnicodeDecodeError, ValueError):
        event = None
    if not isinstance(event, dict):
        raise WebhookSignatureError("not_json", "The signed payload is not a JSON object.")
    return event
