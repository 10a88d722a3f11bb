"""DB_APPLICATION_NAME: the name PostgreSQL sees for each connection (pg_stat_activity, log %a)."""

from __future__ import annotations

import pytest
from django.db import connection

from tests.conftest import postgres_only, python_run


def application_name(database_url: str, name: str | None = None) -> str:
    """The application_name portal/settings.py gives the default database."""
    code = "from portal import settings as s; print(s.DATABASES['default']['OPTIONS']['application_name'])"
    done = python_run(code, DEBUG="1", DATABASE_URL=database_url, DB_APPLICATION_NAME=name)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_default_setting_and_url_precedence():
    url = "postgres://u@db.example:5432/gpupool"
    assert application_name(url) == "gpupool"
    assert application_name(url, "gpupool-web") == "gpupool-web"
    assert application_name(url + "?application_name=from-url", "gpupool-web") == "from-url"


@pytest.mark.django_db
def test_the_server_sees_the_name():
    postgres_only("application_name is a PostgreSQL connection parameter")
    with connection.cursor() as cursor:
        cursor.execute("SELECT application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        assert cursor.fetchone()[0] == connection.settings_dict["OPTIONS"]["application_name"]
