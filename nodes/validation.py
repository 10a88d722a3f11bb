"""Strict, fast validation of agent input. Every error names the field (``samples[3].util_pct``)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import validate_ipv46_address

from portal.errors import ValidationFailed
from portal.inputs import json_loads

# A host name as RFC 1123 has it: dot-separated labels of letters, digits and inner hyphens. A single
# label is allowed (data centres resolve short names); Django's DomainNameValidator wants a TLD.
HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


# Node labels: keys like Kubernetes' (letters, digits, ``-._/``, at most 63), values at most 63 of
# letters, digits and ``-._``. Registration and workloads' node selectors check the same rules.
LABEL_KEY = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"[A-Za-z0-9._-]{0,63}")
MAX_LABELS = 64


def clean_labels(value: Any, field: str, *, max_items: int = MAX_LABELS) -> dict[str, str]:
    """A label object (key -> simple value) as strings, or a 400 naming ``field[key]``."""
    if not isinstance(value, dict):
        raise fail(field, "Expected an object of label keys and values.")
    if len(value) > max_items:
        raise fail(field, f"At most {max_items} labels.")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not LABEL_KEY.fullmatch(k):
            raise fail(
                field, "Label keys are 1-63 letters, digits and -._/, starting and ending alphanumeric."
            )
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, int | float):
            v = str(v)
        if not isinstance(v, str) or not LABEL_VALUE.fullmatch(v):
            raise fail(f"{field}.{k}", "Label values are at most 63 letters, digits and -._.")
        out[k] = v
    return out


def fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def require_object(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise fail(field, "Expected a JSON object.")
    return value


def json_object(body: bytes) -> dict:
    """An agent's request body as a JSON object, parsed as the API parses its bodies (the one depth
    limit, ``portal.inputs.json_loads``): 400 naming ``body`` otherwise."""
    try:
        return require_object(json_loads(body), "body")
    except ValueError as exc:
        raise fail("body", str(exc)) from None


def get_str(obj: dict, key: str, field: str, *, required: bool = False, max_length: int = 255) -> str:
    value = obj.get(key)
    if value is None:
        if required:
            raise fail(field, "This field is required.")
        return ""
    if not isinstance(value, str):
        raise fail(field, "Expected a string.")
    if len(value) > max_length:
        raise fail(field, f"At most {max_length} characters.")
    if required and not value.strip():
        raise fail(field, "This field may not be blank.")
    return value


def get_address(obj: dict, field: str) -> str:
    """A DNS name or an IP address, nothing else (no port, no scheme, no spaces), or "" when absent:
    people paste it into ssh and the portal connects to it."""
    value = get_str(obj, field, field, max_length=253)
    if not value:
        return ""
    try:
        validate_ipv46_address(value)
    except ValidationError:
        if not HOST_NAME.fullmatch(value):
            raise fail(field, "Expected a DNS name or an IP address.") from None
    return value


def get_int(
    obj: dict,
    key: str,
    field: str,
    *,
    required: bool = False,
    default: int | None = None,
    min_value: int | None = None,
    max_value: int | None = None,
) -> int | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise fail(field, "This field is required.")
        return default
    if type(value) is not int:  # bool is an int subclass and is refused
        raise fail(field, "Expected an integer.")
    if min_value is not None and value < min_value:
        raise fail(field, f"Must be at least {min_value}.")
    if max_value is not None and value > max_value:
        raise fail(field, f"Must be at most {max_value}.")
    return value


def get_bool(obj: dict, key: str, field: str, *, default: bool = False) -> bool:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise fail(field, "Expected true or false.")
    return value


def parse_time(value: Any, field: str, *, required: bool = True) -> datetime | None:
    if value is None:
        if required:
            raise fail(field, "This field is required.")
        return None
    if not isinstance(value, str):
        raise fail(field, "Expected an RFC 3339 time string.")
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise fail(field, "Not an RFC 3339 time.") from None
    if dt.tzinfo is None:
        raise fail(field, "The time needs a UTC offset (e.g. a trailing Z).")
    return dt.astimezone(UTC)
