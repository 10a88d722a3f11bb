"""The staff fleet pages, mounted at ``/fleet/`` by the project URLconf."""

from django.urls import path

from nodes.views import fleet, node, rollouts

app_name = "nodes"
urlpatterns = [
    path("", fleet.FleetOverviewView.as_view(), name="fleet"),
    path("nodes/<int:pk>/", node.NodeDetailView.as_view(), name="node"),
    path("nodes/<int:pk>/actions/<str:action>/", node.NodeActionView.as_view(), name="node-action"),
    path("nodes/<int:pk>/rekey/", node.NodeRekeyView.as_view(), name="node-rekey"),
    path("gpus/<int:pk>/return/", node.GpuReturnView.as_view(), name="gpu-return"),
    path("gpus/<int:pk>/mig/", node.GpuMigView.as_view(), name="gpu-mig"),
    path("gpus/<int:pk>/mig/cancel/", node.GpuMigCancelView.as_view(), name="gpu-mig-cancel"),
    path("rollouts/", rollouts.RolloutListView.as_view(), name="rollouts"),
    path("rollouts/<int:pk>/", rollouts.RolloutDetailView.as_view(), name="rollout"),
    path("rollouts/<int:pk>/<str:action>/", rollouts.RolloutActionView.as_view(), name="rollout-action"),
]
