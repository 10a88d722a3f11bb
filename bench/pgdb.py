"""The benchmarks' own PostgreSQL databases: made next to DATABASE_URL's, dropped afterwards."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def server_url(base: str, name: str) -> str:
    """``base`` (a DATABASE_URL) pointed at database ``name`` on the same server."""
    parts = urlsplit(base)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def admin(base_url: str, *statements: str, db_name: str) -> None:
    """Run ``statements`` on the server's maintenance connection, after closing ``db_name``'s."""
    import psycopg

    with psycopg.connect(base_url.replace("postgres://", "postgresql://", 1), autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
            "AND pid <> pg_backend_pid()",
            [db_name],
        )
        for sql in statements:
            conn.execute(sql)


def recreate_database(base_url: str, name: str) -> str:
    """Drop and create database ``name``; returns its URL."""
    admin(base_url, f'DROP DATABASE IF EXISTS "{name}"', f'CREATE DATABASE "{name}"', db_name=name)
    return server_url(base_url, name)


def drop_database(base_url: str, name: str) -> None:
    admin(base_url, f'DROP DATABASE IF EXISTS "{name}"', db_name=name)


BENCH_ENV = {
    "DJANGO_SETTINGS_MODULE": "portal.settings",
    "SECRET_KEY": "bench-only-secret-key-" + "x" * 40,
    "DEBUG": "0",
    "SECURE_SSL_REDIRECT": "0",
    "LOG_LEVEL": "WARNING",
}


def django_on_own_database(name: str, root, **env: str) -> str:
    """Point this process at a fresh database ``name`` next to DATABASE_URL's (exits when that is not
    PostgreSQL) with production-like settings plus ``env``, and set Django up. Returns the base URL,
    for ``drop_database`` afterwards."""
    import os
    import sys

    base = os.environ.get("DATABASE_URL", "")
    if not base.startswith(("postgres://", "postgresql://")):
        sys.exit("Set DATABASE_URL to a PostgreSQL server (the bench makes its own database there).")
    os.environ["DATABASE_URL"] = recreate_database(base, name)
    os.environ.setdefault("GPUPOOL_VAR_DIR", str(root / "var" / "bench"))
    for key, value in {**BENCH_ENV, **env}.items():
        os.environ.setdefault(key, value)
    import django

    django.setup()
    return base
