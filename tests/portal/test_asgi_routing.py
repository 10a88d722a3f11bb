"""portal/asgi.py: pages and the API on the WSGI thread pool (a2wsgi), the agent protocol's hot paths
straight to their async views (the long poll must never hold a thread) and the rest of it through
Django's ASGI handler, websockets through Channels."""

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


def test_the_agent_protocol_goes_to_its_handler_and_the_rest_to_the_thread_pool(monkeypatch):
    seen = []

    def recorder(name):
        async def app(scope, receive, send):
            seen.append((name, scope["path"]))
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        return app

    monkeypatch.setattr(asgi, "PREFIX_APPS", [("/agent/", recorder("agent"))])
    monkeypatch.setattr(asgi, "threaded_app", recorder("threads"))
    for path in ("/agent/v1/nodes/7/commands", "/api/v1/jobs/", "/launch/", "/healthz"):
        assert _get(path).status_code == 204
    assert seen == [
        ("agent", "/agent/v1/nodes/7/commands"),
        ("threads", "/api/v1/jobs/"),
        ("threads", "/launch/"),
        ("threads", "/healthz"),
    ]


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


def test_the_agent_prefix_is_served_by_the_handler_the_settings_name(settings):
    """One route for the agent protocol's fast path: the handler named in ASGI_PREFIX_APPS (portal
    imports no app), with Django's ASGI handler behind it; the pages' chain is Django's own,
    settings.MIDDLEWARE as it stands, with nothing of the agent protocol in it."""
    from django.core.handlers.wsgi import WSGIHandler

    from nodes.agent_views import AgentProtocolHandler

    assert settings.ASGI_PREFIX_APPS == [("/agent/", "nodes.agent_views.AgentProtocolHandler")]
    ((prefix, app),) = asgi.PREFIX_APPS
    assert prefix == "/agent/" and type(app) is AgentProtocolHandler
    assert app.fallback is asgi.django_asgi_app
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
