"""Scheduling listens to ``workload_running`` (STARTING -> RUNNING at once, not at the next
reconcile) and ``node_ready`` (a debounced cycle), sent by the real agent endpoints and services."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from nodes.models import Node
from nodes.services.health import node_cordon, node_uncordon
from portal.actors import Actor
from scheduling import tasks
from scheduling.models import WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.triggers import DEBOUNCE_KEY, cycle_request_clear
from tests.nodes import conftest as nodes_conftest
from tests.scheduling.conftest import reload

pytestmark = pytest.mark.django_db

# The fleet's fixtures: agents registered over HTTP that send heartbeats and reports.
region = nodes_conftest.region
make_bootstrap_token = nodes_conftest.make_bootstrap_token
register_node = nodes_conftest.register_node
agent_views_in_test_thread = nodes_conftest.agent_views_in_test_thread


def _running(w) -> list[dict]:
    return [{"workload_id": str(w.pk), "state": "running", "exit_code": None}]


def test_a_starting_workload_is_running_as_soon_as_its_node_says_so(
    tenant, register_node, submit, cycle, django_capture_on_commit_callbacks
):
    agent, other = register_node(gpus=2), register_node(gpus=2)
    Node.objects.filter(pk=other.node_id).update(state="cordoned")  # everything goes to ``agent``
    w = submit(tenant)
    cycle()
    (command,) = agent.poll().json()["commands"]
    assert command["payload"]["workload_id"] == str(w.pk)
    with django_capture_on_commit_callbacks(execute=True):
        agent.report(command["id"], "succeeded", {"state": "starting"})
    assert reload(w).state == S.STARTING
    with django_capture_on_commit_callbacks(execute=True):
        other.heartbeat(other.batch(workloads=_running(w)))  # not its node: nothing changes
    assert reload(w).state == S.STARTING
    with django_capture_on_commit_callbacks(execute=True):
        agent.heartbeat(agent.batch(workloads=_running(w)))
    w = reload(w)
    assert w.state == S.RUNNING and w.started_at is not None
    assert WorkloadEvent.objects.filter(workload=w, to_state=S.RUNNING, reason="running").count() == 1


def test_a_node_ready_again_asks_for_one_debounced_cycle(
    register_node, settings, monkeypatch, django_capture_on_commit_callbacks
):
    settings.SCHEDULING_TRIGGER_CYCLES = True
    cycle_request_clear()
    asked: list[dict] = []
    monkeypatch.setattr(tasks.run_cycle, "apply_async", lambda **kwargs: asked.append(kwargs))
    a, b = register_node(), register_node()
    node_cordon(node=a.node, actor=Actor.system())
    node_cordon(node=b.node, actor=Actor.system())
    assert asked == []
    with django_capture_on_commit_callbacks(execute=True):
        node_uncordon(node=a.node, actor=Actor.system())
        node_uncordon(node=b.node, actor=Actor.system())
    assert len(asked) == 1 and asked[0]["countdown"] == settings.SCHEDULING_CYCLE_DEBOUNCE_S
    assert asked[0]["kwargs"]["token"] == cache.get(DEBOUNCE_KEY)
    cycle_request_clear()
