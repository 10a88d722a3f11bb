"""DB_APPLICATION_NAME: the name PostgreSQL sees for each connection (pg_stat_activity, log %a)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.db import connection

from tests.conftest import postgres_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def application_name(**env) -> str:
    """The application_name portal/settings.py gives the default database under ``env``."""
    code = "from portal import settings as s; print(s.DATABASES['default']['OPTIONS']['application_name'])"
    clean = {k: v for k, v in os.environ.items() if k not in ("DB_APPLICATION_NAME", "DATABASE_URL")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**clean, "DEBUG": "1", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_default_setting_and_url_precedence():
    url = "postgres://u@db.example:5432/gpupool"
    assert application_name(DATABASE_URL=url) == "gpupool"
    assert application_name(DATABASE_URL=url, DB_APPLICATION_NAME="gpupool-web") == "gpupool-web"
    assert (
        application_name(DATABASE_URL=url + "?application_name=from-url", DB_APPLICATION_NAME="gpupool-web")
        == "from-url"
    )


@pytest.mark.django_db
def test_the_server_sees_the_name():
    postgres_only("application_name is a PostgreSQL connection parameter")
    with connection.cursor() as cursor:
        cursor.execute("SELECT application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        assert cursor.fetchone()[0] == connection.settings_dict["OPTIONS"]["application_name"]
