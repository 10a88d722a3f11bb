from rest_framework.routers import SimpleRouter


class ApiRouter(SimpleRouter):
    """The API router every app registers its viewsets on (no format-suffix routes)."""

    include_format_suffixes = False


# Each app's ``api`` module (found by autodiscovery, so portal imports no other app) registers its
# viewsets on ``router`` and may append plain views to ``extra_urlpatterns``.
router = ApiRouter()
extra_urlpatterns: list = []
