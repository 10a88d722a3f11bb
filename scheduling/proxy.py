"""The portal's proxy to workloads' HTTP ports: ``/proxy/<workload id>/<port>/...``, HTTP and
websockets, as an ASGI app in front of the portal (``portal/asgi.py``), on the event loop.

Who may pass (everyone else gets 404, as for an object of another tenant):

- a member of the workload's tenant, by the portal's session or by an API token with the ``read``
  scope (the API's rules: a token acts within its creator's current role). With ``PROXY_ORIGIN``
  (apps on an origin of their own, nothing of the portal there) the session is not a credential: a
  member's browser brings a one-minute ticket the portal signed (``?gpupool_ticket=``,
  ``/workloads/<id>/open/<port>/``), which becomes a signed cookie for ``/proxy/<id>/``;
- anyone holding the workload's share link (``?gpupool_share=<secret>``): the first request sets a
  cookie for ``/proxy/<id>/`` and is redirected to the same URL without the secret.

Every request and every websocket is checked again (a revoked link, a removed member or a stopped
workload ends access at once), and only RUNNING workloads' published HTTP ports are reached.

What passes: the request's method, full path (the app serves under ``/proxy/<id>/<port>/``: for
Jupyter, ``--ServerApp.base_url=/proxy/$GPUPOOL_WORKLOAD_ID/<port>/``), query, headers and body, to
``http://<node address>:<host port>``. Bodies stream both ways in chunks (nothing is buffered
whole). Hop-by-hop headers are dropped, and so are the portal's own credentials: its session, CSRF
and share cookies and a portal API token in ``Authorization``; the workload may not set those
cookies either. Limits: ``PROXY_CONNECT_TIMEOUT_S``, ``PROXY_IDLE_TIMEOUT_S`` (between reads or
writes), ``PROXY_MAX_BODY_BYTES`` (413), ``PROXY_MAX_WS_MESSAGE_BYTES`` and
``PROXY_MAX_CONNECTIONS_PER_WORKLOAD`` (per web process; 503 beyond it).

HTTP goes through httpx, websockets through the ``websockets`` client; this module only routes,
checks and pumps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from http.cookiejar import CookieJar, DefaultCookiePolicy
from http.cookies import CookieError, SimpleCookie
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx
import websockets
from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth import get_user
from django.core import signing
from django.utils.module_loading import import_string
from websockets.asyncio.client import connect as ws_connect

from portal.models import ApiToken, Membership, Scope, hash_secret
from portal.services.tokens import api_token_authenticate
from scheduling.models import WorkloadShareLink
from scheduling.selectors.access import (
    MEMBER_SALT,
    PROXY_PREFIX,
    SHARE_PARAM,
    TICKET_PARAM,
    TICKET_SALT,
    ProxyTarget,
    proxy_target,
)

logger = logging.getLogger(__name__)

Scope_ = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

TICKET_MAX_AGE_S = 60
_PATH_RE = re.compile(rf"^{re.escape(PROXY_PREFIX)}([0-9]{{1,18}})/([0-9]{{1,5}})(/.*)?$", re.DOTALL)
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Headers the websocket client writes itself (the handshake), or that the proxy checks instead.
WS_OWN_HEADERS = frozenset(
    {"host", "origin", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
     "sec-websocket-protocol", "sec-websocket-accept", "content-length"}
)  # fmt: skip


MEMBER_COOKIE = "gpupool_member"


def share_cookie_name(workload_id: int) -> str:
    return f"{SHARE_PARAM}_{workload_id}"


def member_cookie_name(workload_id: int) -> str:
    return f"{MEMBER_COOKIE}_{workload_id}"


def _separate_origin() -> str:
    """The proxy origin's host[:port] when it has one of its own (``PROXY_ORIGIN``), else ''."""
    return urlsplit(settings.PROXY_ORIGIN).netloc.lower() if settings.PROXY_ORIGIN else ""


def _host_of(headers: list[tuple[bytes, bytes]]) -> str:
    return next((v for k, v in headers if k == b"host"), b"").decode("latin-1").lower()


def _portal_cookie(name: str) -> bool:
    return name in (
        settings.SESSION_COOKIE_NAME,
        settings.CSRF_COOKIE_NAME,
        settings.LANGUAGE_COOKIE_NAME,
    ) or name.startswith((f"{SHARE_PARAM}_", f"{MEMBER_COOKIE}_"))


