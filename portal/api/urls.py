"""``/api/v1/``: every app's ``api`` module registers its viewsets on the shared router."""

from django.urls import path
from django.utils.module_loading import autodiscover_modules

from portal.api import views
from portal.api.routers import extra_urlpatterns, router

router.register("members", views.MemberViewSet, basename="member")
router.register("invitations", views.InvitationViewSet, basename="invitation")
router.register("tokens", views.ApiTokenViewSet, basename="token")
router.register("audit-events", views.AuditEventViewSet, basename="audit-event")
router.register("secrets", views.SecretViewSet, basename="secret")
autodiscover_modules("api")

app_name = "api"
urlpatterns = [path("me/", views.MeView.as_view(), name="me"), *extra_urlpatterns, *router.urls]
