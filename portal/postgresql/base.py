"""Django's PostgreSQL backend (``ENGINE = "portal.postgresql"``) with one change: ``timestamptz``
values are parsed by ``datetime.fromisoformat`` (C) instead of psycopg's pure-Python loader.

Django replaces psycopg's loader with a subclass of the pure-Python one to set the zone, so the C
loader of ``psycopg[binary]`` (final, it cannot be subclassed) is never used: Django ticket #36960
(https://code.djangoproject.com/ticket/36960), psycopg issue #1273
(https://github.com/psycopg/psycopg/issues/1273). Delete this backend, and go back to
``django.db.backends.postgresql`` in settings, once the Django we require reads ``timestamptz``
with psycopg's C loader (the ticket fixed); docs/performance.md has what it saves.
"""

from __future__ import annotations

import functools
from datetime import datetime, tzinfo

from django.db.backends.postgresql import base
from psycopg.adapt import AdaptersMap
from psycopg.types.datetime import TimestamptzLoader


class IsoTzLoader(TimestamptzLoader):
    """What Django's loader returns (the value in ``timezone``, naive when it is None), parsing ISO
    text in C. Anything ``fromisoformat`` refuses (another DateStyle, BC dates, infinity) and
    naive connections get Django's answer: psycopg's parse, given the zone."""

    timezone: tzinfo | None = None  # Django's cursors compare it with the connection's zone

    def load(self, data):
        if self.timezone is not None:
            try:
                return datetime.fromisoformat(bytes(data).decode("ascii")).astimezone(self.timezone)
            except (ValueError, OverflowError, UnicodeDecodeError):
                pass
        return super().load(data).replace(tzinfo=self.timezone)


@functools.lru_cache
def adapters(template: AdaptersMap, timezone: tzinfo | None) -> AdaptersMap:
    """Django's adapters map for a connection, with ``IsoTzLoader`` for ``timestamptz``."""
    ctx = AdaptersMap(template)
    ctx.register_loader("timestamptz", type("IsoTzLoader", (IsoTzLoader,), {"timezone": timezone}))
    return ctx


class DatabaseWrapper(base.DatabaseWrapper):
    def get_connection_params(self):
        params = super().get_connection_params()
        params["context"] = adapters(params["context"], self.timezone)
        return params
