"""portal.postgresql reads timestamptz with a loader of its own: the same values as Django's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from django.db import connection
from django.db.backends.postgresql import base
from psycopg.pq import Format

from tests.conftest import postgres_only

TEXTS = [
    "2026-12-03 22:01:33.123456+00",
    "2026-12-03 22:01:33.12345+00",
    "2026-12-03 22:01:33.1+00",
    "2026-12-03 22:01:33+00",
    "2026-12-03 22:01:33.5+05:30",
    "2026-12-03 22:01:33-08",
    "1880-01-01 00:00:00+00:53:28",  # a local mean time offset, in seconds
    "0099-01-01 00:00:00+00",
    "9999-12-31 23:59:59.999999+00",
]


def django_adapters():
    """The adapters map Django's own backend gives this connection."""
    return base.DatabaseWrapper.get_connection_params(connection)["context"]


def loaders():
    from portal.postgresql.base import IsoTzLoader

    oid = psycopg.adapters.types["timestamptz"].oid
    ours = connection.get_connection_params()["context"].get_loader(oid, Format.TEXT)
    django = django_adapters().get_loader(oid, Format.TEXT)
    assert issubclass(ours, IsoTzLoader) and not issubclass(django, IsoTzLoader)
    assert ours.timezone is UTC and django.timezone is UTC
    return ours(oid, connection.connection), django(oid, connection.connection)


@pytest.mark.django_db
def test_timestamps_load_as_djangos_loader_loads_them():
    postgres_only("the PostgreSQL backend's loaders")
    connection.ensure_connection()
    ours, django = loaders()
    for text in TEXTS:
        value = ours.load(text.encode())
        assert value == django.load(text.encode()), text
        assert value.tzinfo is UTC and value.utcoffset() == timedelta(0), text


@pytest.mark.django_db
def test_what_fromisoformat_refuses_gets_djangos_answer():
    postgres_only("the PostgreSQL backend's loaders")
    connection.ensure_connection()
    ours, django = loaders()
    for text in ("infinity", "-infinity", "0044-03-15 12:00:00+00 BC"):
        with pytest.raises(psycopg.DataError) as expected:
            django.load(text.encode())
        with pytest.raises(psycopg.DataError) as got:
            ours.load(text.encode())
        assert str(got.value) == str(expected.value), text
    # Past year 9999 in UTC: psycopg's loader keeps the wall time (no error), and so do these.
    assert ours.load(b"9999-12-31 23:59:59-05") == django.load(b"9999-12-31 23:59:59-05")


@pytest.mark.django_db
def test_a_naive_connection_gets_the_connections_wall_time():
    """USE_TZ off: Django's loader drops the zone from the value in the connection's zone."""
    postgres_only("the PostgreSQL backend's loaders")
    from portal.postgresql.base import adapters

    oid = psycopg.adapters.types["timestamptz"].oid
    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'Asia/Kolkata'")
        try:
            ours = adapters(django_adapters(), None).get_loader(oid, Format.TEXT)(oid, connection.connection)
            django = django_adapters().get_loader(oid, Format.TEXT)
            django = type("Naive", (django,), {"timezone": None})(oid, connection.connection)
            for text in TEXTS[:6]:
                value = ours.load(text.encode())
                assert value == django.load(text.encode()) and value.tzinfo is None, text
        finally:
            cursor.execute("SET TIME ZONE 'UTC'")


@pytest.mark.django_db
def test_the_orm_reads_aware_utc_datetimes_through_it_and_json_as_django_does(tenant):
    postgres_only("the PostgreSQL backend's loaders")
    from portal.models import Tenant
    from portal.postgresql.base import IsoTzLoader

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT '2026-12-03 22:01:33.25+02'::timestamptz, '{\"a\": [1, \"b\"]}'::jsonb, '10.0.0.1'::inet"
        )
        at, data, address = cursor.fetchone()
    assert at == datetime(2026, 12, 3, 20, 1, 33, 250000, tzinfo=UTC) and at.tzinfo is UTC
    assert (data, address) == ('{"a": [1, "b"]}', "10.0.0.1")  # as Django's map: text, decoded later
    oid = psycopg.adapters.types["timestamptz"].oid
    assert issubclass(connection.connection.adapters.get_loader(oid, Format.TEXT), IsoTzLoader)

    created = Tenant.objects.values_list("created", flat=True).get(pk=tenant.pk)
    assert created == tenant.created and created.tzinfo is UTC
