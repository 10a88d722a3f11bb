"""Sentry: with SENTRY_DSN an error in a view reaches the DSN's server as an envelope over real HTTP
(a local server stands in for sentry.io); without it the SDK is not initialised."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import django
django.setup()
import sentry_sdk
from django.test import Client
from portal.api import views

def broken(self, request):
    raise RuntimeError("sentry test boom")

views.MeView.get = broken
views.MeView.permission_classes = []
views.MeView.authentication_classes = []
response = Client().get("/api/v1/me/", HTTP_X_REQUEST_ID="sentry-req-1")
assert response.status_code == 500, response.status_code
sentry_sdk.flush(timeout=10)
print("client active:", sentry_sdk.get_client().is_active())
"""


def _decode(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    if encoding == "br":
        import brotli

        return brotli.decompress(body)
    return body


@pytest.fixture
def sentry_server():
    received: list[tuple[str, dict, list[dict]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            raw = _decode(body, self.headers.get("Content-Encoding", ""))
            lines = raw.split(b"\n")
            header = json.loads(lines[0])
            items = [json.loads(line) for line in lines[1:] if line.strip().startswith(b"{")]
            received.append((self.path, header, items))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], received
    server.shutdown()
    server.server_close()


def run_child(tmp_path, **extra_env) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "DEBUG": "1",
        "GPUPOOL_VAR_DIR": str(tmp_path),
        "LOG_LEVEL": "WARNING",
        **extra_env,
    }
    for name in ("SENTRY_DSN", "DATABASE_URL", "REDIS_URL"):
        if name not in extra_env:
            env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_an_error_in_a_view_is_sent_to_the_dsn(sentry_server, tmp_path):
    port, received = sentry_server
    out = run_child(
        tmp_path,
        SENTRY_DSN=f"http://publickey@127.0.0.1:{port}/1",
        SENTRY_ENVIRONMENT="ci",
        SENTRY_RELEASE="gpupool@test",
    )
    assert out.returncode == 0, out.stderr
    assert "client active: True" in out.stdout
    events = [item for path, _, items in received for item in items if "exception" in item]
    assert all(path == "/api/1/envelope/" for path, _, _ in received)
    assert events, received
    event = events[0]
    values = event["exception"]["values"]
    assert any(v["type"] == "RuntimeError" and v["value"] == "sentry test boom" for v in values)
    assert event["environment"] == "ci" and event["release"] == "gpupool@test"
    assert event["tags"]["request_id"] == "sentry-req-1"  # the id of the request's log lines
    # send_default_pii=False: no client address, no cookies, no user.
    request = event.get("request", {})
    assert "REMOTE_ADDR" not in request.get("env", {}) and "cookies" not in request
    assert "user" not in event


def test_without_a_dsn_nothing_is_initialised(tmp_path):
    out = run_child(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "client active: False" in out.stdout
