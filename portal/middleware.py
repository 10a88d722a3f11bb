from __future__ import annotations

import json
import logging
import re
import time
import uuid
from inspect import iscoroutinefunction

from asgiref.sync import markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import JsonResponse

from portal.api.errors import error_response, request_data_refused
from portal.logging import log_context_bind, log_context_reset, log_context_start

logger = logging.getLogger(__name__)

JSON_PREFIXES = ("/api/", "/agent/")
SESSION_TENANT_KEY = "tenant_id"


class SyncAsyncMiddleware:
    """A middleware that runs in the chain's own mode (sync under WSGI, async under ASGI), so a
    request never pays a thread hop for it; subclasses branch on ``self.is_async`` in ``__call__``."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)


def body_refused(request):
    """A JSON 400 for a Content-Length that is not a number, 413 for a body over the upload limit
    (checked before anything reads the body); None when the body may be read."""
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return error_response(400, "Content-Length is not a number.")
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if limit is not None and length > limit:
        return error_response(413, f"The request body is larger than {limit} bytes.")
    return None


class ApiErrorMiddleware:
    """Gives Django's own errors on API paths (404, 405, 413, 500, ...) the API's JSON error shape."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if not request.path.startswith(JSON_PREFIXES):
            return self.get_response(request)
        refused = body_refused(request)
        if refused is not None:
            return refused
        response = self.get_response(request)
        if response.status_code >= 400 and not response.get("Content-Type", "").startswith(
            "application/json"
        ):
            message = _message_for(response)
            new = error_response(response.status_code, message)
            for header in ("Allow", "Retry-After", "WWW-Authenticate"):
                if header in response:
                    new[header] = response[header]
            return new
        return response

    def process_exception(self, request, exception):
        if request.path.startswith(JSON_PREFIXES):
            refused = request_data_refused(exception)
            if refused is not None:  # a form or body over Django's limits: the client's doing
                return JsonResponse(refused[1], status=refused[0])
            logger.exception("Unhandled error on %s", request.path, exc_info=exception)
            return error_response(500, "Internal server error.")
        return None


def _message_for(response) -> str:
    from http import HTTPStatus

    try:
        payload = json.loads(response.content)
        if isinstance(payload, dict) and "detail" in payload:
            return str(payload["detail"])
    except (ValueError, TypeError):
        pass
    try:
        return HTTPStatus(response.status_code).phrase + "."
    except ValueError:
        return "Request failed."


class TenantMiddleware:
    """Sets ``request.membership`` and ``request.tenant`` for a signed-in person.

    The active tenant is the one chosen with the tenant switcher (kept in the session), else the
    first tenant the person belongs to. API tokens are resolved by the API layer instead.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        membership = _active_membership(request)
        request.membership = membership  # type: ignore[attr-defined]
        request.tenant = membership.tenant if membership else None  # type: ignore[attr-defined]
        return self.get_response(request)


def _active_membership(request):
    from portal.selectors import membership_active

    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    return membership_active(user=user, tenant_id=request.session.get(SESSION_TENANT_KEY))


class UserTimezoneMiddleware:
    """Shows times in the signed-in person's time zone (``User.time_zone``); UTC otherwise."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        from django.utils import timezone

        user = getattr(request, "user", None)
        zone = None
        if user is not None and user.is_authenticated and user.time_zone:
            try:
                zone = ZoneInfo(user.time_zone)
            except (ZoneInfoNotFoundError, ValueError):
                zone = None
        if zone is not None:
            timezone.activate(zone)
        else:
            timezone.deactivate()
        try:
            return self.get_response(request)
        finally:
            timezone.deactivate()


class ProbeMiddleware(SyncAsyncMiddleware):
    """``/healthz``, ``/readyz`` and ``/metrics`` answer before host validation, HTTPS redirects,
    sessions and the rest: load balancers, kubelets and Prometheus reach pods by IP address,
    which ``ALLOWED_HOSTS`` rightly refuses for everything else. ``/metrics`` asks for
    ``Authorization: Bearer <METRICS_TOKEN>`` when that setting is set."""

    def __call__(self, request):
        view = self._view_for(request)
        if self.is_async:
            return self._acall(request, view)
        return view(request) if view is not None else self.get_response(request)

    async def _acall(self, request, view):
        if view is None:
            return await self.get_response(request)
        return await sync_to_async(view, thread_sensitive=True)(request)

    @staticmethod
    def _view_for(request):
        from portal import health, metrics

        view = {"/healthz": health.healthz, "/readyz": health.readyz, "/metrics": metrics.metrics}.get(
            request.path
        )
        if view is metrics.metrics and not metrics.authorized(request):
            return metrics.unauthorized
        return view


