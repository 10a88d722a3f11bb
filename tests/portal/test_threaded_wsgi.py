"""portal.threaded_wsgi.ThreadedWSGI: a WSGI application behind ASGI, the request body read on the
loop, the response gathered in a pool thread (or streamed from it)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from portal import asgi
from portal.threaded_wsgi import ThreadedWSGI

SCOPE = {
    "type": "http",
    "http_version": "1.1",
    "method": "POST",
    "scheme": "http",
    "path": "/echo",
    "root_path": "",
    "query_string": b"q=1",
    "headers": [(b"host", b"testserver"), (b"content-type", b"application/octet-stream")],
    "server": ("testserver", 80),
    "client": ("127.0.0.1", 5555),
}


def call(app, scope: dict, chunks: list[bytes], *, disconnect: bool = False) -> list[dict]:
    """``app`` under ``scope``, sent the body in ``chunks`` (then a disconnect, if asked); the
    messages it sent."""

    async def go():
        incoming = [
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)
        ]
        if disconnect:
            incoming[-1]["more_body"] = True
            incoming.append({"type": "http.disconnect"})
        sent = []

        async def receive():
            return incoming.pop(0)

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
        return sent

    return asyncio.run(go())


def echo(environ, start_response):
    """The body back, with what the environ said of it and the thread that ran."""
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or -1))
    start_response(
        "201 Created",
        [
            ("Content-Type", "text/plain"),
            ("X-Thread", threading.current_thread().name),
            ("X-Query", environ["QUERY_STRING"]),
        ],
    )
    return [body[:4], body[4:]]


def test_a_body_sent_in_pieces_reaches_the_app_whole_and_the_answer_comes_in_one_piece():
    body = b"0123456789" * 1000
    pieces = [body[:3], body[3:5000], b"", body[5000:]]
    sent = call(
        ThreadedWSGI(echo, workers=2),
        {**SCOPE, "headers": [*SCOPE["headers"], (b"content-length", b"10000")]},
        pieces,
    )
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    start, answer = sent
    headers = dict(start["headers"])
    assert (
        start["status"] == 201 and headers[b"content-type"] == b"text/plain" and headers[b"x-query"] == b"q=1"
    )
    assert headers[b"x-thread"].startswith(b"wsgi") and answer["body"] == body and not answer.get("more_body")


def test_a_large_body_is_spooled_to_disk(settings):
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 1000
    seen = []

    def app(environ, start_response):
        stream = environ["wsgi.input"]
        seen.append((stream._rolled, len(stream.read())))
        start_response("200 OK", [])
        return [b""]

    call(ThreadedWSGI(app, workers=1), SCOPE, [b"x" * 600, b"y" * 600])
    call(ThreadedWSGI(app, workers=1), SCOPE, [b"x" * 600])
    assert seen == [(True, 1200), (False, 600)]


def test_a_client_that_leaves_before_its_body_is_sent_runs_nothing():
    ran = []

    def app(environ, start_response):
        ran.append(1)
        start_response("200 OK", [])
        return [b""]

    assert call(ThreadedWSGI(app, workers=1), SCOPE, [b"part"], disconnect=True) == []
    assert ran == []


def test_a_streaming_answer_is_sent_chunk_by_chunk_and_closed():
    closed = []

    class Stream:
        def __init__(self, start_response):
            self.start_response = start_response

        def __iter__(self):
            self.start_response("200 OK", [("Content-Type", "text/event-stream")])  # late, as WSGI allows
            yield b"a"
            yield b""
            yield b"b"

        def close(self):
            closed.append(True)

    sent = call(ThreadedWSGI(lambda environ, start_response: Stream(start_response), workers=1), SCOPE, [b""])
    assert sent[0] == {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream")],
    }
    assert [(m["body"], m.get("more_body", False)) for m in sent[1:]] == [
        (b"a", True),
        (b"b", True),
        (b"", False),
    ]
    assert closed == [True]


def test_djangos_streaming_response_streams(rf):
    from django.core.handlers.wsgi import WSGIHandler
    from django.http import HttpResponse, StreamingHttpResponse

    class Handler(WSGIHandler):
        def get_response(self, request):
            if request.path == "/stream":
                return StreamingHttpResponse(iter([b"one", b"two"]))
            return HttpResponse(b"whole")

    app = ThreadedWSGI(Handler(), workers=1)
    streamed = call(app, {**SCOPE, "method": "GET", "path": "/stream"}, [b""])
    assert [m.get("body") for m in streamed[1:]] == [b"one", b"two", b""]
    whole = call(app, {**SCOPE, "method": "GET", "path": "/whole"}, [b""])
    assert [m["type"] for m in whole] == ["http.response.start", "http.response.body"] and whole[1][
        "body"
    ] == b"whole"


def test_an_app_that_fails_fails_the_request():
    def broken(environ, start_response):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        call(ThreadedWSGI(broken, workers=1), SCOPE, [b""])
    with pytest.raises(ValueError, match="HTTP only"):
        call(ThreadedWSGI(echo, workers=1), {**SCOPE, "type": "websocket"}, [b""])


def test_what_an_app_writes_comes_before_what_it_returns():
    def writes(environ, start_response):
        write = start_response("200 OK", [])
        write(b"written ")
        write(b"then ")
        return [b"returned"]

    def writes_then_streams(environ, start_response):
        start_response("200 OK", [])(b"written ")
        return iter([b"streamed"])

    gathered = call(ThreadedWSGI(writes, workers=1), SCOPE, [b""])
    assert [m["type"] for m in gathered] == ["http.response.start", "http.response.body"]
    assert gathered[1]["body"] == b"written then returned"
    streamed = call(ThreadedWSGI(writes_then_streams, workers=1), SCOPE, [b""])
    assert b"".join(m.get("body", b"") for m in streamed[1:]) == b"written streamed"
    assert streamed[-1] == {"type": "http.response.body", "body": b""}


@pytest.mark.django_db(transaction=True)
def test_the_api_takes_a_json_body_in_pieces_through_the_portals_asgi_app(tenant, make_token):
    from portal.api import views  # noqa: F401  (the URLconf is loaded before the threads race for it)

    body = json.dumps({"name": "ci", "scopes": ["read"]}).encode()
    scope = {
        **SCOPE,
        "path": "/api/v1/tokens/",
        "query_string": b"",
        "headers": [
            (b"host", b"localhost"),
            (b"authorization", f"Bearer {make_token(tenant)}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    sent = call(asgi.application, scope, [body[:5], body[5:9], body[9:]])
    assert sent[0]["status"] == 201, sent
    created = json.loads(sent[1]["body"])
    assert created["name"] == "ci" and created["scopes"] == ["read"]
