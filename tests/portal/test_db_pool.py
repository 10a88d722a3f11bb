"""DB_POOL_MAX_SIZE: each process borrows its PostgreSQL connections from a pool of that size."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from django.db import connection

from tests.conftest import postgres_only

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import threading, django
django.setup()
from django.db import connection, connections
from django.conf import settings
print("options", settings.DATABASES["default"]["OPTIONS"].get("pool"), settings.DATABASES["default"]["CONN_MAX_AGE"])
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


def test_a_pool_is_used_and_reuses_connections_across_threads():
    postgres_only("the pool is psycopg_pool's")
    db = connection.settings_dict
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "DEBUG": "1",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "DB_POOL_MAX_SIZE": "2",
    }
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "options {'min_size': 1, 'max_size': 2, 'timeout': 10} 0" in out.stdout
    # Eight threads, at most two server connections between them.
    pids = int(out.stdout.split("pids ")[1].split()[0])
    assert 1 <= pids <= 2 and "pool ConnectionPool" in out.stdout


def test_queries_bind_on_the_server_and_are_prepared(tenant):
    """DB_PREPARED_STATEMENTS (on by default): Django's cursors bind parameters on the server and a
    query is prepared on the connection after a few uses, so PostgreSQL plans it once; the API token
    check, which every API request makes, among them."""
    postgres_only("prepared statements are PostgreSQL's")
    import psycopg

    from portal.models import Tenant
    from portal.services import api_token_authenticate

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
