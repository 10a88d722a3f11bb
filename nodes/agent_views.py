"""The agent protocol (nodes/PROTOCOL.md): plain Django views, authenticated by node credentials.

Tenant tokens open nothing here: only ``Authorization: Node gpn_...`` is accepted (401 otherwise).
The long poll is an async view that holds no database connection while it waits.
"""

from __future__ import annotations

import functools
import logging
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from nodes import metrics as node_metrics
from nodes.models import Interconnect
from nodes.services import commands as command_services
from nodes.services.heartbeat_parse import heartbeat_parse
from nodes.services.ingest import heartbeat_ingest
from nodes.services.logs import log_batch_parse, node_logs_ingest, workload_logs_group
from nodes.services.registration import (
    AuthenticatedNode,
    GpuInfo,
    NodeInfo,
    NotAuthenticated,
    credential_node_id,
    node_authenticate,
    node_register,
)
from nodes.services.wakeup import CommandWaiter
from nodes.validation import (
    clean_labels,
    fail,
    get_address,
    get_bool,
    get_int,
    get_str,
    json_object,
    parse_time,
    require_object,
)
from portal.api.errors import error_response
from portal.errors import DomainError, NotFound, ValidationFailed
from portal.logging import log_context_reset
from portal.middleware import RequestIdMiddleware, body_refused

AUTH_SCHEME = "Node"
logger = logging.getLogger(__name__)


def _now_str() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _domain_error(exc: DomainError) -> JsonResponse:
    response = error_response(exc.status_code, exc.message, code=exc.code, fields=exc.fields)
    if exc.status_code == 401:
        response["WWW-Authenticate"] = f'{AUTH_SCHEME} realm="agent"'
    return response


def agent_endpoint(view):
    """Render domain errors in the API's error shape (400 naming the field, 401, 404, ...)."""

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        try:
            return view(request, *args, **kwargs)
        except DomainError as exc:
            if isinstance(exc, NotAuthenticated) or exc.status_code == 400:
                node_metrics.AGENT_REJECTED.labels(status=str(exc.status_code)).inc()
            return _domain_error(exc)

    return csrf_exempt(wrapper)


def _credential(request: HttpRequest | str) -> str:
    header = request if isinstance(request, str) else request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != AUTH_SCHEME.lower() or not value.strip():
        raise NotAuthenticated(f"Send the node credential as 'Authorization: {AUTH_SCHEME} gpn_...'.")
    return value.strip()


def authenticate_for(request: HttpRequest | str, node_id: int) -> AuthenticatedNode:
    """401 for a missing or wrong credential; 404 when the credential is another node's."""
    node = node_authenticate(credential=_credential(request))
    if node.id != node_id:
        raise NotFound("No such node.")
    return node


# --- register -----------------------------------------------------------------------------------------


