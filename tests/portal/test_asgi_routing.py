"""portal/asgi.py: the routes of ASGI_ROUTES claim what must stay on the event loop (the proxy, the
agent protocol, log follow streams); pages and the API go to the WSGI thread pool (a2wsgi),
websockets to Channels."""

from __future__ import annotations

import asyncio
import subprocess
import threading

import httpx
import pytest

from portal import asgi
from tests.conftest import python_run


def _get(path: str, headers: dict | None = None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=asgi.application)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.get(path, headers=headers or {})

    return asyncio.run(go())


def test_the_first_route_that_claims_a_request_serves_it_and_the_rest_go_to_the_pages(monkeypatch):
    seen = []

    def answer(name):
        async def app(scope, receive, send):
            seen.append((name, scope["path"]))
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        return app

    class Route:
        def __init__(self, name, prefix):
            self.name, self.prefix, self.app = name, prefix, answer(name)

        def claims(self, scope):
            return scope["path"].startswith(self.prefix)

        async def __call__(self, scope, receive, send):
            await self.app(scope, receive, send)

    routes = [Route("first", "/agent/v1/"), Route("second", "/agent/")]
    monkeypatch.setattr(asgi, "ROUTES", routes)
    monkeypatch.setattr(asgi, "default_app", answer("pages"))
    for path in ("/agent/v1/nodes/7/commands", "/agent/other", "/api/v1/jobs/", "/healthz"):
        assert _get(path).status_code == 204
    assert seen == [
        ("first", "/agent/v1/nodes/7/commands"),
        ("second", "/agent/other"),
        ("pages", "/api/v1/jobs/"),
        ("pages", "/healthz"),
    ]


def test_the_real_routes_claim_only_their_requests(settings):
    def scope(path, *, method="GET", query=b"", kind="http", host=b"portal.test"):
        return {
            "type": kind,
            "path": path,
            "method": method,
            "query_string": query,
            "headers": [(b"host", host)],
        }

    proxy = asgi.ROUTES[0]
    claimed = {
        name: [route.claims(s) for route in asgi.ROUTES]
        for name, s in {
            "proxy": scope("/proxy/1/8888/"),
            "proxy ws": scope("/proxy/1/8888/ws", kind="websocket"),
            "heartbeat": scope("/agent/v1/nodes/1/heartbeat", method="POST"),
            "register": scope("/agent/v1/register", method="POST"),
            "follow": scope("/api/v1/jobs/3/logs/", query=b"follow=1"),
            "logs page": scope("/api/v1/jobs/3/logs/", query=b"tail=10"),
            "follow=0": scope("/api/v1/jobs/3/logs/", query=b"follow=0"),
            "jobs": scope("/api/v1/jobs/"),
            "events ws": scope("/ws/events/", kind="websocket"),
        }.items()
    }
    assert claimed == {
        "proxy": [True, False, False],
        "proxy ws": [True, False, False],
        "heartbeat": [False, True, False],
        "register": [False, True, False],
        "follow": [False, False, True],
        "logs page": [False, False, False],
        "follow=0": [False, False, False],
        "jobs": [False, False, False],
        "events ws": [False, False, False],
    }
    # With an origin of its own, the proxy claims every request to that host (and answers 404 for
    # anything but itself there).
    settings.PROXY_ORIGIN = "https://apps.test"
    assert proxy.claims(scope("/api/v1/jobs/", host=b"apps.test"))
    assert not proxy.claims(scope("/api/v1/jobs/"))


@pytest.mark.django_db(transaction=True)
def test_the_api_is_answered_by_a_pool_thread_through_the_whole_chain(tenant, make_token, monkeypatch):
    from django.core.handlers.wsgi import WSGIHandler

    from portal.api import views  # noqa: F401  (the URLconf is loaded before the threads race for it)

    threads = []
    original = WSGIHandler.__call__

    def spy(self, environ, start_response):
        threads.append(threading.current_thread().name)
        return original(self, environ, start_response)

    monkeypatch.setattr(WSGIHandler, "__call__", spy)
    response = _get("/api/v1/me/", {"Authorization": f"Bearer {make_token(tenant)}"})
    assert response.status_code == 200, response.text
    assert response.json()["tenant"]["slug"] == "acme"
    assert response.headers["X-Request-ID"]  # RequestIdMiddleware ran
    assert len(threads) == 1 and threads[0] != threading.main_thread().name


