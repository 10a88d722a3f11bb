"""Domain errors: one base class, rendered by the API as ``{"error": {...}}`` with a 4xx status."""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    status_code = 400
    code = "invalid"

    def __init__(self, message: str, *, fields: dict[str, Any] | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.fields = fields or {}
        if code:
            self.code = code

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "fields": self.fields}


class ValidationFailed(DomainError):
    status_code = 400
    code = "invalid"


class PermissionDenied(DomainError):
    status_code = 403
    code = "permission_denied"


class NotFound(DomainError):
    status_code = 404
    code = "not_found"


class Conflict(DomainError):
    status_code = 409
    code = "conflict"
