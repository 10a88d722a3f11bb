"""Errors the client raises: the API's own (its code, message and fields), a transport failure, or
a webhook delivery whose signature does not hold (``gpupool.webhooks.verify``)."""

from __future__ import annotations

from typing import Any


class GpupoolError(Exception):
    """Base of every error the client raises."""


class ConnectionFailed(GpupoolError):
    """The portal could not be reached (after the retries an idempotent call gets)."""


class ApiError(GpupoolError):
    """The API answered ``{"error": {"code", "message", "fields"}}`` with a 4xx or 5xx status."""

    def __init__(self, status: int, code: str, message: str, fields: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.fields = status, code, message, fields or {}

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_response(cls, status: int, body: Any, text: str = "") -> ApiError:
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            return cls(
                status, str(error.get("code", "error")), str(error.get("message", "")), error.get("fields")
            )
        return cls(status, "error", f"HTTP {status}: {text[:200]}".strip())


class WebhookSignatureError(GpupoolError):
    """A webhook delivery that must be refused (answer it with a 400): ``reason`` is ``missing``
    (no signature header), ``malformed``, ``mismatch`` (not signed with the secret, or the payload
    was changed), ``too_old`` (outside the tolerance: a replay) or ``not_json``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message

    def __str__(self) -> str:
        return self.message
