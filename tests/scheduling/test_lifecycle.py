from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import CommandKind, Gpu, NodeCommand, NodeState, NodeWorkloadStatus
from nodes.services.health import gpu_mark_unhealthy
from nodes.signals import command_finished, node_down, workload_exited
from portal.actors import Actor
from portal.errors import Conflict
from scheduling.models import Allocation, WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.lifecycle import scheduling_reconcile, workload_stop
from scheduling.services.states import InvalidTransition, workload_transition
from tests.scheduling.conftest import reload, report_start

pytestmark = pytest.mark.django_db


def _exit(node, w, state="exited", exit_code=0, message=""):
    workload_exited.send(
        sender=type(node),
        node=node,
        workload_id=str(w.pk),
        state=state,
        exit_code=exit_code,
        finished_at=timezone.now(),
        message=message,
    )


def test_the_state_machine_refuses_what_it_does_not_know(tenant, make_node, submit):
    make_node()
    w = submit(tenant)
    with pytest.raises(InvalidTransition):
        workload_transition(workload=w, to=S.RUNNING, reason="x", actor=Actor.system())
    inst = submit(tenant, kind="instance")
    workload_transition(workload=inst, to=S.QUEUED, reason="x", actor=Actor.system())
    workload_transition(workload=inst, to=S.SCHEDULED, reason="x", actor=Actor.system())
    workload_transition(workload=inst, to=S.RUNNING, reason="x", actor=Actor.system())
    with pytest.raises(InvalidTransition):  # only jobs go back to the queue from running
        workload_transition(workload=inst, to=S.QUEUED, reason="x", actor=Actor.system())


def test_a_job_runs_and_succeeds_through_the_fleet_signals(tenant, make_node, submit, cycle):
    node = make_node()
    w = submit(tenant, gpu_count=2)
    cycle()
    report_start(w, node)
    assert reload(w).state == S.RUNNING and reload(w).started_at is not None
    _exit(node, w, exit_code=0, message="loss=0.01\ndone")
    w = reload(w)
    assert w.state == S.SUCCEEDED and w.exit_code == 0 and w.log_tail.endswith("done")
    assert not Allocation.objects.active().filter(workload=w).exists()
    assert Allocation.objects.filter(workload=w, end_reason="exited").count() == 2
    # A replayed report changes nothing.
    _exit(node, w, exit_code=0)
    assert WorkloadEvent.objects.filter(workload=w).count() == 5


def test_a_failing_job_is_retried_then_fails(tenant, make_node, submit, cycle):
    node = make_node()
    w = submit(tenant, max_retries=1)
    cycle()
    report_start(w, node)
    _exit(node, w, state="failed", exit_code=1)
    assert reload(w).state == S.QUEUED and reload(w).retries == 1
    cycle()
    report_start(w, node)
    _exit(node, w, state="failed", exit_code=1)
    assert reload(w).state == S.FAILED


def test_a_failed_start_is_placed_again(tenant, make_node, submit, cycle):
    node = make_node()
    w = submit(tenant)
    cycle()
    report_start(w, node, state="failed", result={"reason": "image pull failed"})
    w = reload(w)
    assert w.state == S.QUEUED and "image pull failed" in w.state_reason
    cycle()
    assert reload(w).state == S.SCHEDULED and reload(w).attempt == 2


def test_node_down_requeues_jobs_and_fails_instances(tenant, make_node, submit, cycle):
    node = make_node()
    job = submit(tenant, gpu_count=2)
    inst = submit(tenant, kind="instance", gpu_count=2)
    cycle()
    report_start(job, node)
    node.state, node.state_reason = NodeState.DOWN, "No heartbeat since 12:00."
    node.save()
    node_down.send(sender=type(node), node=node, last_heartbeat_at=None)
    job, inst = reload(job), reload(inst)
    assert job.state == S.QUEUED and job.state_reason == "No heartbeat since 12:00."
    assert inst.state == S.FAILED and WorkloadEvent.objects.filter(workload=inst, reason="node_down").exists()
    assert not Allocation.objects.active().exists()


def test_an_unhealthy_gpu_moves_its_job_elsewhere(
    tenant, make_node, submit, cycle, django_capture_on_commit_callbacks
):
    first = make_node(gpus=1)
    w = submit(tenant)
    cycle()
    report_start(w, first)
    second = make_node(gpus=1)
    gpu = Gpu.objects.get(node=first)
    with django_capture_on_commit_callbacks(execute=True):
        assert gpu_mark_unhealthy(gpu_id=gpu.pk, reason="XID 79: fell off the bus")
    w = reload(w)
    assert w.state == S.QUEUED and "XID 79" in w.state_reason
    assert NodeCommand.objects.filter(node=first, kind=CommandKind.STOP_WORKLOAD).exists()
    cycle()
    assert set(Allocation.objects.active().filter(workload=w).values_list("node_id", flat=True)) == {
        second.pk
    }


