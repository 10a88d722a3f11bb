"""The fleet's staff API, mounted at ``/api/staff/v1/`` by the project URLconf."""

from rest_framework.routers import SimpleRouter

from nodes.staff_api import RolloutViewSet

router = SimpleRouter()
router.register("rollouts", RolloutViewSet, basename="staff-rollout")

app_name = "nodes-staff-api"
urlpatterns = router.urls
