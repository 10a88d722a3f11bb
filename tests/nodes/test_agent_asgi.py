"""The agent protocol as uvicorn serves it (portal/asgi.py): heartbeats, polls, reports and log
batches go straight to their views through ``AgentProtocolHandler``, registration and anything else
through Django's ASGI handler; the answers are the ones Django's chain gives."""

from __future__ import annotations

import asyncio
import json
import time

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
        beat, poll, logs, wrong, big = call(
            [
                ("POST", f"/agent/v1/nodes/{node_id}/heartbeat", batch, auth),
                ("GET", f"/agent/v1/nodes/{node_id}/commands?wait=0", None, auth),
                (
                    "POST",
                    f"/agent/v1/nodes/{node_id}/logs",
                    {
                        "seq": 1,
                        "workloads": [{"workload_id": "987654", "lines": [[time.time(), "stdout", "x"]]}],
                    },
                    auth,
                ),
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
    assert logs.status_code == 200, logs.text
    assert list(logs.json()["refused"]) == ["987654"]  # not placed on this node: nothing stored
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


def raw_post(path: str, chunks, *, headers: list[tuple[bytes, bytes]] = ()) -> tuple[int, dict, int]:
    """POST ``chunks`` to the ASGI app as the server hands them over (one ``http.request`` message
    each, ``more_body`` until the last). Returns the status, the JSON answer and how many body bytes
    the app pulled before it answered."""
    pulled = 0
    sent: list[dict] = []
    source = iter(chunks)
    ended = False

    async def receive():
        nonlocal pulled, ended
        if ended:  # as a server: nothing more until the client goes away (it does not, here)
            await asyncio.Event().wait()
        chunk = next(source, None)
        if chunk is None:
            ended = True
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("localhost", 80),
    }
    asyncio.run(asgi.application(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body), pulled


CHUNK = 64 * 1024


@pytest.mark.parametrize("path", ["/agent/v1/register", "/agent/v1/nodes/1/heartbeat"])
def test_a_chunked_body_over_the_limit_is_413_before_it_is_read(path):
    """The attack: a chunked body (no Content-Length) of any size was read to the end and spooled to
    disk before any check, on the unauthenticated register too. Now reading stops at the limit."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    twenty_mb = (b" " * CHUNK for _ in range(20 * 1024 * 1024 // CHUNK))
    status, answer, pulled = raw_post(path, twenty_mb, headers=[(b"transfer-encoding", b"chunked")])
    assert status == 413 and "larger than" in answer["error"]["message"]
    assert pulled <= limit + CHUNK  # stopped at the limit, not 20 MB


def test_a_declared_length_over_the_limit_is_413_without_reading_the_body():
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    status, _, pulled = raw_post(
        "/agent/v1/register",
        (b" " * CHUNK for _ in range(100)),
        headers=[(b"content-length", str(limit + 1).encode())],
    )
    assert status == 413 and pulled == 0


def test_a_body_within_the_limit_still_registers(make_bootstrap_token):
    body = json.dumps(registration_body(make_bootstrap_token(), "asgi-chunked")).encode()
    status, answer, pulled = raw_post(
        "/agent/v1/register", [body[:100], body[100:]], headers=[(b"transfer-encoding", b"chunked")]
    )
    assert status == 201, answer
    assert pulled == len(body) and Node.objects.get(pk=answer["node_id"]).hostname == "asgi-chunked"


def test_deeply_nested_json_is_400_on_register_and_report(register_node_asgi):
    """``[[[[...]]]]`` 10,000 deep made json.loads raise RecursionError: a 500 on the unauthenticated
    register. Now a 400 naming the body, on every agent endpoint that parses JSON."""
    deep = b"[" * 10_000 + b"]" * 10_000
    deep_object = b'{"a":' * 10_000 + b"1" + b"}" * 10_000
    node_id, credential = register_node_asgi
    auth = {"Authorization": f"Node {credential}", "Content-Type": "application/json"}
    report = f"/agent/v1/nodes/{node_id}/commands/00000000-0000-0000-0000-000000000000/report"
    responses = call(
        [
            ("POST", "/agent/v1/register", deep, {"Content-Type": "application/json"}),
            ("POST", "/agent/v1/register", deep_object, {"Content-Type": "application/json"}),
            ("POST", report, deep_object, auth),
            ("POST", f"/agent/v1/nodes/{node_id}/heartbeat", deep_object, auth),
        ]
    )
    for response in responses:
        assert response.status_code == 400, response.text
        assert "body" in response.json()["error"]["fields"]


@pytest.fixture
def register_node_asgi(make_bootstrap_token) -> tuple[int, str]:
    (registered,) = call(
        [("POST", "/agent/v1/register", registration_body(make_bootstrap_token(), "asgi-d"), {})]
    )
    return registered.json()["node_id"], registered.json()["credential"]


def test_heartbeats_in_flight_are_not_capped_by_the_event_loops_default_executor(
    make_bootstrap_token, monkeypatch
):
    """The views' database work runs on ``db_executor``'s threads, one per pooled connection (or
    WEB_THREADS): as many heartbeats work at once, where the event loop's default executor has
    ``cpu_count + 4`` threads (six on a two-core machine). Each heartbeat here waits at a barrier
    until all of them are inside a thread, so the test fails if fewer threads serve them."""
    import threading

    (registered,) = call(
        [("POST", "/agent/v1/register", registration_body(make_bootstrap_token(), "asgi-many"), {})]
    )
    node_id, credential = registered.json()["node_id"], registered.json()["credential"]
    in_flight = getattr(settings, "DB_POOL_MAX_SIZE", 0) or settings.WEB_THREADS
    barrier = threading.Barrier(in_flight, timeout=10)
    threads: set[str] = set()
    original = agent_views._heartbeat_sync

    def at_the_barrier(*args):
        threads.add(threading.current_thread().name)
        barrier.wait()  # BrokenBarrierError (a 500) unless every heartbeat has a thread at once
        return original(*args)

    monkeypatch.setattr(agent_views, "_heartbeat_sync", at_the_barrier)
    auth = {"Authorization": f"Node {credential}", "Content-Type": "application/json"}

    async def go():
        transport = httpx.ASGITransport(app=asgi.application)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"/agent/v1/nodes/{node_id}/heartbeat",
                        content=json.dumps(
                            {"seq": seq, "sent_at": "2026-12-02T12:00:00.000Z", "status": {}, "samples": []}
                        ),
                        headers=auth,
                    )
                    for seq in range(1, in_flight + 1)
                )
            )

    answers = asyncio.run(go())
    assert [a.status_code for a in answers] == [200] * in_flight, [a.text for a in answers]
    assert len(threads) == in_flight and all(name.startswith("agent-db") for name in threads), threads