def _parse_registration(data: dict) -> tuple[str, NodeInfo]:
    token = get_str(data, "bootstrap_token", "bootstrap_token", required=True)
    labels = clean_labels(data.get("labels") or {}, "labels")
    interconnect = get_str(data, "interconnect", "interconnect", max_length=16) or Interconnect.PCIE
    if interconnect not in Interconnect.values:
        raise fail("interconnect", f"One of {', '.join(Interconnect.values)}.")
    raw_gpus = data.get("gpus", [])
    if not isinstance(raw_gpus, list) or len(raw_gpus) > 64:
        raise fail("gpus", "Expected a list of at most 64 GPUs.")
    gpus, uuids, indexes = [], set(), set()
    for i, g in enumerate(raw_gpus):
        require_object(g, f"gpus[{i}]")
        index = get_int(g, "index", f"gpus[{i}].index", required=True, min_value=0, max_value=1023)
        uuid = get_str(g, "uuid", f"gpus[{i}].uuid", required=True, max_length=96)
        if uuid in uuids:
            raise fail(f"gpus[{i}].uuid", "Listed twice.")
        if index in indexes:
            raise fail(f"gpus[{i}].index", "Listed twice.")
        uuids.add(uuid)
        indexes.add(index)
        gpus.append(
            GpuInfo(
                index=index,
                uuid=uuid,
                name=get_str(g, "name", f"gpus[{i}].name", required=True, max_length=128),
                memory_mib=get_int(g, "memory_mib", f"gpus[{i}].memory_mib", default=0, min_value=0) or 0,
                pci_bus_id=get_str(g, "pci_bus_id", f"gpus[{i}].pci_bus_id", max_length=32),
                nvlink_island=get_int(
                    g, "nvlink_island", f"gpus[{i}].nvlink_island", min_value=-1, max_value=1023
                ),
                numa_node=get_int(g, "numa_node", f"gpus[{i}].numa_node", min_value=-1, max_value=1023),
                mig_mode=get_bool(g, "mig_mode", f"gpus[{i}].mig_mode"),
                firmware_version=get_str(g, "firmware_version", f"gpus[{i}].firmware_version", max_length=64),
            )
        )
    info = NodeInfo(
        hostname=get_str(data, "hostname", "hostname", required=True, max_length=253).strip(),
        address=get_address(data, "address"),
        region=get_str(data, "region", "region", max_length=32),
        labels=labels,
        cpu_cores=get_int(data, "cpu_cores", "cpu_cores", default=0, min_value=0, max_value=100_000) or 0,
        ram_mib=get_int(data, "ram_mib", "ram_mib", default=0, min_value=0) or 0,
        driver_version=get_str(data, "driver_version", "driver_version", max_length=64),
        cuda_version=get_str(data, "cuda_version", "cuda_version", max_length=32),
        rocm_version=get_str(data, "rocm_version", "rocm_version", max_length=32),
        level_zero_version=get_str(data, "level_zero_version", "level_zero_version", max_length=32),
        agent_version=get_str(data, "agent_version", "agent_version", max_length=32),
        interconnect=interconnect,
        gpus=tuple(gpus),
        simulated=str(labels.get("simulated", "")).lower() in ("true", "1", "yes"),
    )
    return token, info


@require_POST
@agent_endpoint
def register(request):
    token, info = _parse_registration(json_object(request.body))
    node, credential = node_register(bootstrap_token=token, info=info)
    return JsonResponse(
        {
            "node_id": node.pk,
            "credential": credential,
            "heartbeat_interval_s": settings.NODE_HEARTBEAT_INTERVAL_S,
            "commands_wait_s": settings.NODE_COMMANDS_DEFAULT_WAIT_S,
        },
        status=201,
    )


# --- database work from async views -------------------------------------------------------------------

# Under ASGI, Django runs each sync view in a thread of its own, which opens a database connection
# of its own: a new PostgreSQL connection per heartbeat. The agent views are async instead and run
# their database work on threads of their own (``db_executor``), whose connections persist
# (CONN_MAX_AGE, or the process's connection pool) and are shared by all requests; nothing holds a
# connection while a long poll sleeps. Tests that drive the ASGI app through async_to_sync need the
# work in the caller's thread (the test's transaction): tests/nodes sets this to True.
DB_THREAD_SENSITIVE = False


@functools.cache
def db_executor() -> ThreadPoolExecutor:
    """The agent views' database threads: one per connection of the process's pool (DB_POOL_MAX_SIZE),
    or WEB_THREADS without one. Not the event loop's default executor: that has ``cpu_count + 4``
    threads, and a heartbeat holds its thread for every round trip to PostgreSQL, so on a small
    machine six heartbeats in flight were the agent ingress's whole capacity whatever CPU was free
    (docs/performance.md)."""
    threads = getattr(settings, "DB_POOL_MAX_SIZE", 0) or settings.WEB_THREADS
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="agent-db")


def _connection_checked() -> None:
    """What Django does around a request (drop a connection that failed or outlived CONN_MAX_AGE),
    without the health check query (``SELECT 1``) that ``close_old_connections`` makes the next
    query run each time: at hundreds of heartbeats a second that is a round trip per request. A
    connection that breaks fails one request (the agent sends it again) and is replaced. The agent
    views use the default database only."""
    conn = connection
    if conn.connection is not None and (
        conn.errors_occurred or (conn.close_at is not None and time.monotonic() >= conn.close_at)
    ):
        conn.close_if_unusable_or_obsolete()


