"""A small, real HTTP server that speaks the portal's side of ``nodes/PROTOCOL.md``, for testing the
agent over the network (the real portal's end-to-end tests live with the portal).

Like the real portal it stores heartbeats by (node, seq) and answers a resend ``duplicate``; it can
be made to answer 503, to refuse some batches as bad (400), to revoke a node's credential (401), to
be stopped and started again on the same port, and it records every command report.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse


class FakePortal:
    def __init__(self, heartbeat_interval_s: float = 0.1, commands_wait_s: int = 1) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.commands_wait_s = commands_wait_s
        self.lock = threading.Condition()
        self.tokens: dict[str, bool] = {}  # bootstrap token -> used
        self.nodes: dict[int, dict[str, Any]] = {}
        self.heartbeats: dict[int, dict[int, dict[str, Any]]] = {}
        self.arrivals: list[tuple[int, int]] = []  # (node, seq) in the order they were stored
        self.duplicates = 0
        self.pending: dict[int, list[dict[str, Any]]] = {}
        self.reports: list[tuple[str, str, dict[str, Any], str]] = []  # (command id, status, result, message)
        self.register_calls = 0
        self.unavailable = False
        self.reject_seqs: set[int] = set()
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None
        self.port = 0

    # -- control ----------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakePortal:
        portal = self

        class Handler(_Handler):
            pass

        Handler.portal = portal
        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = False
        server.block_on_close = True
        self.server = server
        self.port = server.server_address[1]
        self.thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is None:
            return
        with self.lock:
            self.lock.notify_all()
        self.server.shutdown()
        self.server.server_close()
        assert self.thread is not None
        self.thread.join(5)
        self.server = None

    def __enter__(self) -> FakePortal:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_token(self, token: str | None = None) -> str:
        token = token or f"gpb_1_{secrets.token_hex(8)}"
        with self.lock:
            self.tokens[token] = False
        return token

    def queue_command(self, node_id: int, command: dict[str, Any]) -> None:
        with self.lock:
            self.pending.setdefault(node_id, []).append(command)
            self.lock.notify_all()

    def revoke(self, node_id: int) -> None:
        with self.lock:
            self.nodes[node_id]["credential"] = "revoked"

    def seqs(self, node_id: int) -> list[int]:
        with self.lock:
            return sorted(self.heartbeats.get(node_id, {}))

    def reports_for(self, command_id: str) -> list[str]:
        with self.lock:
            return [status for cid, status, _, _ in self.reports if cid == command_id]

    # -- protocol ---------------------------------------------------------------------------------

    def register(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.register_calls += 1
            token = body.get("bootstrap_token")
            if token not in self.tokens or self.tokens[token]:
                return 401, _error("invalid_token", "unknown or used bootstrap token")
            if not body.get("hostname") or not isinstance(body.get("gpus"), list):
                return 400, _error("invalid", "hostname and gpus are required")
            self.tokens[token] = True
            node_id = next((nid for nid, n in self.nodes.items() if n["hostname"] == body["hostname"]), None)
            if node_id is None:
                node_id = len(self.nodes) + 1
            credential = f"gpn_{node_id}_{secrets.token_hex(8)}"
            self.nodes[node_id] = {"hostname": body["hostname"], "credential": credential, "register": body}
            return 201, {
                "node_id": node_id,
                "credential": credential,
                "heartbeat_interval_s": self.heartbeat_interval_s,
                "commands_wait_s": self.commands_wait_s,
            }

    def authorize(self, header: str | None, node_id: int) -> int | None:
        credential = (header or "").removeprefix("Node ")
        owner = next((nid for nid, n in self.nodes.items() if n["credential"] == credential), None)
        if owner is None:
            return 401
        if owner != node_id:
            return 404
        return None

    def heartbeat(self, node_id: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        seq = body.get("seq")
        if not isinstance(seq, int) or seq < 1 or not isinstance(body.get("samples"), list):
            return 400, _error("invalid", "seq and samples are required", {"seq": "required"})
        if seq in self.reject_seqs:
            return 400, _error("invalid", f"batch {seq} is malformed", {"samples": "bad"})
        stored = self.heartbeats.setdefault(node_id, {})
        if seq in stored:
            self.duplicates += 1
            return 200, {"status": "duplicate", "gap": None, "server_time": ""}
        stored[seq] = body
        self.arrivals.append((node_id, seq))
        return 200, {"status": "accepted", "gap": None, "server_time": ""}

    def poll(self, node_id: int, wait: float) -> dict[str, Any]:
        with self.lock:
            if not self.pending.get(node_id) and self.server is not None:
                self.lock.wait(timeout=min(wait, 30))
            commands, self.pending[node_id] = self.pending.get(node_id, []), []
            return {"commands": commands}

    def report(self, command_id: str, body: dict[str, Any]) -> dict[str, Any]:
        self.reports.append((command_id, body["status"], body.get("result") or {}, body.get("message", "")))
        return {"status": body["status"]}


def _error(code: str, message: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "fields": fields or {}}}


class _Handler(BaseHTTPRequestHandler):
    portal: FakePortal

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        # The agent may have given up on this request (a long poll cancelled at its shutdown).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def _route(self, method: str) -> None:
        portal = self.portal
        url = urlparse(self.path)
        parts = [part for part in url.path.split("/") if part]
        body = self._body() if method == "POST" else {}
        if portal.unavailable:
            self._answer(503, _error("unavailable", "maintenance"))
            return
        if parts == ["agent", "v1", "register"] and method == "POST":
            self._answer(*portal.register(body))
            return
        if len(parts) < 5 or parts[:3] != ["agent", "v1", "nodes"]:
            self._answer(404, _error("not_found", "no such URL"))
            return
        node_id = int(parts[3])
        with portal.lock:
            denied = portal.authorize(self.headers.get("Authorization"), node_id)
        if denied:
            self._answer(denied, _error("denied", "credential refused"))
            return
        if parts[4] == "heartbeat" and method == "POST":
            with portal.lock:
                self._answer(*portal.heartbeat(node_id, body))
        elif parts[4] == "commands" and len(parts) == 5 and method == "GET":
            wait = float(parse_qs(url.query).get("wait", ["0"])[0])
            self._answer(200, portal.poll(node_id, wait))
        elif parts[4] == "commands" and len(parts) == 7 and parts[6] == "report" and method == "POST":
            with portal.lock:
                self._answer(200, portal.report(parts[5], body))
        else:
            self._answer(404, _error("not_found", "no such URL"))

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")
