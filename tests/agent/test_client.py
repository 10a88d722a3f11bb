"""The agent's HTTP client against a real HTTP server: URLs under a path prefix, bodies and headers,
and what it raises when no answer comes."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nodes.agent import __version__
from nodes.agent.client import RETRY, PortalClient, PortalUnreachable, classify, error_text, proxy_for
from tests.conftest import free_port


class _Recorder(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.seen.append(
            {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
        )
        if self.path.startswith("/gpupool/slow"):
            time.sleep(1.0)
        if self.path.startswith("/gpupool/moved"):
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/stolen")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status = 502 if "fail" in self.path else 200
        data = b"<html>bad gateway</html>" if status == 502 else json.dumps({"ok": True}).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the slow path's client gave up first (the timeout test): nobody to answer

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    _Recorder.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_paths_go_under_the_portal_urls_prefix_with_the_body_and_headers(server):
    async def calls():
        client = PortalClient(server + "/gpupool/", timeout_s=5)
        try:
            posted = await client.request("POST", "/agent/v1/register", json={"hostname": "n1"})
            raw = await client.request(
                "POST", "/agent/v1/nodes/3/heartbeat", credential="gpn_3_x", content='{"seq":1}'
            )
            polled = await client.request("GET", "/agent/v1/nodes/3/commands", params={"wait": 2.5})
            failed = await client.request("GET", "/gpupool-fail")
        finally:
            await client.close()
        return posted, raw, polled, failed

    posted, raw, polled, failed = asyncio.run(calls())
    assert (posted.status_code, posted.json()) == (200, {"ok": True})
    first, second, third, _ = _Recorder.seen
    assert (first["method"], first["path"]) == ("POST", "/gpupool/agent/v1/register")
    assert json.loads(first["body"]) == {"hostname": "n1"}
    assert first["headers"]["Content-Type"] == "application/json"
    assert first["headers"]["User-Agent"] == f"gpupool-agent/{__version__}"
    assert "Authorization" not in first["headers"]
    assert second["path"] == "/gpupool/agent/v1/nodes/3/heartbeat"
    assert (second["body"], second["headers"]["Authorization"]) == (b'{"seq":1}', "Node gpn_3_x")
    assert third["path"] == "/gpupool/agent/v1/nodes/3/commands?wait=2.5"
    assert raw.status_code == polled.status_code == 200
    # An answer that is not the protocol's JSON error still reads as its status and first bytes.
    assert failed.status_code == 502
    assert error_text(failed) == "502: <html>bad gateway</html>"
    with pytest.raises(ValueError):
        failed.json()


def test_no_answer_in_time_or_no_server_is_portal_unreachable(server):
    async def slow():
        client = PortalClient(server, timeout_s=5)
        try:
            await client.request("GET", "/gpupool/slow", timeout_s=0.2)
        finally:
            await client.close()

    with pytest.raises(PortalUnreachable, match="Timeout"):
        asyncio.run(slow())

    async def refused():
        client = PortalClient(f"http://127.0.0.1:{free_port()}", timeout_s=2)
        try:
            await client.request("POST", "/agent/v1/register", json={})
        finally:
            await client.close()

    with pytest.raises(PortalUnreachable, match="Connect"):
        asyncio.run(refused())


def test_the_proxy_comes_from_the_environment_once(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert proxy_for("https://portal.example.com") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "localhost,.corp.example")
    assert proxy_for("https://portal.example.com/gpupool") == "http://proxy.internal:3128"
    assert proxy_for("https://portal.corp.example") is None
    assert proxy_for("http://portal.example.com") is None  # HTTP_PROXY is not set


def test_a_redirect_is_never_followed(server):
    """A portal (or something in front of it) answering 3xx must not lead the node's credential and
    the tenants' payloads elsewhere, to plain HTTP included: the agent keeps the batch and retries."""

    async def call():
        client = PortalClient(server + "/gpupool/", timeout_s=5)
        try:
            return await client.request("POST", "/moved", credential="gpn_1_secret", json={"seq": 1})
        finally:
            await client.close()

    response = asyncio.run(call())
    assert response.status_code == 307
    assert classify(response.status_code) == RETRY
    assert [seen["path"] for seen in _Recorder.seen] == ["/gpupool/moved"]
