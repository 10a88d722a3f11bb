"""``workload_running`` and ``node_ready``: sent once, after commit, from heartbeats and staff actions."""

from __future__ import annotations

from datetime import UTC, datetime

from nodes.models import Node, NodeState
from nodes.services.health import node_cordon, node_set_maintenance, node_uncordon
from nodes.signals import node_ready, workload_running
from portal.actors import Actor
from tests.nodes.conftest import iso


def test_workload_running_is_sent_once_when_a_workload_starts_running(
    agent, capture_signal, django_capture_on_commit_callbacks
):
    started = datetime.now(UTC).replace(microsecond=0)
    starting = [{"workload_id": "77", "state": "starting", "exit_code": None}]
    running = [{"workload_id": "77", "state": "running", "exit_code": None, "started_at": iso(started)}]
    with capture_signal(workload_running) as calls, django_capture_on_commit_callbacks(execute=True):
        agent.heartbeat(agent.batch(workloads=starting))
        assert calls == []
        agent.heartbeat(agent.batch(workloads=running))
        agent.heartbeat(agent.batch(workloads=running))  # reported again: no second signal
    assert len(calls) == 1
    call = calls[0]
    assert call["sender"] is Node and call["node"].pk == agent.node_id
    assert call["workload_id"] == "77" and call["started_at"] == started


def test_workload_running_is_not_sent_before_commit(
    agent, capture_signal, django_capture_on_commit_callbacks
):
    running = [{"workload_id": "78", "state": "running", "exit_code": None}]
    with (
        capture_signal(workload_running) as calls,
        django_capture_on_commit_callbacks(execute=False) as hooks,
    ):
        agent.heartbeat(agent.batch(workloads=running))
        assert calls == []
    assert hooks  # sent by a commit hook


def test_node_ready_when_heartbeats_resume_after_down(
    agent, capture_signal, django_capture_on_commit_callbacks
):
    Node.objects.filter(pk=agent.node_id).update(state=NodeState.DOWN, resume_state="")
    with capture_signal(node_ready) as calls, django_capture_on_commit_callbacks(execute=True):
        agent.heartbeat(agent.batch())
        agent.heartbeat(agent.batch())  # already READY: nothing more
    assert [c["node"].pk for c in calls] == [agent.node_id]
    assert calls[0]["node"].state == NodeState.READY


def test_no_node_ready_when_a_suspect_node_returns_to_cordoned(
    agent, capture_signal, django_capture_on_commit_callbacks
):
    Node.objects.filter(pk=agent.node_id).update(state=NodeState.SUSPECT, resume_state=NodeState.CORDONED)
    with capture_signal(node_ready) as calls, django_capture_on_commit_callbacks(execute=True):
        agent.heartbeat(agent.batch())
    assert calls == [] and agent.node.state == NodeState.CORDONED


def test_node_ready_when_staff_uncordon_and_not_otherwise(
    agent, capture_signal, django_capture_on_commit_callbacks
):
    staff = Actor.system()
    with capture_signal(node_ready) as calls, django_capture_on_commit_callbacks(execute=True):
        node_cordon(node=agent.node, actor=staff)
        assert calls == []
        node_uncordon(node=agent.node, actor=staff)
        node_uncordon(node=agent.node, actor=staff)  # already READY: no change, no signal
        node_set_maintenance(node=agent.node, actor=staff, reason="PSU swap")
        node_uncordon(node=agent.node, actor=staff)
    assert [c["node"].pk for c in calls] == [agent.node_id, agent.node_id]
    assert all(c["node"].state == NodeState.READY for c in calls)
