"""Django's PostgreSQL backend (``ENGINE = "portal.postgresql"``), except for the check the
connection pool (``DB_POOL_MAX_SIZE``) makes on each connection it lends, and SELECT shapes kept
between queries (``portal.postgresql.compiler``, ``portal.compiler``).

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
"""

from __future__ import annotations

import select

import psycopg
from django.core.exceptions import ImproperlyConfigured
from django.db.backends.base.base import NO_DB_ALIAS
from django.db.backends.postgresql import base, operations
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


class DatabaseOperations(operations.DatabaseOperations):
    compiler_module = "portal.postgresql.compiler"


class DatabaseWrapper(base.DatabaseWrapper):
    ops_class = DatabaseOperations

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
