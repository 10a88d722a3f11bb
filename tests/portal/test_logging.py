"""Structured logs: request ids in and out, the ids on every record, JSON lines, LOG_FORMAT."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient

from portal.logging import JsonFormatter, LogContextFilter, log_context, logging_config

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def json_log():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(LogContextFilter())
    loggers = [logging.getLogger(), logging.getLogger("django")]  # django does not propagate
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def request_lines(lines, path):
    return [r for r in lines() if r["logger"] == "portal.requests" and r["path"] == path]


def test_a_request_logs_one_json_line_with_the_request_id_it_sent(tenant, owner, make_token, client):
    token = make_token(tenant)
    with json_log() as lines:
        response = client.get(
            "/api/v1/me/", HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_X_REQUEST_ID="req-abc.123"
        )
    assert response.status_code == 200
    assert response["X-Request-ID"] == "req-abc.123"
    (line,) = request_lines(lines, "/api/v1/me/")
    assert line["request_id"] == "req-abc.123"
    assert line["message"] == "GET /api/v1/me/ 200"
    assert line["status"] == 200 and line["method"] == "GET" and line["duration_ms"] >= 0
    assert line["tenant_id"] == tenant.pk and line["user_id"] == owner.pk
    assert line["level"] == "INFO" and line["time"].endswith("+00:00")


@pytest.mark.parametrize("sent", [None, "", "has spaces", "x" * 129, "inject\nline"])
def test_a_missing_or_implausible_request_id_is_replaced(db, client, sent):
    extra = {} if sent is None else {"HTTP_X_REQUEST_ID": sent}
    with json_log() as lines:
        response = client.get("/login/", **extra)
    rid = response["X-Request-ID"]
    assert rid != sent and len(rid) == 32 and int(rid, 16) >= 0
    (line,) = request_lines(lines, "/login/")
    assert line["request_id"] == rid and "tenant_id" not in line


def test_every_record_during_a_request_has_its_id_and_an_error_its_traceback(db, client, monkeypatch):
    from portal.api import views

    def broken(self, request):
        logging.getLogger("portal.api.views").warning("about to fail", extra={"workload_id": 7})
        raise RuntimeError("boom")

    monkeypatch.setattr(views.MeView, "get", broken)
    monkeypatch.setattr(views.MeView, "permission_classes", [])
    monkeypatch.setattr(views.MeView, "authentication_classes", [])
    with json_log() as lines:
        response = client.get("/api/v1/me/", HTTP_X_REQUEST_ID="r-500")
    assert response.status_code == 500 and response["X-Request-ID"] == "r-500"
    ours = [r for r in lines() if r.get("request_id") == "r-500"]
    warning = next(r for r in ours if r["message"] == "about to fail")
    assert warning["workload_id"] == 7
    error = next(r for r in ours if r["level"] == "ERROR")
    assert error["exc_type"] == "RuntimeError" and "boom" in error["exc"]
    assert request_lines(lines, "/api/v1/me/")[0]["status"] == 500
    assert not [r for r in lines() if "request_id" in r and r["request_id"] != "r-500"]


@pytest.mark.django_db(transaction=True)
def test_the_async_stack_binds_the_id_too():
    async def get(path, rid):
        return await AsyncClient().get(path, headers={"X-Request-ID": rid})

    with json_log() as lines:
        assert async_to_sync(get)("/healthz", "async-1")["X-Request-ID"] == "async-1"
        assert async_to_sync(get)("/login/", "async-2")["X-Request-ID"] == "async-2"
        assert async_to_sync(get)("/api/v1/nope/", "async-3").status_code == 404
    assert request_lines(lines, "/login/")[0]["request_id"] == "async-2"
    assert not request_lines(lines, "/healthz")  # probes are not logged
    # Django logs 4xx/5xx answers after the middleware chain: the id is still on that line.
    not_found = [r for r in lines() if r["logger"] == "django.request"]
    assert not_found and all(r["request_id"] == "async-3" and r["status_code"] == 404 for r in not_found)


def test_log_context_nests_and_unwinds():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", (), None)
    with log_context(task_id="t1"), log_context(workload_id=5):
        LogContextFilter().filter(record)
    assert (record.task_id, record.workload_id) == ("t1", 5)
    later = logging.LogRecord("x", logging.INFO, __file__, 1, "m", (), None)
    LogContextFilter().filter(later)
    assert not hasattr(later, "task_id")


def test_log_format_must_be_json_or_plain():
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="LOG_FORMAT"):
        logging_config(fmt="xml", level="INFO")


LOG_CHILD = """
import logging, django
django.setup()
from portal.logging import log_context
with log_context(task_id="t-9"):
    logging.getLogger("scheduling.x").info("placed %s", 3, extra={"workload_id": 11})
"""


@pytest.mark.parametrize(
    ("debug", "fmt", "json_expected"), [("0", None, True), ("1", None, False), ("1", "json", True)]
)
def test_the_settings_pick_the_format(debug, fmt, json_expected):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "DEBUG": debug,
        "SECRET_KEY": "x" * 50,
        "GPUPOOL_VAR_DIR": str(ROOT / "var"),
    }
    env.pop("LOG_FORMAT", None)
    if fmt:
        env["LOG_FORMAT"] = fmt
    out = subprocess.run(
        [sys.executable, "-c", LOG_CHILD], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    if json_expected:
        record = json.loads(line)
        assert record["message"] == "placed 3" and record["logger"] == "scheduling.x"
        assert record["task_id"] == "t-9" and record["workload_id"] == 11
    else:
        assert line.endswith("INFO scheduling.x placed 3 [task_id=t-9 workload_id=11]"), line


def test_a_signed_in_persons_request_carries_their_user_and_tenant(tenant, owner, client):
    client.force_login(owner)
    with json_log() as lines:
        response = client.get("/", HTTP_X_REQUEST_ID="web-1")
    assert response.status_code == 200
    (line,) = request_lines(lines, "/")
    assert line["request_id"] == "web-1" and line["user_id"] == owner.pk and line["tenant_id"] == tenant.pk
