"""ASGI entry point.

- Websockets: Channels (authenticated sessions).
- The agent protocol (``/agent/``): heartbeats, command polls and reports straight to their async
  views (``nodes.agent_views.AgentProtocolHandler``, their one fast route), the rest of it through
  Django's ASGI handler. The long poll holds no thread and no database connection while it waits;
  heartbeats and reports do their database work on the event loop's worker threads. The web and
  agent-web services both run this app (docs/architecture.md, "Processes").
- Everything else (pages, the API, health and metrics): Django's WSGI handler on a fixed pool of
  ``WEB_THREADS`` threads per process, through a2wsgi's ``WSGIMiddleware``. These views are
  synchronous; under Django's ASGI handler each request crossed between the event loop and a
  thread for every middleware. Pool threads live as long as the process and keep their database
  connections; Django's cache objects are per context, new for every request, and share the
  process's Redis connection pool (django-redis keeps one per server).
"""

import os
import re
import sys

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_asgi_app = get_asgi_application()

from a2wsgi import WSGIMiddleware  # noqa: E402
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.urls import get_resolver  # noqa: E402
from django.utils.module_loading import import_string  # noqa: E402

from portal.heap import heap_freeze_loaded  # noqa: E402
from portal.routing import websocket_urlpatterns  # noqa: E402

# (prefix, ASGI app), from the settings: the apps are named, not imported, as in MIDDLEWARE (portal
# imports no app above it).
PREFIX_APPS = [
    (prefix, import_string(app)(fallback=django_asgi_app)) for prefix, app in settings.ASGI_PREFIX_APPS
]

pages_app = get_wsgi_application()  # Django's WSGIHandler: settings.MIDDLEWARE as it stands
threaded_app = WSGIMiddleware(pages_app, workers=settings.WEB_THREADS)
# Long-lived streams (a workload's log follow) on the event loop, by path, named in the settings.
STREAM_APPS = [
    (re.compile(p), import_string(app)(fallback=threaded_app)) for p, app in settings.ASGI_STREAM_APPS
]


async def http_app(scope, receive, send):
    path = scope["path"]
    for prefix, app in PREFIX_APPS:
        if path.startswith(prefix):
            return await app(scope, receive, send)
    for pattern, app in STREAM_APPS:
        if pattern.match(path):
            return await app(scope, receive, send)
    await threaded_app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)

# The portal's proxy to workloads' HTTP ports (settings.ASGI_PROXY_APP) wraps everything: its
# requests and websockets under /proxy/ stay on the event loop, off the pages' thread pool.
application = import_string(settings.ASGI_PROXY_APP)(application)

# Imports the URL conf (views, serializers, filters) before the heap is frozen.
get_resolver().url_patterns  # noqa: B018
heap_freeze_loaded()
# Threads that wait for the GIL get it after 1 ms instead of 5 (WEB_GIL_SWITCH_INTERVAL_MS).
sys.setswitchinterval(settings.WEB_GIL_SWITCH_INTERVAL_MS / 1000)
