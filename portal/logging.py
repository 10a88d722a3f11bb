"""Structured logs: a context (request, task, workload, tenant and user ids) that every log record
gets through ``LogContextFilter``, and a JSON formatter (one object per line, orjson).

The context lives in a contextvar, so it follows a request through async code and into the
threads ``sync_to_async`` runs (asgiref copies the context), and a Celery task through its run.
``portal.middleware.RequestIdMiddleware`` binds ``request_id`` (and the tenant and user when it
knows them); ``portal.celery`` binds ``task_id`` and ``task_name``; code that works on a
workload binds ``workload_id`` with ``log_context(workload_id=...)`` or passes it in ``extra``.

``LOG_FORMAT`` chooses the formatter: ``json`` (default when DEBUG is off) or ``plain``.
"""

from __future__ import annotations

import logging
import traceback
from contextlib import contextmanager
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from typing import Any

import orjson

CONTEXT_FIELDS = ("request_id", "task_id", "task_name", "workload_id", "tenant_id", "user_id")
_context: ContextVar[dict[str, Any]] = ContextVar("gpupool_log_context", default={})  # noqa: B039  (never mutated)


def log_context_get() -> dict[str, Any]:
    return dict(_context.get())


def log_context_bind(**values: Any) -> Token:
    """Adds values to the current context (None values are left out); undo with the token."""
    merged = {**_context.get(), **{k: v for k, v in values.items() if v is not None}}
    return _context.set(merged)


def log_context_start(**values: Any) -> Token:
    """Starts a fresh context (a request, a task): nothing of an earlier one is carried over."""
    return _context.set({k: v for k, v in values.items() if v is not None})


def log_context_reset(token: Token) -> None:
    try:
        _context.reset(token)
    except ValueError:  # made in another context (a task finishing in another thread): start empty
        _context.set({})


@contextmanager
def log_context(**values: Any):
    token = log_context_bind(**values)
    try:
        yield
    finally:
        log_context_reset(token)


class LogContextFilter(logging.Filter):
    """Puts the context's ids on every record (values passed in ``extra`` win)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


# Attributes every LogRecord has; anything else on a record came from ``extra`` or the filter.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def _default(value: Any) -> str:
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, the context ids,
    whatever was passed in ``extra``, and the exception with its traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info and record.exc_info[0] is not None:
            out["exc_type"] = record.exc_info[0].__name__
            out["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        if record.stack_info:
            out["stack"] = record.stack_info
        return orjson.dumps(out, default=_default, option=orjson.OPT_NON_STR_KEYS).decode()


class PlainFormatter(logging.Formatter):
    """The usual one-line format, with the context ids that are set appended as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(f"{k}={getattr(record, k)}" for k in CONTEXT_FIELDS if getattr(record, k, None))
        if not ids:
            return line
        head, sep, rest = line.partition("\n")  # keep a traceback below the ids
        return f"{head} [{ids}]{sep}{rest}"


def logging_config(*, fmt: str, level: str) -> dict[str, Any]:
    """``settings.LOGGING`` for ``LOG_FORMAT`` (json or plain) and the root level."""
    if fmt not in ("json", "plain"):
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(f"LOG_FORMAT must be json or plain, not {fmt!r}.")
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": "portal.logging.LogContextFilter"}},
        "formatters": {
            "json": {"()": "portal.logging.JsonFormatter"},
            "plain": {"()": "portal.logging.PlainFormatter"},
        },
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": fmt, "filters": ["context"]},
        },
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            "django": {"handlers": ["console"], "level": "INFO", "propagate": False},
            "django.db.backends": {"level": "WARNING"},
        },
    }
