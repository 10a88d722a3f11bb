"""``/agent/v1/``: the node agent protocol (nodes/PROTOCOL.md). Mounted by the project URLconf."""

from django.urls import path

from nodes import agent_ssh, agent_views

app_name = "agent"

urlpatterns = [
    path("register", agent_views.register, name="register"),
    path("nodes/<int:node_id>/heartbeat", agent_views.heartbeat, name="heartbeat"),
    path("nodes/<int:node_id>/commands", agent_views.commands, name="commands"),
    path(
        "nodes/<int:node_id>/commands/<str:command_id>/report",
        agent_views.command_report,
        name="command-report",
    ),
    path("nodes/<int:node_id>/logs", agent_views.logs, name="logs"),
    path("nodes/<int:node_id>/ssh-endpoint", agent_ssh.ssh_endpoint, name="ssh-endpoint"),
    path(
        "nodes/<int:node_id>/workloads/<str:workload_id>/ssh-keys",
        agent_ssh.workload_ssh_keys,
        name="workload-ssh-keys",
    ),
]
