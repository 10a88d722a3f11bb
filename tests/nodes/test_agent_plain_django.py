"""The agent protocol on a plain deployment of Django's own handlers (WSGI, or ASGI without
portal/asgi.py's router): the views are in the URL conf, so heartbeats, polls and reports go through
the whole middleware chain and still get the protocol's answers: no CSRF check, JSON errors (never
HTML, never a 500) and the body limit."""

from __future__ import annotations

import json

import httpx
import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import Client

from tests.nodes.conftest import django_handler_in_test


def wsgi_deployment(method: str, path: str, content: bytes, headers: dict[str, str]):
    # Django's test client is its WSGI handler; it checks CSRF tokens as a browser's request would.
    client = Client(enforce_csrf_checks=True)
    extra = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items()}
    response = client.generic(method, path, content, content_type="application/json", **extra)
    return response.status_code, response.headers, response.content


def asgi_deployment(method: str, path: str, content: bytes, headers: dict[str, str]):
    async def go():
        transport = httpx.ASGITransport(app=django_handler_in_test())
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.request(
                method, path, content=content, headers={"Content-Type": "application/json", **headers}
            )

    response = async_to_sync(go)()
    return response.status_code, response.headers, response.content


@pytest.fixture(params=[wsgi_deployment, asgi_deployment], ids=["wsgi", "asgi"])
def deployment(request):
    return request.param


def test_heartbeat_poll_and_report_through_the_whole_chain(deployment, agent):
    auth = {"Authorization": f"Node {agent.credential}"}
    base = f"/agent/v1/nodes/{agent.node_id}"
    status, headers, body = deployment("POST", f"{base}/heartbeat", json.dumps(agent.batch()).encode(), auth)
    assert status == 200, body
    assert json.loads(body)["status"] == "accepted"
    assert int(headers["Content-Length"]) == len(body) and headers["X-Request-ID"]
    assert agent.node.heartbeats.count() == 1  # stored: the view ran, not a refusal
    status, _, body = deployment("GET", f"{base}/commands?wait=0", b"", auth)
    assert status == 200 and json.loads(body) == {"commands": []}
    report = json.dumps({"status": "accepted"}).encode()
    unknown = f"{base}/commands/00000000-0000-0000-0000-000000000000/report"
    status, headers, body = deployment("POST", unknown, report, auth)
    assert status == 404 and headers["Content-Type"] == "application/json", body
    assert json.loads(body)["error"]["code"]


def test_errors_are_json_whatever_went_wrong(deployment, agent):
    auth = {"Authorization": f"Node {agent.credential}"}
    heartbeat = f"/agent/v1/nodes/{agent.node_id}/heartbeat"
    wrong = {"Authorization": "Node gpn_1_wrong"}
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    cases = {
        "wrong credential": (("POST", heartbeat, json.dumps(agent.batch()).encode(), wrong), 401),
        "wrong method": (("GET", heartbeat, b"", auth), 405),
        "unknown path": (("POST", f"/agent/v1/nodes/{agent.node_id}/heartbeats", b"{}", auth), 404),
        "not JSON": (("POST", heartbeat, b"{not json", auth), 400),
        "nested too deep": (("POST", heartbeat, b'{"a":' * 10_000 + b"1" + b"}" * 10_000, auth), 400),
        "body over the limit": (("POST", heartbeat, b" " * (limit + 1), auth), 413),
    }
    for name, (request, expected) in cases.items():
        status, headers, body = deployment(*request)
        assert status == expected, (name, status, body[:300])
        assert headers["Content-Type"] == "application/json", (name, headers)
        assert json.loads(body)["error"]["message"], name
        if expected == 401:
            assert headers["WWW-Authenticate"].startswith("Node")
        if expected == 405:
            assert headers["Allow"] == "POST"
    assert not agent.node.heartbeats.exists()
