"""Preemption through the services: gangs that preempt on whole nodes, ``workload_preempt`` (the
public way other apps preempt), and a replayed workload mix in which nothing is preempted twice for
the same cause."""

from __future__ import annotations

import random
from collections import Counter
from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import CommandKind, GpuModel, NodeCommand
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from scheduling.models import Allocation, Quota, Reservation, ReservationStatus, Workload, WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.lifecycle import (
    scheduling_reconcile,
    workload_on_command_finished,
    workload_on_exited,
    workload_preempt,
)
from tests.scheduling.conftest import H100, reload

pytestmark = pytest.mark.django_db


def _start_all():
    """Every placed workload's agent reports its start command succeeded."""
    for w in Workload.objects.filter(state=S.SCHEDULED):
        for cmd in NodeCommand.objects.filter(
            kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk), payload__attempt=w.attempt
        ):
            workload_on_command_finished(
                kind=cmd.kind, payload=cmd.payload, node_id=cmd.node_id, state="succeeded", result={}
            )


def _stopped_after_notice(w):
    """The agent reports the preempted workload gone (on each of its nodes)."""
    for node_id in set(Allocation.objects.active().filter(workload=w).values_list("node_id", flat=True)):
        workload_on_exited(node_id=node_id, workload_id=w.pk, state="preempted", exit_code=None)


def _nodes(w):
    return set(Allocation.objects.active().filter(workload=w).values_list("node_id", flat=True))


# -- gangs ------------------------------------------------------------------------------------------


def test_a_gang_preempts_spot_work_on_enough_whole_nodes(tenant, make_tenant, make_node, submit, cycle):
    a, b = make_node(gpus=8), make_node(gpus=8)
    other = make_tenant("other")
    spots = [submit(other, gpu_count=8, plan="spot", checkpoint_resume=True) for _ in range(2)]
    cycle()
    _start_all()
    gang = submit(tenant, gpu_count=16, gang=True)
    r = cycle()
    assert sorted(r.preempted) == sorted(s.pk for s in spots)
    assert set(
        NodeCommand.objects.filter(kind=CommandKind.PREEMPT_WORKLOAD).values_list("node_id", flat=True)
    ) == {a.pk, b.pk}
    assert reload(gang).pending_reason == "preempting"
    assert cycle().preempted == []  # nothing more while the victims stop
    for s in spots:
        _stopped_after_notice(s)
    r = cycle()
    assert r.placed == [gang.pk] and _nodes(gang) == {a.pk, b.pk}
    assert Allocation.objects.active().filter(workload=gang).count() == 16
    assert {reload(s).state for s in spots} == {S.QUEUED}


def test_a_gang_preempts_nothing_unless_it_can_have_every_node(tenant, make_tenant, make_node, submit, cycle):
    make_node(gpus=8), make_node(gpus=8)
    other = make_tenant("other")
    spot = submit(other, gpu_count=8, plan="spot")
    on_demand = submit(other, gpu_count=8)
    cycle()
    _start_all()
    gang = submit(tenant, gpu_count=16, gang=True)
    r = cycle()
    assert r.preempted == [] and r.placed == []
    assert reload(spot).state == reload(on_demand).state == S.RUNNING
    assert reload(gang).pending_reason == "gang"


# -- workload_preempt ---------------------------------------------------------------------------------


def test_workload_preempt_requeues_a_job_that_resumes_from_its_checkpoint(tenant, make_node, submit, cycle):
    node = make_node(gpus=2)
    job = submit(tenant, gpu_count=2, plan="spot", checkpoint_resume=True)
    cycle()
    _start_all()
    workload_preempt(workload=job, reason="spot_price", notice_s=10)
    job = reload(job)
    assert job.state == S.PREEMPTED and job.preempted_for is None
    ev = WorkloadEvent.objects.get(workload=job, to_state=S.PREEMPTED)
    assert ev.reason == "spot_price" and ev.data == {"cause": "spot_price", "notice_s": 10}
    assert "stopping in 10 s" in ev.message
    cmd = NodeCommand.objects.get(kind=CommandKind.PREEMPT_WORKLOAD)
    assert cmd.node_id == node.pk and cmd.payload == {"workload_id": str(job.pk), "notice_s": 10}
    _stopped_after_notice(job)
    job = reload(job)
    assert job.state == S.QUEUED and "checkpoint" in job.state_reason
    cycle()
    first = NodeCommand.objects.get(kind=CommandKind.START_WORKLOAD, payload__attempt=1)
    start = NodeCommand.objects.get(kind=CommandKind.START_WORKLOAD, payload__attempt=2)
    (mount,) = job.volume_mounts.all()
    volume = {"volume_id": str(mount.volume_id), "mount_path": "/ckpt", "size_gib": 10}
    assert first.payload["volumes"] == start.payload["volumes"] == [volume]
    assert first.payload["checkpoint"] == {"volume_id": str(mount.volume_id), "resume": False}
    assert start.payload["checkpoint"] == {"volume_id": str(mount.volume_id), "resume": True}
    placed = WorkloadEvent.objects.filter(workload=job, to_state=S.SCHEDULED).order_by("at", "id")
    assert ["resumes from its checkpoint" in e.message for e in placed] == [False, True]


def test_workload_preempt_stops_an_instance_and_uses_the_plans_notice(tenant, make_node, submit, cycle):
    make_node(gpus=1)
    inst = submit(tenant, kind="instance", plan="spot")
    cycle()
    _start_all()
    workload_preempt(workload=inst, reason="spot_price")
    cmd = NodeCommand.objects.get(kind=CommandKind.PREEMPT_WORKLOAD)
    assert cmd.payload["notice_s"] == 30  # the spot plan's default
    _stopped_after_notice(inst)
    assert reload(inst).state == S.STOPPED and not _nodes(inst)