def _connection_released() -> None:
    if connection.connection is not None and connection.settings_dict.get("CONN_MAX_AGE") == 0:
        connection.close()  # no persistent connections configured: none is kept past the request


def in_db_thread(fn):
    def job(*args, **kwargs):
        if DB_THREAD_SENSITIVE:
            return fn(*args, **kwargs)
        _connection_checked()
        try:
            return fn(*args, **kwargs)
        finally:
            _connection_released()

    if DB_THREAD_SENSITIVE:
        return sync_to_async(job, thread_sensitive=True)
    return sync_to_async(job, thread_sensitive=False, executor=db_executor())


# --- heartbeat ----------------------------------------------------------------------------------------


def _heartbeat_sync(authorization: str, body: bytes, node_id: int) -> JsonResponse:
    try:
        credential = _credential(authorization)
        if credential_node_id(credential) != node_id:
            authenticate_for(authorization, node_id)  # 401, or 404 for another node's credential
            raise NotAuthenticated("Invalid node credential.")
        try:
            batch = heartbeat_parse(body)
        except ValidationFailed:
            node_authenticate(credential=credential)  # a wrong credential is 401 whatever the body
            raise
        # The credential is checked in the ingest transaction's first statement.
        result = heartbeat_ingest(node_id=node_id, credential=credential, batch=batch)
    except DomainError as exc:
        if isinstance(exc, NotAuthenticated) or exc.status_code == 400:
            node_metrics.AGENT_REJECTED.labels(status=str(exc.status_code)).inc()
        return _domain_error(exc)
    data = {
        "status": result.status,
        "gap": list(result.gap) if result.gap else None,
        "server_time": _now_str(),
    }
    if result.ignored_samples:
        data["ignored_samples"] = result.ignored_samples
    return JsonResponse(data)


@csrf_exempt
@require_POST
async def heartbeat(request, node_id: int):
    return await in_db_thread(_heartbeat_sync)(
        request.headers.get("Authorization", ""), request.body, node_id
    )


# --- commands -----------------------------------------------------------------------------------------


def _open_poll_sync(authorization: str, node_id: int, raw_wait: str):
    """The poll's first round in one trip to a database thread: the credential (401/404 first),
    then the ``wait`` parameter (400), then the commands due."""
    authenticate_for(authorization, node_id)
    try:
        wait = float(raw_wait)
    except ValueError:
        raise fail("wait", "Expected a number of seconds.") from None
    if not 0 <= wait <= settings.NODE_COMMANDS_MAX_WAIT_S:
        raise fail("wait", f"Between 0 and {settings.NODE_COMMANDS_MAX_WAIT_S} seconds.")
    return wait, *command_services.node_commands_deliver_due(node_id=node_id)


def _deliver_sync(node_id: int):
    return command_services.node_commands_deliver_due(node_id=node_id)


@csrf_exempt
@require_GET
async def commands(request, node_id: int):
    raw_wait = request.GET.get("wait", str(settings.NODE_COMMANDS_DEFAULT_WAIT_S))
    async with CommandWaiter(node_id) as waiter:
        waiter.arm()  # a command queued from here on wakes the wait below
        try:
            wait, delivered, next_due = await in_db_thread(_open_poll_sync)(
                request.headers.get("Authorization", ""), node_id, raw_wait
            )
        except DomainError as exc:
            return _domain_error(exc)
        give_up = time.monotonic() + wait
        while not delivered:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                break
            if next_due is not None:
                until_due = (next_due - datetime.now(UTC)).total_seconds()
                remaining = min(remaining, max(until_due, 0.05))
            await waiter.wait(remaining)
            waiter.arm()
            delivered, next_due = await in_db_thread(_deliver_sync)(node_id)
    return JsonResponse({"commands": [command_services.command_as_wire(c) for c in delivered]})


