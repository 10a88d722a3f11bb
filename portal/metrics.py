"""``/metrics`` in the Prometheus text format; apps add their collectors to the default registry.

With ``METRICS_TOKEN`` set, a scrape must send ``Authorization: Bearer <METRICS_TOKEN>``.
"""

import secrets

from django.conf import settings
from django.http import HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


def authorized(request) -> bool:
    token = settings.METRICS_TOKEN
    if not token:
        return True
    sent = request.META.get("HTTP_AUTHORIZATION", "")
    return secrets.compare_digest(sent.encode(), f"Bearer {token}".encode())


def unauthorized(request):
    response = HttpResponse("metrics need a bearer token\n", status=401, content_type="text/plain")
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


@never_cache
@require_GET
def metrics(request):
    if not authorized(request):
        return unauthorized(request)
    return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)
