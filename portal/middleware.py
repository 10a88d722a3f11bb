from __future__ import annotations

import json
import logging
from inspect import iscoroutinefunction

from asgiref.sync import markcoroutinefunction, sync_to_async
from django.conf import settings

from portal.api.errors import error_response

logger = logging.getLogger(__name__)

JSON_PREFIXES = ("/api/", "/agent/")
SESSION_TENANT_KEY = "tenant_id"


class ApiErrorMiddleware:
    """Gives Django's own errors on API paths (404, 405, 413, 500, ...) the API's JSON error shape."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if not request.path.startswith(JSON_PREFIXES):
            return self.get_response(request)
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return error_response(400, "Content-Length is not a number.")
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if limit is not None and length > limit:
            return error_response(413, f"The request body is larger than {limit} bytes.")
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


class ProbeMiddleware:
    """``/healthz``, ``/readyz`` and ``/metrics`` answer before host validation, HTTPS redirects,
    sessions and the rest: load balancers, kubelets and Prometheus reach pods by IP address,
    which ``ALLOWED_HOSTS`` rightly refuses for everything else. ``/metrics`` asks for
    ``Authorization: Bearer <METRICS_TOKEN>`` when that setting is set."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

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
