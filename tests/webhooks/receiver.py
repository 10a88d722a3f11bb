"""A real HTTP receiver on loopback for webhook tests: it records every request, checks its
signature as a tenant's receiver would, with the client's ``gpupool.webhooks.verify`` (no server
code), and answers from a script."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gpupool.errors import WebhookSignatureError
from gpupool.webhooks import HEADER, verify


@dataclass
class Answer:
    status: int = 200
    body: bytes = b"ok"
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    verified: bool
    verify_error: str
    at: float
    event: dict | None = None  # what verify() answered


class Receiver:
    """``answers``: what the next requests get, in order (then ``default``); ``secret``: one, or
    several while an endpoint's secret is rolled."""

    def __init__(self, secret: str | list[str] = "", default: Answer | None = None) -> None:
        self.secret = secret
        self.answers: list[Answer] = []
        self.default = default or Answer()
        self.received: list[Received] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                event = None
                try:
                    event = verify(body, self.headers.get(HEADER), receiver.secret)
                    ok, why = True, ""
                except (WebhookSignatureError, ValueError) as exc:  # ValueError: no secret set
                    ok, why = False, str(exc)
                with receiver._lock:
                    receiver.received.append(
                        Received(self.path, dict(self.headers), body, ok, why, time.monotonic(), event)
                    )
                    if not ok:  # as a real receiver does: refused, and the portal retries
                        answer = Answer(status=400, body=why.encode())
                    else:
                        answer = receiver.answers.pop(0) if receiver.answers else receiver.default
                if answer.delay_s:
                    time.sleep(answer.delay_s)
                self.send_response(answer.status)
                for k, v in answer.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.close_connection = True
                with contextlib.suppress(OSError):  # the sender stopped reading (size limit, timeout)
                    self.wfile.write(answer.body)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # a sender that hung up (timeout, size limit) is part of the tests

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait(self, count: int, timeout: float = 30.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.received) >= count:
                    return list(self.received)
            time.sleep(0.05)
        raise AssertionError(f"{len(self.received)} of {count} deliveries arrived in {timeout} s")
