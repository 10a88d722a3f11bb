"""Strict, fast validation of agent input. Every error names the field (``samples[3].util_pct``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from portal.errors import ValidationFailed


def fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def require_object(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise fail(field, "Expected a JSON object.")
    return value


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
