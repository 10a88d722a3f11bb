"""``/healthz`` (the process answers) and ``/readyz`` (database and broker reachable)."""

from __future__ import annotations

import logging
import time

from django.db import connection
from django.http import JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

logger = logging.getLogger(__name__)


@never_cache
@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


def _check_database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception:
        # The detail (host names, users) goes to the log, never to whoever asks /readyz.
        logger.exception("readyz: the database check failed")
        return "database"
    return None


def _check_broker() -> str | None:
    from portal.celery import app

    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
    except Exception:
        logger.exception("readyz: the broker check failed")
        return "broker"
    return None


@never_cache
@require_GET
def readyz(request):
    checks = {}
    ok = True
    for name, check in (("database", _check_database), ("broker", _check_broker)):
        started = time.perf_counter()
        error = check()
        checks[name] = {
            "ok": error is None,
            "ms": round((time.perf_counter() - started) * 1000, 1),
        }
        ok = ok and error is None
    return JsonResponse(
        {"status": "ok" if ok else "unavailable", "checks": checks}, status=200 if ok else 503
    )
