"""The tenant's workload pages, mounted at the site root by the project URLconf."""

from django.urls import path

from scheduling import staff_api
from scheduling.views import launch, ssh_keys, staff, templates, volumes, workloads

app_name = "scheduling"
urlpatterns = [
    path("launch/", launch.LaunchView.as_view(), name="launch"),
    path("launch/summary/", launch.LaunchSummaryView.as_view(), name="launch-summary"),
    path("workloads/", workloads.WorkloadListView.as_view(), name="workloads"),
    path("workloads/<int:pk>/", workloads.WorkloadDetailView.as_view(), name="workload"),
    path("workloads/<int:pk>/live/", workloads.WorkloadLiveView.as_view(), name="workload-live"),
    path(
        "workloads/<int:pk>/telemetry/", workloads.WorkloadTelemetryView.as_view(), name="workload-telemetry"
    ),
    path(
        "workloads/<int:pk>/logs.txt",
        workloads.WorkloadLogDownloadView.as_view(),
        name="workload-log-download",
    ),
    path("workloads/<int:pk>/stop/", workloads.WorkloadStopView.as_view(), name="workload-stop"),
    path("workloads/<int:pk>/restart/", workloads.WorkloadRestartView.as_view(), name="workload-restart"),
    path("workloads/<int:pk>/resize/", workloads.WorkloadResizeView.as_view(), name="workload-resize"),
    path("account/ssh-keys/", ssh_keys.SshKeysView.as_view(), name="ssh-keys"),
    path("account/ssh-keys/<int:pk>/delete/", ssh_keys.SshKeyDeleteView.as_view(), name="ssh-key-delete"),
    path("volumes/", volumes.VolumesView.as_view(), name="volumes"),
    path("templates/", templates.TemplatesView.as_view(), name="templates"),
    path("templates/<int:pk>/edit/", templates.TemplateEditView.as_view(), name="template-edit"),
    path("templates/<int:pk>/delete/", templates.TemplateDeleteView.as_view(), name="template-delete"),
    path("volumes/<int:pk>/delete/", volumes.VolumeDeleteView.as_view(), name="volume-delete"),
    path("workloads/<int:pk>/open/<int:port>/", workloads.WorkloadOpenView.as_view(), name="workload-open"),
    path(
        "workloads/<int:pk>/share-link/",
        workloads.WorkloadShareLinkView.as_view(),
        name="workload-share-link",
    ),
    path("panels/workloads/", workloads.WorkloadsPanel.as_view(), name="panel-workloads"),
    path("staff/quotas/", staff.QuotaListView.as_view(), name="staff-quotas"),
    path("staff/quotas/bulk/", staff.QuotaBulkView.as_view(), name="staff-quotas-bulk"),
    path("staff/quotas/<int:pk>/", staff.QuotaEditView.as_view(), name="staff-quota"),
    path("staff/queue/", staff.QueueView.as_view(), name="staff-queue"),
    path("staff/queue-policy/", staff.QueuePolicyView.as_view(), name="staff-queue-policy"),
    path("api/staff/v1/regions/", staff_api.RegionListApi.as_view(), name="staff-api-regions"),
    path("api/staff/v1/regions/<slug:code>/", staff_api.RegionApi.as_view(), name="staff-api-region"),
]
