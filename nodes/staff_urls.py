"""The fleet's staff API, mounted at ``/api/staff/v1/`` by the project URLconf."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from nodes.staff_api import GpuMigApi, GpuMigCancelApi, RolloutViewSet

router = SimpleRouter()
router.register("rollouts", RolloutViewSet, basename="staff-rollout")

app_name = "nodes-staff-api"
urlpatterns = [
    path("gpus/<int:pk>/mig/", GpuMigApi.as_view(), name="gpu-mig"),
    path("gpus/<int:pk>/mig/cancel/", GpuMigCancelApi.as_view(), name="gpu-mig-cancel"),
    *router.urls,
]
