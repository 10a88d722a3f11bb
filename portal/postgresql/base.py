"""Django's PostgreSQL backend (``ENGINE = "portal.postgresql"``), except for the check the
connection pool (``DB_POOL_MAX_SIZE``) makes on each connection it lends.

With ``CONN_HEALTH_CHECKS`` Django gives psycopg_pool its own check, ``ConnectionPool.check_connection``,
which sends an empty query: a round trip for every request and every agent heartbeat, 0.17 ms of
CPU each (0.11 in the web process, 0.06 in PostgreSQL), and Django offers no way to give the pool
another. ``DatabaseWrapper.pool`` makes the pool as Django does, with ``check_connection`` below.

A connection idle in the pool receives nothing from the server unless the server is done with it: a
restart, ``pg_terminate_backend`` or ``idle_session_timeout`` sends an error message and closes the
socket, and a crashed backend's socket is closed by the kernel. So the socket is asked first, with
no wait and no round trip (2 us): only when it has something to read, or psycopg already knows the
connection is gone, does the check cost more, and then it is psycopg_pool's own (the pool discards
a connection that fails it and lends another). A server that vanishes without closing anything (a
host gone from the network) is noticed by neither check until TCP gives up.

Values read: Django's adapters map loads every ``timestamptz`` through psycopg's pure-Python
loader (a regular expression and a dozen int() calls: 7 us a value, where the C loaders of
``psycopg[binary]`` take well under one), and ``jsonb`` through the pure-Python text loader. A
workload row holds about ten of them, so a page of fifty spent 3 ms in them. ``adapters`` below
keeps Django's map and its loader's semantics (the value in the connection's zone, ``timezone``
stated on the class as Django checks it) and parses with ``datetime.fromisoformat`` (C), handing
whatever that does not take (a non-ISO DateStyle, BC dates, infinity) to Django's loader.
"""

from __future__ import annotations

import functools
import select
from datetime import datetime, tzinfo

import psycopg
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.backends.base.base import NO_DB_ALIAS
from django.db.backends.postgresql import base
from django.db.backends.postgresql.psycopg_any import BaseTzLoader, get_adapters_template
from psycopg.adapt import AdaptersMap
from psycopg.pq import Format
from psycopg_pool import ConnectionPool

_READABLE = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


def check_connection(conn: psycopg.Connection) -> None:
    """Return quietly for a connection the pool may lend; raise for one it must discard."""
    if conn.closed or conn.broken:
        raise psycopg.OperationalError("the connection is closed")
    poller = select.poll()  # not select(): a web process may hold more than 1,024 descriptors
    poller.register(conn.fileno(), _READABLE)
    if poller.poll(0):
        ConnectionPool.check_connection(conn)


class IsoTzLoader(BaseTzLoader):
    """Django's ``timestamptz`` loader (``timezone``: the zone values are given in, None for naive),
    parsing ISO text in C."""

    def load(self, data):
        try:
            value = datetime.fromisoformat(bytes(data).decode("ascii"))
            if self.timezone is None:
                return value.astimezone(self._timezone).replace(tzinfo=None)  # the connection's wall time
            return value.astimezone(self.timezone)
        except (ValueError, OverflowError, UnicodeDecodeError):
            return super().load(data)  # Django's: its value or its error


@functools.lru_cache
def adapters(use_tz: bool, timezone: tzinfo | None) -> AdaptersMap:
    """Django's adapters map (``get_adapters_template``) with the loaders above and psycopg's C text
    loader (where ``psycopg[binary]`` or ``psycopg[c]`` provides it) for ``jsonb``, ``inet`` and
    ``cidr``, which Django reads as text."""
    ctx = AdaptersMap(get_adapters_template(use_tz, timezone))
    ctx.register_loader("timestamptz", type("IsoTzLoader", (IsoTzLoader,), {"timezone": timezone}))
    text = psycopg.adapters.get_loader(psycopg.adapters.types["text"].oid, Format.TEXT)
    for name in ("jsonb", "inet", "cidr"):
        ctx.register_loader(name, text)
    return ctx


class DatabaseWrapper(base.DatabaseWrapper):
    def get_connection_params(self):
        params = super().get_connection_params()
        params["context"] = adapters(settings.USE_TZ, self.timezone)
        return params

    @property
    def pool(self) -> ConnectionPool | None:
        options = self.settings_dict["OPTIONS"].get("pool")
        if self.alias == NO_DB_ALIAS or not options:
            return None
        if self.alias not in self._connection_pools:
            if self.settings_dict.get("CONN_MAX_AGE", 0) != 0:
                raise ImproperlyConfigured("Pooling doesn't support persistent connections.")
            kwargs = self.get_connection_params()
            kwargs["autocommit"] = True  # as Django's: it sets the transaction mode itself later
            pool = ConnectionPool(
                kwargs=kwargs,
                open=False,
                configure=self._configure_connection,
                check=check_connection,
                **(options if isinstance(options, dict) else {}),
            )
            self._connection_pools.setdefault(self.alias, pool)  # the first thread's wins
        return self._connection_pools[self.alias]