def test_stop_a_waiting_and_a_running_workload(tenant, make_node, submit, cycle):
    node = make_node(gpus=1)
    running = submit(tenant, kind="instance")
    waiting = submit(tenant, kind="instance")
    cycle()
    report_start(running, node)
    workload_stop(workload=waiting, actor=Actor.system())
    assert reload(waiting).state == S.STOPPED
    workload_stop(workload=running, actor=Actor.system())
    assert reload(running).state == S.STOPPING
    with pytest.raises(Conflict):
        workload_stop(workload=running, actor=Actor.system())
    stop = NodeCommand.objects.get(kind=CommandKind.STOP_WORKLOAD)
    command_finished.send(sender=NodeCommand, command=stop, state="succeeded", result={})
    assert reload(running).state == S.STOPPED
    assert not Allocation.objects.active().exists()


def test_the_reconciler_finishes_what_was_left(tenant, make_node, submit, cycle, settings):
    node = make_node(gpus=4)
    late = submit(tenant)
    starting = submit(tenant)
    preempted = submit(tenant, plan="spot")
    stuck = submit(tenant)
    cycle()
    report_start(starting, node, result={"state": "starting"})
    assert reload(starting).state == S.STARTING
    NodeWorkloadStatus.objects.create(node=node, workload_id=str(starting.pk), state="running")
    for w, state in ((preempted, S.RUNNING), (stuck, S.RUNNING)):
        workload_transition(workload=reload(w), to=state, reason="test", actor=Actor.system())
    workload_transition(workload=reload(preempted), to=S.PREEMPTED, reason="test", actor=Actor.system())
    workload_transition(workload=reload(stuck), to=S.STOPPING, reason="test", actor=Actor.system())
    later = timezone.now() + timedelta(seconds=settings.SCHEDULING_START_TIMEOUT_S + 600)
    r = scheduling_reconcile(now=later)
    assert r.start_timeouts == [late.pk] and reload(late).state == S.QUEUED
    assert r.running == [starting.pk] and reload(starting).state == S.RUNNING
    assert r.preempt_forced == [preempted.pk] and reload(preempted).state == S.QUEUED
    assert r.stop_forced == [stuck.pk] and reload(stuck).state == S.STOPPED
    assert NodeCommand.objects.filter(
        kind=CommandKind.STOP_WORKLOAD, payload__workload_id=str(late.pk)
    ).exists()
    assert scheduling_reconcile(now=later).as_dict() == {
        "start_timeouts": [],
        "running": [],
        "preempt_forced": [],
        "stop_forced": [],
        "over_runtime": [],
        "stop_confirmed": [],
        "exits_applied": [],
    }


def _nodes(w):
    return set(Allocation.objects.active().filter(workload=w).values_list("node_id", flat=True))


def test_a_workload_not_started_in_time_is_placed_on_another_node(tenant, make_node, submit, cycle, settings):
    small = make_node(gpus=2)  # the tighter fit: the engine's first choice, every time
    big = make_node(gpus=8)
    w = submit(tenant, gpu_count=2)
    cycle()
    assert _nodes(w) == {small.pk}
    # The agent on the small node never starts it.
    later = timezone.now() + timedelta(seconds=settings.SCHEDULING_START_TIMEOUT_S + 1)
    assert scheduling_reconcile(now=later).start_timeouts == [w.pk]
    w = reload(w)
    assert w.state == S.QUEUED and w.avoid_nodes == [small.pk]
    assert NodeCommand.objects.filter(node=small, kind=CommandKind.STOP_WORKLOAD).exists()
    cycle()
    w = reload(w)
    assert w.state == S.SCHEDULED and w.attempt == 2 and _nodes(w) == {big.pk}
    start = NodeCommand.objects.get(kind=CommandKind.START_WORKLOAD, payload__attempt=2)
    assert start.node_id == big.pk
    # Other work still gets the small node.
    other = submit(tenant, gpu_count=2)
    cycle()
    assert _nodes(other) == {small.pk}


def test_a_failed_start_avoids_its_node_unless_no_other_could_ever_take_it(tenant, make_node, submit, cycle):
    only = make_node(gpus=2)
    make_node(gpus=1)  # too small for the request, ever
    w = submit(tenant, gpu_count=2)
    cycle()
    report_start(w, only, state="failed", result={"reason": "image pull failed"})
    assert reload(w).avoid_nodes == [only.pk]
    cycle()
    assert reload(w).state == S.SCHEDULED and _nodes(w) == {only.pk}