def _report_sync(authorization: str, body: bytes, node_id: int, command_id: str) -> JsonResponse:
    try:
        authenticate_for(authorization, node_id)
        data = json_object(body)
        status = get_str(data, "status", "status", required=True, max_length=16)
        result = data.get("result") or {}
        if not isinstance(result, dict):
            raise fail("result", "Expected an object.")
        command = command_services.node_command_report(
            node_id=node_id,
            command_id=command_id,
            status=status,
            result=result,
            message=get_str(data, "message", "message", max_length=10_000),
            at=parse_time(data.get("at"), "at", required=False),
        )
    except DomainError as exc:
        if isinstance(exc, NotAuthenticated) or exc.status_code == 400:
            node_metrics.AGENT_REJECTED.labels(status=str(exc.status_code)).inc()
        return _domain_error(exc)
    return JsonResponse({"status": command.state})


@csrf_exempt
@require_POST
async def command_report(request, node_id: int, command_id: str):
    return await in_db_thread(_report_sync)(
        request.headers.get("Authorization", ""), request.body, node_id, command_id
    )


# --- workload output ----------------------------------------------------------------------------------


def _logs_sync(authorization: str, body: bytes, node_id: int):
    authenticate_for(authorization, node_id)  # 401 / 404 before anything is read
    batch = log_batch_parse(body, now=time.time())
    return node_logs_ingest(node_id=node_id, batch=batch)


@csrf_exempt
@require_POST
async def logs(request, node_id: int):
    """Workload output (nodes/PROTOCOL.md): idempotent by the batch's ``seq``; lines of workloads
    not placed on this node are refused (listed in the answer, not stored). Followers of the
    workloads that got lines are woken through the channel layer once the lines are committed."""
    try:
        result = await in_db_thread(_logs_sync)(
            request.headers.get("Authorization", ""), request.body, node_id
        )
    except DomainError as exc:
        if isinstance(exc, NotAuthenticated) or exc.status_code == 400:
            node_metrics.AGENT_REJECTED.labels(status=str(exc.status_code)).inc()
        return _domain_error(exc)
    layer = get_channel_layer()
    if layer is not None:
        for workload_id in result.written:
            await layer.group_send(workload_logs_group(workload_id), {"type": "logs.appended"})
    data: dict = {"status": result.status, "lines": result.lines}
    if result.refused:
        data["refused"] = result.refused
    return JsonResponse(data)


# --- the fast path ------------------------------------------------------------------------------------

_FAST_ROUTES = re.compile(
    r"^/agent/v1/nodes/(?P<node_id>[0-9]+)/"
    r"(?:(?P<hb>heartbeat)|(?P<logs>logs)|commands(?:/(?P<cmd>[^/]+)/report)?)$"
)


def fast_route(path: str, method: str):
    """The view and its arguments for a heartbeat, command poll, command report or log batch; (None,
    None) for anything else."""
    match = _FAST_ROUTES.match(path)
    if match is None:
        return None, None
    node_id = int(match["node_id"])
    if match["hb"]:
        return (heartbeat, {"node_id": node_id}) if method == "POST" else (None, None)
    if match["logs"]:
        return (logs, {"node_id": node_id}) if method == "POST" else (None, None)
    if match["cmd"]:
        if method != "POST":
            return None, None
        return command_report, {"node_id": node_id, "command_id": match["cmd"]}
    return (commands, {"node_id": node_id}) if method == "GET" else (None, None)


async def serve_fast(request, view, kwargs) -> HttpResponse:
    """What the middleware chain does that the agent protocol needs: bodies over the upload limit
    are 413, errors are JSON, responses have a Content-Length."""
    refused = body_refused(request)
    if refused is not None:
        return refused
    try:
        response = await view(request, **kwargs)
    except Exception:
        logger.exception("Unhandled error on %s", request.path)
        return error_response(500, "Internal server error.")
    if not response.has_header("Content-Length"):  # as CommonMiddleware: no chunked encoding
        response["Content-Length"] = str(len(response.content))
    return response


