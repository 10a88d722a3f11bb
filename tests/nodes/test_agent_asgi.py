"""The agent protocol as uvicorn serves it (portal/asgi.py): heartbeats, polls and reports go straight
to their views through ``AgentProtocolHandler``, registration and anything else through Django's
ASGI handler; the answers are the ones Django's chain gives."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from django.conf import settings
from django.core import signals

from nodes import agent_views
from nodes.models import Node
from portal import asgi
from tests.nodes.conftest import registration_body

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def agent_views_in_worker_threads(monkeypatch):
    # As in production: the views' database work on the event loop's worker threads (this test's
    # rows are committed, so they see them).
    monkeypatch.setattr(agent_views, "DB_THREAD_SENSITIVE", False)


def call(requests: list[tuple[str, str, dict | bytes | None, dict]]) -> list[httpx.Response]:
    async def go():
        transport = httpx.ASGITransport(app=asgi.application)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            out = []
            for method, path, body, headers in requests:
                content = body if isinstance(body, bytes) else json.dumps(body) if body is not None else None
                out.append(await client.request(method, path, content=content, headers=headers))
            return out

    return asyncio.run(go())


def test_register_heartbeat_poll_and_report_through_the_asgi_app(make_bootstrap_token, capture_signal):
    (registered,) = call(
        [("POST", "/agent/v1/register", registration_body(make_bootstrap_token(), "asgi-1"), {})]
    )
    assert registered.status_code == 201, registered.text
    node_id, credential = registered.json()["node_id"], registered.json()["credential"]
    auth = {"Authorization": f"Node {credential}", "Content-Type": "application/json", "X-Request-ID": "hb-1"}
    batch = {
        "seq": 1,
        "sent_at": "2026-12-02T12:00:00.000Z",
        "status": {"agent_version": "9.9"},
        "samples": [],
    }
    with capture_signal(signals.request_started) as started:
        beat, poll, wrong, big = call(
            [
                ("POST", f"/agent/v1/nodes/{node_id}/heartbeat", batch, auth),
                ("GET", f"/agent/v1/nodes/{node_id}/commands?wait=0", None, auth),
                (
                    "POST",
                    f"/agent/v1/nodes/{node_id}/heartbeat",
                    batch,
                    {**auth, "Authorization": "Node gpn_x"},
                ),
                (
                    "POST",
                    f"/agent/v1/nodes/{node_id}/heartbeat",
                    b"x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1),
                    auth,
                ),
            ]
        )
    assert started == []  # none of them went through Django's handler
    assert beat.status_code == 200, beat.text
    assert beat.headers["X-Request-ID"] == "hb-1" and beat.headers["Content-Length"]
    assert Node.objects.get(pk=node_id).agent_version == "9.9"
    assert poll.status_code == 200 and poll.json() == {"commands": []}
    assert wrong.status_code == 401 and wrong.json()["error"]["code"]
    assert big.status_code == 413 and "larger than" in big.json()["error"]["message"]


def test_other_agent_paths_and_methods_take_django_s_handler(capture_signal):
    with capture_signal(signals.request_started) as started:
        (response,) = call([("GET", "/agent/v1/nodes/1/heartbeat", None, {})])
    assert len(started) == 1
    assert response.status_code == 405


def test_plain_http_goes_to_django_s_handler_when_https_is_required(settings, capture_signal):
    """Django's chain decides (its SecurityMiddleware redirects when the process starts with
    SECURE_SSL_REDIRECT; here it was loaded without, so the agent view answers through the chain)."""
    settings.SECURE_SSL_REDIRECT = True
    with capture_signal(signals.request_started) as started:
        (response,) = call(
            [("POST", "/agent/v1/nodes/1/heartbeat", {"seq": 1}, {"Content-Type": "application/json"})]
        )
    assert len(started) == 1  # the body read for the fast path was replayed to Django's handler
    assert response.status_code == 401 and response.json()["error"]["code"]