def test_a_preempted_workload_that_never_reports_is_finished_after_its_own_notice(
    tenant, make_node, submit, cycle, settings
):
    make_node(gpus=1)
    job = submit(tenant, plan="spot")
    cycle()
    _start_all()
    workload_preempt(workload=job, reason="spot_price", notice_s=600)
    grace = settings.SCHEDULING_STOP_GRACE_S + settings.SCHEDULING_REPORT_GRACE_S
    soon = timezone.now() + timedelta(seconds=30 + grace + 5)  # past the plan's notice, not this one
    assert scheduling_reconcile(now=soon).preempt_forced == []
    later = timezone.now() + timedelta(seconds=600 + grace + 5)
    assert scheduling_reconcile(now=later).preempt_forced == [job.pk]
    assert reload(job).state == S.QUEUED


def test_workload_preempt_refuses_bad_input_and_writes_nothing(tenant, make_node, submit, cycle):
    make_node(gpus=1)
    job = submit(tenant, plan="spot")
    cycle()
    _start_all()
    waiting = submit(tenant, gpu_count=1)
    events = WorkloadEvent.objects.count()
    for kwargs, field in (
        ({"reason": ""}, "reason"),
        ({"reason": "x" * 65}, "reason"),
        ({"reason": "spot_price", "notice_s": -1}, "notice_s"),
        ({"reason": "spot_price", "notice_s": 1.5}, "notice_s"),
        ({"reason": "spot_price", "notice_s": True}, "notice_s"),
    ):
        with pytest.raises(ValidationFailed) as e:
            workload_preempt(workload=job, **kwargs)
        assert set(e.value.fields) == {field}
    with pytest.raises(Conflict):
        workload_preempt(workload=waiting, reason="spot_price")  # not placed
    assert WorkloadEvent.objects.count() == events
    assert reload(job).state == S.RUNNING and not NodeCommand.objects.filter(
        kind=CommandKind.PREEMPT_WORKLOAD
    )
    # A person who preempts is in the audit log.
    from portal.models import AuditEvent, User

    user = User.objects.create_user(email="ops@example.com", password="pw-for-tests-1")
    workload_preempt(workload=job, reason="maintenance", actor=Actor(user=user))
    assert AuditEvent.objects.filter(action="job.preempt").count() == 1


# -- no preemption loops ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_replayed_mix_never_preempts_a_workload_twice_for_the_same_cause(
    seed, tenant, make_tenant, make_node, submit, cycle
):
    """Three 4-GPU nodes, a reservation of 6 GPUs (one node and half of another) whose owner comes
    and goes, on-demand and spot work (jobs that requeue from checkpoints, instances, a gang now and
    then) arriving, running, finishing and being preempted, over many cycles. The cause of a
    preemption is the workload it made room for, and for a reservation owner's work also its
    reservation: no workload is preempted twice by the same one."""
    rng = random.Random(seed)
    nodes = [make_node(gpus=4) for _ in range(3)]
    owner, spot_user, od_user = tenant, make_tenant("spotty"), make_tenant("steady")
    for t in (owner, spot_user, od_user):
        Quota.objects.update_or_create(
            tenant=t, defaults={"max_gpus_total": None, "max_concurrent_workloads": None}
        )
    now = timezone.now()
    res = Reservation.objects.create(
        tenant=owner,
        gpu_model=GpuModel.objects.get(name=H100),
        region=nodes[0].region,
        count=6,
        starts_at=now - timedelta(hours=1),
        ends_at=now + timedelta(days=1),
        status=ReservationStatus.ACTIVE,
    )
    for step in range(40):
        if rng.random() < 0.7:
            submit(spot_user, gpu_count=rng.choice([1, 2, 4]), plan="spot", checkpoint_resume=True)
        if rng.random() < 0.2:
            submit(spot_user, kind="instance", gpu_count=rng.choice([1, 2]), plan="spot")
        if rng.random() < 0.4:
            submit(od_user, gpu_count=rng.choice([1, 2]), estimated_runtime_s=rng.choice([600, 3600]))
        if step % 6 == 0:
            submit(od_user, gpu_count=8, gang=True)
        if rng.random() < 0.35:
            submit(owner, gpu_count=rng.choice([1, 2, 3]), plan="reserved", reservation=res.pk)
        cycle()
        _start_all()
        # Agents: preempted work stops (most at once, some a cycle later); running work ends.
        for w in Workload.objects.filter(state=S.PREEMPTED):
            if rng.random() < 0.7:
                _stopped_after_notice(w)
        for w in Workload.objects.filter(state=S.RUNNING):
            if rng.random() < 0.15:
                for node_id in _nodes(w):
                    workload_on_exited(node_id=node_id, workload_id=w.pk, state="exited", exit_code=0)
                    break
    preemptions = list(
        WorkloadEvent.objects.filter(to_state=S.PREEMPTED).values_list("workload_id", "data", "reason")
    )
    assert len(preemptions) >= 3, "the mix must make the scheduler preempt"
    by_workload = Counter((wid, data["preempted_for"]) for wid, data, _ in preemptions)
    assert max(by_workload.values()) == 1, [k for k, n in by_workload.items() if n > 1]
    by_reservation = Counter(
        (wid, data["reservation"]) for wid, data, _ in preemptions if "reservation" in data
    )
    assert not by_reservation or max(by_reservation.values()) == 1, by_reservation