class AgentProtocolHandler(ASGIHandler):
    """The agent protocol's one fast route, an ASGI route (settings.ASGI_ROUTES) claiming
    ``/agent/``: heartbeats, command polls, command reports and log batches go from the server
    straight to their async views (``serve_fast``), without the session, authentication, CSRF,
    message, htmx and tenant middleware that the protocol does not use; everything else (register,
    another method, an unknown path, plain HTTP when SECURE_SSL_REDIRECT asks for HTTPS) goes to
    ``fallback``, the pages' Django handler. The views are in the URL conf too, so a deployment of
    Django's own handlers serves them through the whole chain, with the same answers, slower.

    Django's ASGI handler sends ``request_started`` and ``request_finished`` and closes the
    response through sync_to_async in a thread-sensitive context: a thread made for each request,
    and two hops to it, for receivers that manage database connections (which these views' database
    work does itself, see ``in_db_thread``) and reset ``connection.queries``. Request ids and the
    request's log line are as RequestIdMiddleware makes them. A poll's client that goes away is
    noticed when its wait ends (at most ``NODE_COMMANDS_MAX_WAIT_S``), not at once."""

    def __init__(self, fallback):  # no middleware chain: BaseHandler's empty slots stay
        self.fallback = fallback

    def claims(self, scope) -> bool:
        return scope["type"] == "http" and self.path(scope).startswith("/agent/")

    @staticmethod
    def path(scope) -> str:
        path = scope["path"]
        root = scope.get("root_path", "")
        return path[len(root) :] if root and path.startswith(root) else path

    async def __call__(self, scope, receive, send):
        path = self.path(scope)
        # Every agent request's body is read here, up to the limit, the rest too (register)
        # before Django's handler, which would spool any size to disk first.
        try:
            body_file, refused = await read_body_limited(scope, receive)
        except RequestAborted:
            return
        if refused is not None:
            return await self.send_response(refused, send)
        view, kwargs = fast_route(path, scope["method"])
        if view is None:
            return await self.fallback(*_replay(scope, body_file, receive), send)
        try:
            request, response = self.create_request(scope, body_file)
            # Whether it came over HTTPS is the request's to say (proxy headers, TRUSTED_PROXIES).
            if request is not None and settings.SECURE_SSL_REDIRECT and not request.is_secure():
                # Django's chain redirects it.
                return await self.fallback(*_replay(scope, body_file, receive), send)
            if request is not None:
                token, started = RequestIdMiddleware.start(request)
                try:
                    response = RequestIdMiddleware.finish(
                        request, await serve_fast(request, view, kwargs), started
                    )
                finally:
                    log_context_reset(token)
            await self.send_response(response, send)
        finally:
            body_file.close()


def _replay(scope, body_file, receive):
    """``(scope, receive)`` for the fallback: a ``receive`` that gives the body already read, then the
    client's own messages (a disconnect), and the scope's headers saying the body's length (a chunked
    body is whole now, and a WSGI handler reads only as much as ``Content-Length`` says)."""
    body_file.seek(0)
    body = body_file.read()
    body_file.close()
    replayed = [{"type": "http.request", "body": body, "more_body": False}]
    headers = [
        (name, value)
        for name, value in scope.get("headers", ())
        if name.lower() not in (b"content-length", b"transfer-encoding")
    ]

    async def replay():
        return replayed.pop() if replayed else await receive()

    return {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}, replay


async def read_body_limited(scope, receive):
    """``(body_file, None)``, or ``(None, response)``: 400 for a Content-Length that is not a number,
    413 for a declared length over DATA_UPLOAD_MAX_MEMORY_SIZE (nothing read) or for a body that
    passes it while it arrives (chunked bodies have no declared length; reading stops there).
    RequestAborted when the client goes away."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    too_big = f"The request body is larger than {limit} bytes."
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                return None, error_response(400, "Content-Length is not a number.")
            if limit is not None and declared > limit:
                return None, error_response(413, too_big)
    body_file = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")  # noqa: SIM115
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            body_file.close()
            raise RequestAborted()
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            body_file.close()
            return None, error_response(413, too_big)
        body_file.write(chunk)
        if not message.get("more_body", False):
            break
    body_file.seek(0)
    return body_file, None