def test_the_routes_are_the_ones_the_settings_name(settings):
    """The routes are named in ASGI_ROUTES (portal imports no app), each with the default app behind
    it; the pages' chain is Django's own, settings.MIDDLEWARE as it stands, with nothing of the
    agent protocol in it."""
    from django.core.handlers.wsgi import WSGIHandler

    from nodes.agent_views import AgentProtocolHandler
    from scheduling.log_follow import LogFollow
    from scheduling.proxy import WorkloadProxy

    assert [type(route) for route in asgi.ROUTES] == [WorkloadProxy, AgentProtocolHandler, LogFollow]
    assert all(route.fallback is asgi.default_app for route in asgi.ROUTES)
    assert not [m for m in settings.MIDDLEWARE if m.startswith("nodes.")]
    assert type(asgi.pages_app) is WSGIHandler


def test_a_web_process_freezes_what_it_loaded_before_serving():
    """The heap loaded at start (the apps and the URL conf's views) is out of the garbage collector's
    way: little is left for a full collection to traverse; and young collections run far less often
    than at the default threshold."""
    code = (
        "import gc, sys; import portal.asgi; "
        "print(gc.get_freeze_count(), len(gc.get_objects()), 'scheduling.api' in sys.modules, "
        "gc.get_threshold()[0])"
    )
    done = python_run(code, DJANGO_SETTINGS_MODULE="tests.settings")
    assert done.returncode == 0, done.stderr
    out = done.stdout.split()
    frozen, tracked, views_loaded = int(out[0]), int(out[1]), out[2] == "True"
    assert views_loaded
    assert int(out[3]) >= 10_000  # young collections far rarer than the default 700
    assert frozen > 50_000 and tracked < frozen / 10, (frozen, tracked)


def _switch_interval_after_import(value: str | None = None) -> subprocess.CompletedProcess:
    code = "import sys; import portal.asgi; print(sys.getswitchinterval())"
    return python_run(code, DJANGO_SETTINGS_MODULE="tests.settings", WEB_GIL_SWITCH_INTERVAL_MS=value)


def test_a_web_process_hands_the_gil_over_after_web_gil_switch_interval_ms():
    default = _switch_interval_after_import()
    assert default.returncode == 0, default.stderr
    assert float(default.stdout) == pytest.approx(0.001)  # Python's own default is 0.005
    set_ = _switch_interval_after_import("2.5")
    assert float(set_.stdout) == pytest.approx(0.0025)
    refused = _switch_interval_after_import("0")
    assert refused.returncode != 0 and "WEB_GIL_SWITCH_INTERVAL_MS" in refused.stderr


@pytest.mark.django_db(transaction=True)
def test_the_api_takes_a_json_body_in_pieces_through_the_portals_asgi_app(tenant, make_token):
    """A body that arrives in several ASGI messages reaches the view whole through the WSGI pool."""
    import json

    from portal.api import views  # noqa: F401  (the URLconf is loaded before the threads race for it)

    body = json.dumps({"name": "ci", "scopes": ["read"]}).encode()
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/v1/tokens/",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"localhost"),
            (b"authorization", f"Bearer {make_token(tenant)}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "server": ("localhost", 80),
        "client": ("127.0.0.1", 5555),
    }
    chunks = [body[:5], body[5:9], body[9:]]
    incoming = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(asgi.application(scope, receive, send))
    assert sent[0]["status"] == 201, sent
    created = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert created["name"] == "ci" and created["scopes"] == ["read"]
