"""``GET /api/v1/{jobs|instances}/<id>/logs/?follow=1``: a workload's new lines as
``text/event-stream``, served on the event loop so that a stream open for hours holds none of the
pages' ``WEB_THREADS`` threads (``LogFollow``, an ASGI route of settings.ASGI_ROUTES, claims the
requests with ``follow``; the others are the API's).

Same authority as the API: a bearer token with the ``read`` scope, or a signed-in member whose role
has it, acting for the tenant chosen in the session; a workload of another tenant is 404. The
stream first sends the backlog (the last ``tail`` lines, or those after ``since``), then every line
as it is stored: the ingest wakes the workload's channel-layer group (``workload_logs_group``),
and each wake reads the lines after the last one sent. Each event is ``id: <cursor>`` and ``data:``
a line as the API gives it; a comment every ``WORKLOAD_LOG_FOLLOW_KEEPALIVE_S`` keeps proxies from closing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.http import QueryDict

from nodes.services.logs import workload_logs_group
from portal.api.errors import error_body
from portal.middleware import SESSION_TENANT_KEY
from portal.models import ApiToken, Scope, StaffToken
from portal.selectors import membership_active
from portal.services.tokens import api_token_authenticate, api_token_touch
from scheduling.api import LogQuerySerializer, log_line_json
from scheduling.models import Workload, WorkloadKind
from scheduling.selectors.shared import workload_log_lines

PATH = re.compile(r"^/api/v1/(?P<kind>jobs|instances)/(?P<pk>[0-9]+)/logs/$")
KINDS = {"jobs": WorkloadKind.JOB, "instances": WorkloadKind.INSTANCE}
PAGE = 1000  # lines read per query while catching up


class Refused(Exception):
    def __init__(self, status: int, message: str, fields: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.fields = status, message, fields


class LogFollow:
    """An ASGI route (settings.ASGI_ROUTES): claims ``GET`` on a workload's logs path with a true
    ``follow`` and streams it."""

    def __init__(self, fallback) -> None:
        self.fallback = fallback  # not used: whatever this route claims, it answers
        self.stream = AuthMiddlewareStack(follow_stream)

    def claims(self, scope) -> bool:
        if scope["type"] != "http" or scope["method"] != "GET" or not PATH.match(scope["path"]):
            return False
        query = QueryDict(scope.get("query_string", b"").decode("latin-1"))
        if "follow" not in query:
            return False
        serializer = LogQuerySerializer(data={"follow": query.get("follow")})
        return serializer.is_valid() and serializer.validated_data["follow"]

    async def __call__(self, scope, receive, send):
        return await self.stream(scope, receive, send)


async def follow_stream(scope, receive, send):
    match = PATH.match(scope["path"])
    query = LogQuerySerializer(data=QueryDict(scope.get("query_string", b"").decode("latin-1")))
    try:
        if match is None:
            raise Refused(404, "Not found.")
        tenant = await _tenant_reading(scope)
        if not query.is_valid():
            fields = {k: [str(m) for m in v] for k, v in query.errors.items()}
            raise Refused(400, next(iter(fields.values()))[0], fields)
        workload_id = await _workload_id(tenant, KINDS[match["kind"]], int(match["pk"]))
    except Refused as exc:
        body = json.dumps(error_body(exc.status, exc.message, fields=exc.fields)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if exc.status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="api"'))
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    options = dict(query.validated_data)
    # A browser's EventSource reconnects with the last id it got: go on after it.
    resume = dict(scope.get("headers", ())).get(b"last-event-id", b"").decode("latin-1")
    if resume.isdigit() and len(resume) < 19:
        options["since"] = int(resume)
    await LogFollower(workload_id, options, receive, send).run()


@database_sync_to_async
def _tenant_reading(scope):
    """The tenant the request reads for, or Refused (401 without authority, 403 without ``read``)."""
    authorization = dict(scope.get("headers", ())).get(b"authorization", b"").decode("latin-1")
    scheme, _, plaintext = authorization.partition(" ")
    if authorization:
        if scheme.lower() != "bearer" or not plaintext.strip():
            raise Refused(401, "Malformed Authorization header: use 'Bearer <token>'.")
        plaintext = plaintext.strip()
        token: ApiToken | None = None
        if not plaintext.startswith(f"{StaffToken.PREFIX}_"):
            token = api_token_authenticate(plaintext=plaintext)
        if token is None or token.is_revoked or token.is_expired or token.effective_scopes is None:
            raise Refused(401, "Invalid token.")
        api_token_touch(token=token)
        tenant, scopes = token.tenant, token.effective_scopes
    else:
        user = scope.get("user")
        if user is None or not user.is_authenticated:
            raise Refused(401, "Authentication credentials were not provided.")
        session = scope.get("session")
        membership = membership_active(
            user=user, tenant_id=session.get(SESSION_TENANT_KEY) if session else None
        )
        if membership is None:
            raise Refused(403, "You are not a member of any tenant.")
        tenant, scopes = membership.tenant, membership.scopes
    if Scope.READ not in scopes:
        raise Refused(403, "This needs the 'read' scope.")
    return tenant


@database_sync_to_async
def _workload_id(tenant, kind: str, pk: int) -> int:
    found = Workload.objects.for_tenant(tenant).filter(kind=kind, pk=pk).values_list("pk", flat=True).first()
    if found is None:
        raise Refused(404, "Not found.")
    return found


@database_sync_to_async
def _lines(workload_id: int, since: int | None, tail: int):
    return workload_log_lines(workload=Workload(pk=workload_id), since=since, tail=tail)


class LogFollower:
    """One open stream: sends what is new whenever the workload's group is woken."""

    def __init__(self, workload_id: int, query: dict, receive, send) -> None:
        self.workload_id = workload_id
        self.since: int | None = query.get("since")
        self.tail: int = query["tail"]
        self.receive, self.send = receive, send
        self.gone = asyncio.Event()

    async def run(self) -> None:
        layer = get_channel_layer()
        channel = await layer.new_channel()
        group = workload_logs_group(self.workload_id)
        await layer.group_add(group, channel)  # before the backlog is read: no line falls between
        watcher = asyncio.ensure_future(self._watch_disconnect())
        try:
            await self.send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            await self._send_new(first=True)
            woken = asyncio.ensure_future(layer.receive(channel))
            gone = asyncio.ensure_future(self.gone.wait())
            try:
                while not self.gone.is_set():
                    done, _ = await asyncio.wait(
                        {woken, gone},
                        timeout=settings.WORKLOAD_LOG_FOLLOW_KEEPALIVE_S,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    if self.gone.is_set():
                        break
                    if woken in done:
                        woken = asyncio.ensure_future(layer.receive(channel))
                    else:  # quiet: keep the proxy and the group membership (it expires) alive
                        await layer.group_add(group, channel)
                        await self._body(b": keepalive\n\n")
                    await self._send_new()
            finally:
                woken.cancel()
                gone.cancel()
        finally:
            watcher.cancel()
            with contextlib.suppress(Exception):
                await layer.group_discard(group, channel)
            if not self.gone.is_set():
                with contextlib.suppress(Exception):
                    await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return

    async def _send_new(self, *, first: bool = False) -> None:
        """The backlog (first) or every line after the last one sent, page by page."""
        if first and self.since is None:
            rows, self.since = await _lines(self.workload_id, None, self.tail)
            await self._events(rows)
            return
        while not self.gone.is_set():
            rows, self.since = await _lines(self.workload_id, self.since or 0, PAGE)
            await self._events(rows)
            if len(rows) < PAGE:
                return

    async def _events(self, rows) -> None:
        if rows:
            chunks = [
                f"id: {row[0]}\ndata: {json.dumps(log_line_json(row), ensure_ascii=False)}\n\n"
                for row in rows
            ]
            await self._body("".join(chunks).encode())

    async def _body(self, body: bytes) -> None:
        await self.send({"type": "http.response.body", "body": body, "more_body": True})
