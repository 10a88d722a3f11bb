"""Every API error has one shape: ``{"error": {"code", "message", "fields"}}``."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from portal.errors import DomainError

logger = logging.getLogger(__name__)

STATUS_CODES = {
    400: "invalid",
    401: "not_authenticated",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "throttled",
    500: "server_error",
    503: "unavailable",
}


def error_body(
    status_code: int, message: str, *, code: str | None = None, fields: dict | None = None
) -> dict:
    return {
        "error": {
            "code": code or STATUS_CODES.get(status_code, "error"),
            "message": message,
            "fields": fields or {},
        }
    }


def error_response(status_code: int, message: str, **kwargs: Any) -> JsonResponse:
    return JsonResponse(error_body(status_code, message, **kwargs), status=status_code)


def _flatten(detail: Any) -> Any:
    if isinstance(detail, dict):
        return {k: _flatten(v) for k, v in detail.items()}
    if isinstance(detail, list):
        return [_flatten(v) for v in detail]
    return str(detail)


def _first_message(fields: dict) -> str:
    for name, value in fields.items():
        while isinstance(value, (list, dict)) and value:
            value = value[0] if isinstance(value, list) else next(iter(value.values()))
        if value:
            return str(value) if name == "non_field_errors" else f"{name}: {value}"
    return "Invalid input."


def request_data_refused(exc: BaseException) -> tuple[int, dict] | None:
    """Django's refusals of a request's body while it is parsed (a form with too many fields or
    files, a body over the upload limit) as (status, the API's error body); None for any
    other exception. They are the client's doing: a 400 or 413 naming the limit, never a 500."""
    if isinstance(exc, TooManyFieldsSent):
        limit = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
        return 400, error_body(
            400,
            f"The form has more than {limit} fields (DATA_UPLOAD_MAX_NUMBER_FIELDS): send fewer, or JSON.",
            code="too_many_fields",
        )
    if isinstance(exc, TooManyFilesSent):
        limit = settings.DATA_UPLOAD_MAX_NUMBER_FILES
        return 400, error_body(
            400,
            f"The form has more than {limit} files (DATA_UPLOAD_MAX_NUMBER_FILES).",
            code="too_many_files",
        )
    if isinstance(exc, RequestDataTooBig):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return 413, error_body(
            413, f"The request body is larger than {limit} bytes (DATA_UPLOAD_MAX_MEMORY_SIZE)."
        )
    return None


def exception_handler(exc, context):
    refused = request_data_refused(exc)
    if refused is not None:
        return Response(refused[1], status=refused[0])
    if isinstance(exc, DomainError):
        return Response({"error": exc.as_dict()}, status=exc.status_code)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound("Not found.")
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        logger.exception("Unhandled API error", exc_info=exc)
        return Response(
            error_body(500, "Internal server error."), status=status.HTTP_500_INTERNAL_SERVER_ERROR
        )
    if isinstance(exc, exceptions.ValidationError):
        detail = exc.detail
        fields = _flatten(detail) if isinstance(detail, dict) else {"non_field_errors": _flatten(detail)}
        response.data = error_body(
            response.status_code, _first_message(fields), code="invalid", fields=fields
        )
    else:
        detail = getattr(exc, "detail", str(exc))
        code = getattr(detail, "code", None) if not isinstance(detail, (dict, list)) else None
        response.data = error_body(
            response.status_code,
            str(detail) if not isinstance(detail, (dict, list)) else "Request failed.",
            code=STATUS_CODES.get(response.status_code) or code,
        )
    return response
