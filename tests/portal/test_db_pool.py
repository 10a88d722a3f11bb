"""DB_POOL_MAX_SIZE: each process borrows its PostgreSQL connections from a pool of that size."""

from __future__ import annotations

from django.db import connection

from tests.conftest import postgres_only, python_run

CHILD = """
import threading, django
django.setup()
from django.db import connection, connections
from django.conf import settings
pool = settings.DATABASES["default"]["OPTIONS"]["pool"]
print("options", {k: v for k, v in pool.items() if k != "check"}, settings.DATABASES["default"]["CONN_MAX_AGE"])
def query():
    with connection.cursor() as c:
        c.execute("SELECT pg_backend_pid()")
        pids.append(c.fetchone()[0])
    connections.close_all()  # back to the pool
pids = []
threads = [threading.Thread(target=query) for _ in range(8)]  # a new thread per request, as ASGI
for t in threads: t.start()
for t in threads: t.join()
print("pids", len(set(pids)), "pool", type(connection.pool).__name__)
"""


def run_with_pool(code: str, pool_size: int) -> str:
    """``code`` in a process of its own with DB_POOL_MAX_SIZE=``pool_size`` on the test database;
    what it printed."""
    db = connection.settings_dict
    out = python_run(
        code,
        DJANGO_SETTINGS_MODULE="portal.settings",
        DEBUG="1",
        DATABASE_URL=f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        DB_POOL_MAX_SIZE=str(pool_size),
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_pool_is_used_and_reuses_connections_across_threads():
    postgres_only("the pool is psycopg_pool's")
    out = run_with_pool(CHILD, 2)
    assert "options {'min_size': 1, 'max_size': 2, 'timeout': 10} 0" in out
    # Eight threads, at most two server connections between them.
    pids = int(out.split("pids ")[1].split()[0])
    assert 1 <= pids <= 2 and "pool ConnectionPool" in out


RESTART_CHILD = """
import time, django
django.setup()
import psycopg
from django.db import connection, connections
def request():
    with connection.cursor() as c:
        c.execute("SELECT pg_backend_pid()")
        pid = c.fetchone()[0]
    connections.close_all()  # the request ends: back to the pool
    return pid
pids = {request() for _ in range(5)}
print("pids", len(pids))
# The server ends the idle connection, as a restart or pg_terminate_backend does.
params = connection.get_connection_params()
with psycopg.connect(**params, autocommit=True) as admin:
    admin.execute("SELECT pg_terminate_backend(%s)", [next(iter(pids))])
time.sleep(0.5)
after = request()
print("replaced", after not in pids, "then", request() == after)
"""


def test_the_pool_replaces_a_connection_the_server_ended():
    """DB_POOL_MAX_SIZE: a connection the server has closed (a restart, pg_terminate_backend) is
    noticed by the pool's check (CONN_HEALTH_CHECKS), discarded and replaced, and the request that
    comes next succeeds."""
    postgres_only("the pool is psycopg_pool's")
    out = run_with_pool(RESTART_CHILD, 1)
    assert "pids 1" in out, out  # five loans of one connection
    assert "replaced True then True" in out, out


def test_queries_bind_on_the_server_and_are_prepared(tenant):
    """DB_PREPARED_STATEMENTS (on by default): Django's cursors bind parameters on the server and a
    query is prepared on the connection after a few uses, so PostgreSQL plans it once; the API token
    check, which every API request makes, among them."""
    postgres_only("prepared statements are PostgreSQL's")
    import psycopg

    from portal.models import Tenant
    from portal.services.tokens import api_token_authenticate

    with connection.cursor() as cursor:
        assert isinstance(cursor.cursor, psycopg.Cursor) and not isinstance(
            cursor.cursor, psycopg.ClientCursor
        )
    for _ in range(6):
        assert Tenant.objects.filter(slug=tenant.slug).first() == tenant
        assert api_token_authenticate(plaintext="gpp_nosuchkey_secret") is None
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [row[0] for row in cursor.fetchall()]
    assert any('FROM "portal_tenant" WHERE "portal_tenant"."slug" = $1' in s for s in prepared), prepared
    assert any('FROM "portal_apitoken"' in s for s in prepared), prepared
