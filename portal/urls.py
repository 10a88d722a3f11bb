from csp.constants import NONCE
from csp.decorators import csp_update
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from portal import health, metrics
from portal.views.accounts import AdminPasswordChangeView

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics.metrics, name="metrics"),
    # Ahead of the admin's own: its password change behind the sign-in limiter (portal.signin).
    path(
        "admin/password_change/",
        admin.site.admin_view(AdminPasswordChangeView.as_view()),
        name="admin-password-change",
    ),
    path("admin/", admin.site.urls),
    path("api/v1/", include("portal.api.urls")),
    path("agent/v1/", include("nodes.agent_urls")),
    path("fleet/", include("nodes.web_urls")),
    path("api/staff/v1/", include("nodes.staff_urls")),
    path("webhooks/stripe/", include("metering.webhooks")),
    path("", include("scheduling.web_urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # Swagger UI under the strict CSP: its inline init script runs by the request's nonce (our
    # template), its icons are data: SVG images; nothing else is loosened.
    path(
        "api/docs/",
        csp_update({"script-src": [NONCE], "img-src": ["data:"]})(
            SpectacularSwaggerView.as_view(url_name="schema", template_name="portal/swagger_ui.html")
        ),
        name="api-docs",
    ),
    path("", include("metering.urls")),
    path("", include("webhooks.web_urls")),
    path("", include("portal.web_urls")),
]
