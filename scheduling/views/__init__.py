"""The tenant's workload pages: launch, the workloads list and a workload's detail (live).

Importing this package registers the sidebar entries and the dashboard panel;
``SchedulingConfig.ready()`` imports it.
"""

from portal.dashboard import register_nav, register_panel

register_nav("launch", "Launch", "scheduling:launch", order=10, icon="cpu")
register_nav("workloads", "Workloads", "scheduling:workloads", order=12, icon="layers")
register_nav("templates", "Templates", "scheduling:templates", order=11, icon="layers")
register_nav("volumes", "Volumes", "scheduling:volumes", order=13, icon="grid")
register_nav("queue", "Queue", "scheduling:staff-queue", order=21, icon="layers", staff_only=True)
register_nav("quotas", "Quotas", "scheduling:staff-quotas", order=22, icon="settings", staff_only=True)
register_panel("workloads", "Running and pending workloads", "scheduling:panel-workloads", order=5, wide=True)