REQUEST_ID_HEADER = "X-Request-ID"
_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
request_logger = logging.getLogger("portal.requests")
QUIET_PATHS = ("/healthz", "/readyz", "/metrics")


class RequestIdMiddleware(SyncAsyncMiddleware):
    """Gives every request an id for its log lines: the incoming ``X-Request-ID`` when it is a
    plausible id (up to 128 of ``A-Za-z0-9._:-``), else a new one; echoed in the response's
    ``X-Request-ID``. Binds ``request_id`` (and, once known, ``tenant_id`` and ``user_id``) in the
    log context (portal.logging) and writes one ``portal.requests`` line per request (probes are
    left out; agent traffic logs at DEBUG)."""

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        token, started = self.start(request)
        try:
            return self.finish(request, self.get_response(request), started)
        finally:
            # Under Django's ASGI handler a sync chain runs in a thread whose context changes come
            # back to the request's task, where Django logs 4xx/5xx answers after the chain: the
            # ids stay for that line (the task's context ends with the request). Under WSGI the
            # thread serves the next request: reset.
            if not isinstance(request, ASGIRequest):
                log_context_reset(token)

    async def _acall(self, request):
        # No reset here: Django logs 4xx/5xx answers after the middleware chain has returned, and
        # the ids should be on that line too. Under ASGI each request runs in a task of its own (a
        # copy of the context); under WSGI (async_to_sync) the ids stay in the thread until its
        # next request starts a fresh context.
        _, started = self.start(request)
        return self.finish(request, await self.get_response(request), started)

    @staticmethod
    def start(request):
        sent = request.META.get("HTTP_X_REQUEST_ID", "")
        request_id = sent if _REQUEST_ID_OK.match(sent) else uuid.uuid4().hex
        request.request_id = request_id  # type: ignore[attr-defined]
        return log_context_start(request_id=request_id), time.perf_counter()

    def process_view(self, request, view_func, view_args, view_kwargs):
        # Sync: pages and the API run on the WSGI thread pool (portal/asgi.py), where an async
        # method cost an event loop run per request; only the agent protocol's rare requests
        # through Django's ASGI handler take a thread hop for it. It reads only what
        # TenantMiddleware already loaded (it evaluated ``request.user``), never the database.
        tenant = getattr(request, "tenant", None)
        user = getattr(request, "user", None)
        log_context_bind(
            tenant_id=tenant.pk if tenant is not None else None,
            user_id=user.pk if user is not None and user.is_authenticated else None,
        )

    @staticmethod
    def finish(request, response, started):
        response[REQUEST_ID_HEADER] = request.request_id
        path = request.path
        if not path.startswith(QUIET_PATHS):
            level = logging.DEBUG if path.startswith("/agent/") else logging.INFO
            if request_logger.isEnabledFor(level):
                request_logger.log(
                    level,
                    "%s %s %s",
                    request.method,
                    path,
                    response.status_code,
                    extra={
                        "method": request.method,
                        "path": path,
                        "status": response.status_code,
                        "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                    },
                )
        return response


class SignInLimitMiddleware:
    """A sign-in the attempt limiter refused (``portal.signin``), on any password form, answers
    429 with Retry-After; the form itself says why."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        from portal.signin import retry_after

        response = self.get_response(request)
        wait = retry_after(request)
        if wait:
            response.status_code = 429
            response["Retry-After"] = str(wait)
        return response


STAFF_LAST_SEEN_KEY = "staff_last_seen"


class StaffIdleTimeoutMiddleware:
    """A staff person's session ends after ``STAFF_SESSION_IDLE_S`` seconds without a request; the
    next request is then anonymous (sign in again). The time seen is written at most once a minute."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        idle = settings.STAFF_SESSION_IDLE_S
        user = getattr(request, "user", None)
        if idle and user is not None and user.is_authenticated and user.is_staff:
            from django.contrib.auth import logout

            now = int(time.time())
            last = request.session.get(STAFF_LAST_SEEN_KEY)
            if last is not None and now - last > idle:
                logout(request)  # request.user is now anonymous
            elif last is None or now - last >= 60:
                request.session[STAFF_LAST_SEEN_KEY] = now
        return self.get_response(request)