def _cookies(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    jar: dict[str, str] = {}
    for key, value in headers:
        if key == b"cookie":
            for part in value.decode("latin-1").split(";"):
                name, sep, val = part.strip().partition("=")
                if sep and name not in jar:
                    jar[name] = val
    return jar


def _without_portal_cookies(value: bytes) -> bytes | None:
    kept = [
        part.strip()
        for part in value.decode("latin-1").split(";")
        if part.strip() and not _portal_cookie(part.strip().partition("=")[0])
    ]
    return "; ".join(kept).encode("latin-1") if kept else None


def _portal_token(value: bytes) -> bool:
    text = value.decode("latin-1").strip()
    scheme, _, credential = text.partition(" ")
    return scheme.lower() == "bearer" and credential.strip().startswith(("gpp_", "gps_"))


def upstream_request_headers(
    headers: list[tuple[bytes, bytes]], *, websocket: bool = False
) -> list[tuple[str, str]]:
    """The client's headers as the workload gets them: hop-by-hop ones (and those the Connection
    header names) dropped, the portal's cookies and API token taken out."""
    named = {
        token.strip().lower()
        for key, value in headers
        if key == b"connection"
        for token in value.decode("latin-1").split(",")
    }
    out: list[tuple[str, str]] = []
    for raw_key, value in headers:
        key = raw_key.decode("latin-1").lower()
        if key in HOP_BY_HOP or key in named or (websocket and key in WS_OWN_HEADERS):
            continue
        if key == "authorization" and _portal_token(value):
            continue
        if key == "cookie":
            kept = _without_portal_cookies(value)
            if kept is None:
                continue
            value = kept
        out.append((key, value.decode("latin-1")))
    return out


def downstream_response_headers(headers: httpx.Headers) -> list[tuple[bytes, bytes]]:
    """The workload's response headers as the client gets them: hop-by-hop ones dropped, and no
    cookie of the portal's own names (a workload must not set the portal's session)."""
    named = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    out = []
    for key, value in headers.multi_items():
        lower = key.lower()
        if lower in HOP_BY_HOP or lower in named:
            continue
        if lower == "set-cookie":
            try:
                names = list(SimpleCookie(value).keys())
            except CookieError:
                continue
            if any(_portal_cookie(name) for name in names):
                continue
        out.append((lower.encode("latin-1"), value.encode("latin-1")))
    return out


# --- who may pass ----------------------------------------------------------------------------------


def _member_by_session(session_key: str, tenant_id: int) -> bool:
    store = import_string(f"{settings.SESSION_ENGINE}.SessionStore")(session_key)
    user = get_user(SimpleNamespace(session=store))  # verifies the session's auth hash
    return bool(
        user.is_authenticated
        and user.is_active
        and Membership.objects.filter(tenant_id=tenant_id, user_id=user.pk).exists()
    )


def _member_by_token(plaintext: str, tenant_id: int) -> bool:
    token: ApiToken | None = api_token_authenticate(plaintext=plaintext)
    return bool(
        token is not None
        and not token.is_revoked
        and not token.is_expired
        and token.effective_scopes is not None
        and Scope.READ in token.effective_scopes
        and token.tenant_id == tenant_id
    )


def _member_by_user_id(user_id: Any, tenant_id: int) -> bool:
    return (
        isinstance(user_id, int)
        and Membership.objects.filter(tenant_id=tenant_id, user_id=user_id, user__is_active=True).exists()
    )


def _signed_user(value: str, *, salt: str, max_age: float, workload_id: int) -> int | None:
    """The user a ticket or member cookie was signed for, if it is genuine, fresh and this
    workload's."""
    try:
        data = signing.loads(value, salt=salt, max_age=max_age)
    except signing.BadSignature:
        return None
    if not isinstance(data, dict) or data.get("w") != workload_id:
        return None
    return data.get("u")


def _share_matches(secret: str, workload_id: int) -> bool:
    if not secret.startswith(f"{WorkloadShareLink.PREFIX}_"):
        return False
    stored = (
        WorkloadShareLink.objects.filter(workload_id=workload_id, token_hash=hash_secret(secret))
        .values_list("token_hash", flat=True)
        .first()
    )
    return stored is not None and secrets.compare_digest(stored, hash_secret(secret))


def _authorize(
    workload_id: int,
    port: int,
    headers: list[tuple[bytes, bytes]],
    share: str | None,
    ticket_user: Any = None,
) -> ProxyTarget | None:
    """The target, if this request may reach it: one lookup, then the first credential that works.
    On a proxy origin of its own the portal's session is not a credential (it never goes there); a
    member's ticket, then the member cookie made from it, are."""
    target = proxy_target(workload_id=workload_id, port=port)
    if target is None:
        return None
    for key, value in headers:
        if key == b"authorization" and _portal_token(value):
            plaintext = value.decode("latin-1").strip().partition(" ")[2].strip()
            if _member_by_token(plaintext, target.tenant_id):
                return target
    cookies = _cookies(headers)
    if not settings.PROXY_ORIGIN:
        session_key = cookies.get(settings.SESSION_COOKIE_NAME)
        if session_key and _member_by_session(session_key, target.tenant_id):
            return target
    else:
        member = cookies.get(member_cookie_name(workload_id))
        if member is not None:
            ticket_user = ticket_user or _signed_user(
                member,
                salt=MEMBER_SALT,
                max_age=settings.PROXY_MEMBER_COOKIE_MAX_AGE_S,
                workload_id=workload_id,
            )
        if ticket_user is not None and _member_by_user_id(ticket_user, target.tenant_id):
            return target
    secret = share or cookies.get(share_cookie_name(workload_id))
    if secret and _share_matches(secret, workload_id):
        return target
    return None


authorize = database_sync_to_async(_authorize, thread_sensitive=False)


# --- the app ---------------------------------------------------------------------------------------


class _ClientGone(Exception):
    """The client left while sending its request body."""


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class WorkloadProxy:
    """An ASGI route (settings.ASGI_ROUTES): serves ``/proxy/`` requests and websockets, and with a
    ``PROXY_ORIGIN`` of its own every request to that host too (404 for anything but the proxy
    there, as for the proxy on the portal's origin)."""

    def __init__(self, fallback: Callable[[Scope_, Receive, Send], Awaitable[None]]) -> None:
        self.fallback = fallback  # not used: whatever this route claims, it answers
        self.open: Counter[int] = Counter()  # open requests and websockets per workload
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}

    def claims(self, scope: Scope_) -> bool:
        origin = _separate_origin()
        return scope["path"].startswith(PROXY_PREFIX) or bool(origin and _host_of(scope["headers"]) == origin)

    async def __call__(self, scope: Scope_, receive: Receive, send: Send) -> None:
        proxied = scope["path"].startswith(PROXY_PREFIX)
        origin = _separate_origin()
        # Workloads' apps only on their origin, and nothing of the portal there.
        if origin and proxied != (_host_of(scope["headers"]) == origin):
            if scope["type"] == "http":
                return await _plain(send, 404, "Not found.")
            await receive()
            return await _deny(scope, send, 404)
        if scope["type"] == "http":
            return await self._serve_http(scope, receive, send)
        return await self._serve_websocket(scope, receive, send)

    def client(self) -> httpx.AsyncClient:
        """One connection pool per event loop (a test may run several portals)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            timeout = httpx.Timeout(
                settings.PROXY_IDLE_TIMEOUT_S,
                connect=settings.PROXY_CONNECT_TIMEOUT_S,
                pool=settings.PROXY_CONNECT_TIMEOUT_S,
            )
            # A jar that keeps nothing: the client is shared by every user of the process, so a
            # cookie a workload sets must never go back with another request.
            jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
            client = httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False, cookies=jar)
            self._clients[loop] = client
        return client

    @staticmethod
    def _route(scope: Scope_) -> tuple[int, int] | None:
        match = _PATH_RE.match(scope["path"])
        if match is None:
            return None
        workload_id, port = int(match.group(1)), int(match.group(2))
        return (workload_id, port) if 1 <= port <= 65535 else None

    @staticmethod
    def _query(scope: Scope_) -> tuple[str | None, str | None, str]:
        """(the share secret in the query, a member's ticket, the query without either)."""
        raw = scope.get("query_string", b"").decode("latin-1")
        if SHARE_PARAM not in raw and TICKET_PARAM not in raw:
            return None, None, raw
        pairs = parse_qsl(raw, keep_blank_values=True)
        share = next((value for key, value in pairs if key == SHARE_PARAM), None)
        ticket = next((value for key, value in pairs if key == TICKET_PARAM), None)
        return share, ticket, urlencode([(k, v) for k, v in pairs if k not in (SHARE_PARAM, TICKET_PARAM)])

    @staticmethod
    def _ticket_user(ticket: str | None, workload_id: int) -> Any:
        if ticket is None or not settings.PROXY_ORIGIN:
            return None
        return _signed_user(ticket, salt=TICKET_SALT, max_age=TICKET_MAX_AGE_S, workload_id=workload_id)

    @contextlib.contextmanager
    def _slot(self, workload_id: int):
        if self.open[workload_id] >= settings.PROXY_MAX_CONNECTIONS_PER_WORKLOAD:
            raise _Refused(503, "Too many open connections to this workload; try again shortly.")
        self.open[workload_id] += 1
        try:
            yield
        finally:
            self.open[workload_id] -= 1
            if not self.open[workload_id]:
                del self.open[workload_id]

    # -- HTTP ---------------------------------------------------------------------------------------

    async def _serve_http(self, scope: Scope_, receive: Receive, send: Send) -> None:
        route = self._route(scope)
        share, ticket, query = self._query(scope)
        ticket_user = self._ticket_user(ticket, route[0]) if route is not None else None
        target = await authorize(*route, scope["headers"], share, ticket_user) if route is not None else None
        if target is None:
            return await _plain(send, 404, "Not found.")
        workload_id = route[0]
        if share is not None or ticket_user is not None:
            # Keep the secret (or the member's pass) in a cookie for this workload's paths, and out
            # of the address bar.
            location = scope.get("root_path", "") + scope["path"] + (f"?{query}" if query else "")
            cookie = SimpleCookie()
            if share is not None:
                name, value = share_cookie_name(workload_id), share
            else:
                name = member_cookie_name(workload_id)
                value = signing.dumps({"u": ticket_user, "w": workload_id}, salt=MEMBER_SALT)
            cookie[name] = value
            if share is None:
                cookie[name]["max-age"] = settings.PROXY_MEMBER_COOKIE_MAX_AGE_S
            cookie[name]["path"] = f"{PROXY_PREFIX}{workload_id}/"
            cookie[name]["httponly"] = True
            cookie[name]["samesite"] = "Lax"
            if scope.get("scheme") == "https":
                cookie[name]["secure"] = True
            headers = [
                (b"location", location.encode("latin-1")),
                (b"set-cookie", cookie[name].OutputString().encode("latin-1")),
                (b"cache-control", b"no-store"),
                (b"referrer-policy", b"no-referrer"),
            ]
            return await _plain(send, 303, "See other.", headers)
        try:
            with self._slot(workload_id):
                await self._forward(scope, receive, send, target, query)
        except _Refused as refused:
            await _plain(send, refused.status, refused.message)

    async def _forward(
        self, scope: Scope_, receive: Receive, send: Send, target: ProxyTarget, query: str
    ) -> None:
        headers = upstream_request_headers(scope["headers"])
        length = next((v for k, v in headers if k == "content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > settings.PROXY_MAX_BODY_BYTES):
            raise _Refused(413, f"The request body is over {settings.PROXY_MAX_BODY_BYTES} bytes.")
        client = scope.get("client") or ("", 0)
        headers.append(("x-forwarded-for", str(client[0])))
        headers.append(("x-forwarded-proto", scope.get("scheme", "http")))
        path = scope.get("raw_path") or scope["path"].encode()
        url = f"http://{_host(target.host)}:{target.host_port}{path.decode('latin-1')}" + (
            f"?{query}" if query else ""
        )
        first = await receive()
        body_done = asyncio.Event()
        too_big = False
        content: bytes | AsyncIterator[bytes]
        if first.get("type") == "http.disconnect":
            return
        if not first.get("more_body"):
            content = first.get("body", b"")
            body_done.set()
            if len(content) > settings.PROXY_MAX_BODY_BYTES:
                raise _Refused(413, f"The request body is over {settings.PROXY_MAX_BODY_BYTES} bytes.")
        else:

            async def stream() -> AsyncIterator[bytes]:
                nonlocal too_big
                size = 0
                message = first
                while True:
                    if message["type"] == "http.disconnect":
                        raise _ClientGone
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > settings.PROXY_MAX_BODY_BYTES:
                        too_big = True
                        raise _Refused(
                            413, f"The request body is over {settings.PROXY_MAX_BODY_BYTES} bytes."
                        )
                    if chunk:
                        yield chunk
                    if not message.get("more_body"):
                        break
                    message = await receive()
                body_done.set()

            content = stream()
        request = self.client().build_request(scope["method"], url, headers=headers, content=content)
        try:
            response = await self.client().send(request, stream=True)
        except _Refused:
            raise
        except _ClientGone:
            return
        except httpx.TimeoutException:
            return await _plain(send, 504, "The workload did not answer in time.")
        except httpx.HTTPError as exc:
            if too_big:
                raise _Refused(
                    413, f"The request body is over {settings.PROXY_MAX_BODY_BYTES} bytes."
                ) from None
            logger.info("proxy to %s failed: %s", url, exc)
            return await _plain(send, 502, "The workload's port does not answer.")
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": downstream_response_headers(response.headers),
                }
            )
            # The client may leave while the workload still streams (a long poll, server-sent
            # events): stop reading from the workload when it does.
            pump = asyncio.ensure_future(_pump_response(response, send))
            watch = asyncio.ensure_future(_disconnected(receive, body_done))
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            for task in (pump, watch):
                if task not in done:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if pump in done and pump.exception() is not None:
                exc = pump.exception()
                logger.info("proxy stream from %s ended: %r", url, exc)
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    # -- websockets ---------------------------------------------------------------------------------

    async def _serve_websocket(self, scope: Scope_, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        if not _same_origin(scope["headers"]):
            # A browser's handshake from another site (it would carry the user's cookies).
            return await _deny(scope, send, 404)
        route = self._route(scope)
        share, _ticket, query = self._query(scope)
        target = await authorize(*route, scope["headers"], share) if route is not None else None
        if target is None:
            return await _deny(scope, send, 404)
        workload_id = route[0]
        try:
            with self._slot(workload_id):
                await self._forward_websocket(scope, receive, send, target, query)
        except _Refused as refused:
            await _deny(scope, send, refused.status)

    async def _forward_websocket(
        self, scope: Scope_, receive: Receive, send: Send, target: ProxyTarget, query: str
    ) -> None:
        path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        uri = f"ws://{_host(target.host)}:{target.host_port}{path}" + (f"?{query}" if query else "")
        try:
            upstream = await ws_connect(
                uri,
                additional_headers=upstream_request_headers(scope["headers"], websocket=True),
                subprotocols=scope.get("subprotocols") or None,
                open_timeout=settings.PROXY_CONNECT_TIMEOUT_S,
                max_size=settings.PROXY_MAX_WS_MESSAGE_BYTES,
                compression=None,
                proxy=None,
            )
        except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as exc:
            logger.info("proxy websocket to %s failed: %s", uri, exc)
            return await _deny(scope, send, 502)
        async with upstream:
            await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

            async def client_to_workload() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "websocket.disconnect":
                        return
                    data = message.get("bytes")
                    if data is None:
                        data = message.get("text") or ""
                    if len(data) > settings.PROXY_MAX_WS_MESSAGE_BYTES:
                        return
                    await upstream.send(data)

            async def workload_to_client() -> None:
                async for data in upstream:
                    if isinstance(data, bytes):
                        await send({"type": "websocket.send", "bytes": data})
                    else:
                        await send({"type": "websocket.send", "text": data})

            tasks = [asyncio.ensure_future(client_to_workload()), asyncio.ensure_future(workload_to_client())]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            code = upstream.close_code or 1000
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": code if 1000 <= code < 5000 else 1000})


def _same_origin(headers: list[tuple[bytes, bytes]]) -> bool:
    """No Origin (not a browser: a token's client), or the Origin of the host it was sent to."""
    origin = next((v for k, v in headers if k == b"origin"), None)
    if origin is None:
        return True
    host = next((v for k, v in headers if k == b"host"), b"")
    return urlsplit(origin.decode("latin-1")).netloc.lower() == host.decode("latin-1").lower()


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _pump_response(response: httpx.Response, send: Send) -> None:
    async for chunk in response.aiter_raw():
        if chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Receive, body_done: asyncio.Event) -> None:
    await body_done.wait()
    while (await receive())["type"] != "http.disconnect":
        pass


async def _plain(
    send: Send, status: int, text: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = f"{text}\n".encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _deny(scope: Scope_, send: Send, status: int) -> None:
    """Refuse a websocket handshake with an HTTP status where the server can (404 for what the
    client may not see), else by closing it."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        body = b"Not found.\n" if status == 404 else b"Unavailable.\n"
        await send(
            {
                "type": "websocket.http.response.start",
                "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8")],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008 if status == 404 else 1013})
