"""ASGI entry point of the web and agent-web services (docs/architecture.md, "Processes").

One routing rule: each app named in ``ASGI_ROUTES`` says which requests it claims (``claims(scope)``)
and the first to claim one serves it; everything else goes to the default app:

- pages, the API, health and metrics on Django's WSGI handler, on a fixed pool of ``WEB_THREADS``
  threads per process (a2wsgi's ``WSGIMiddleware``): the views are synchronous, and under Django's
  ASGI handler each request would cross between the event loop and a thread for every middleware.
  Pool threads live as long as the process and keep their database connections;
- websockets through Channels (authenticated sessions).

The routes are what must stay on the event loop: the agent protocol's heartbeats, polls, reports
and log batches (a long poll holds no thread), a workload's log follow stream, and the proxy to
workloads' HTTP ports and websockets (connections that may last hours). Each is built with the
default app as its ``fallback`` for what it passes on.
"""

import os
import sys

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
pages_app = get_wsgi_application()  # Django's WSGIHandler: settings.MIDDLEWARE as it stands

from a2wsgi import WSGIMiddleware  # noqa: E402
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.urls import get_resolver  # noqa: E402
from django.utils.module_loading import import_string  # noqa: E402

from portal.heap import heap_freeze_loaded  # noqa: E402
from portal.routing import websocket_urlpatterns  # noqa: E402

default_app = ProtocolTypeRouter(
    {
        "http": WSGIMiddleware(pages_app, workers=settings.WEB_THREADS),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
# Named, not imported, as MIDDLEWARE's classes are (portal imports no app above it).
ROUTES = [import_string(name)(fallback=default_app) for name in settings.ASGI_ROUTES]


async def application(scope, receive, send):
    if scope["type"] in ("http", "websocket"):
        for route in ROUTES:
            if route.claims(scope):
                return await route(scope, receive, send)
    await default_app(scope, receive, send)


# Imports the URL conf (views, serializers, filters) before the heap is frozen.
get_resolver().url_patterns  # noqa: B018
heap_freeze_loaded()
# Threads that wait for the GIL get it after 1 ms instead of 5 (WEB_GIL_SWITCH_INTERVAL_MS).
sys.setswitchinterval(settings.WEB_GIL_SWITCH_INTERVAL_MS / 1000)
