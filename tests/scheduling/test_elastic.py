"""Elastic jobs through the services and a real cycle: submission rules, growth into idle GPUs,
shrinking before preemption, the tenant's resize, and the commands their node is sent."""

from __future__ import annotations

import pytest

from nodes.models import CommandKind, NodeCommand
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from scheduling.models import Allocation, Quota, Workload
from scheduling.models import WorkloadState as S
from scheduling.services.elastic import workload_resize
from scheduling.services.lifecycle import workload_on_command_finished
from tests.scheduling.conftest import reload

pytestmark = pytest.mark.django_db


def _start_all():
    for w in Workload.objects.filter(state=S.SCHEDULED):
        for cmd in NodeCommand.objects.filter(
            kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk), payload__attempt=w.attempt
        ):
            workload_on_command_finished(
                kind=cmd.kind, payload=cmd.payload, node_id=cmd.node_id, state="succeeded", result={}
            )


def _held(w) -> list[int]:
    return sorted(Allocation.objects.active().filter(workload=w).values_list("gpu__index", flat=True))


def _resizes(w) -> list[dict]:
    return [
        c.payload
        for c in NodeCommand.objects.filter(
            kind=CommandKind.RESIZE_WORKLOAD, payload__workload_id=str(w.pk)
        ).order_by("created_at")
    ]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"elastic": {"min_gpus": 0, "max_gpus": 4}}, "elastic"),
        ({"elastic": {"min_gpus": 4, "max_gpus": 2}}, "elastic"),
        ({"elastic": {"min_gpus": 2, "max_gpus": 9}}, "elastic"),
        ({"elastic": {"min_gpus": 2}}, "elastic"),
        ({"elastic": {"min_gpus": 2, "max_gpus": 4, "on_resize": "reboot"}}, "elastic"),
        ({"elastic": {"min_gpus": 2, "max_gpus": 4, "extra": 1}}, "elastic"),
        ({"elastic": [2, 4]}, "elastic"),
        ({"elastic": {"min_gpus": "2", "max_gpus": 4}}, "elastic"),
        ({"elastic": {"min_gpus": 2, "max_gpus": 4}, "gpu_count": 6}, "gpu_count"),
        ({"elastic": {"min_gpus": 1, "max_gpus": 4}, "gpu_fraction_milli": 500}, "elastic"),
        ({"elastic": {"min_gpus": 8, "max_gpus": 8}, "gpu_count": 16, "gang": True}, "elastic"),
        ({"elastic": {"min_gpus": 1, "max_gpus": 2}, "array": {"count": 3}}, "elastic"),
        ({"elastic": {"min_gpus": 1, "max_gpus": 2}, "env": {"WORLD_SIZE": "9"}}, "env"),
    ],
)
def test_elastic_specs_that_make_no_sense_are_refused_naming_the_field(
    tenant, make_node, submit, spec, field
):
    make_node(gpus=8)
    with pytest.raises(ValidationFailed) as exc:
        submit(tenant, **spec)
    assert field in exc.value.fields or exc.value.message.startswith(field), exc.value.fields
    assert not Workload.objects.exists()


def test_instances_are_not_elastic(tenant, make_node, submit):
    make_node(gpus=8)
    with pytest.raises(ValidationFailed) as exc:
        submit(tenant, kind="instance", elastic={"min_gpus": 1, "max_gpus": 2})
    assert "elastic" in exc.value.fields


def test_max_above_the_per_request_quota_is_refused(tenant, make_node, submit):
    make_node(gpus=8)
    Quota.objects.update_or_create(tenant=tenant, defaults={"max_gpus_per_request": 4})
    with pytest.raises(Exception) as exc:
        submit(tenant, elastic={"min_gpus": 2, "max_gpus": 8})
    assert "max_gpus_per_request" in str(exc.value)


def test_starts_at_min_then_grows_into_idle_gpus_of_its_node(tenant, make_node, submit, cycle):
    node = make_node(gpus=8)
    job = submit(tenant, elastic={"min_gpus": 2, "max_gpus": 6})
    assert job.gpu_count == 2 and job.elastic_target_gpus == 6
    cycle()
    assert len(_held(job)) == 2
    _start_all()
    assert reload(job).state == S.RUNNING
    result = cycle()
    assert result.resized == [job.pk]
    assert len(_held(job)) == 6 and reload(job).gpu_count == 6
    (cmd,) = _resizes(job)
    assert cmd["world_size"] == 6 and cmd["on_resize"] == "signal" and len(cmd["gpu_uuids"]) == 6
    assert NodeCommand.objects.filter(kind=CommandKind.RESIZE_WORKLOAD, node=node).count() == 1
    # The grown GPUs are rows of their own, marked for billing.
    assert Allocation.objects.active().filter(workload=job, resized=True).count() == 4
    cycle()  # at its target: nothing more
    assert len(_resizes(job)) == 1


def test_shrinks_toward_min_before_preempting_anyone(tenant, make_tenant, make_node, submit, cycle):
    make_node(gpus=8)
    other = make_tenant("other")
    spot = submit(other, gpu_count=1, plan="spot")
    job = submit(tenant, gpu_count=7, elastic={"min_gpus": 2, "max_gpus": 8})
    cycle()
    _start_all()
    assert len(_held(job)) == 7 and len(_held(spot)) == 1
    later = submit(other, gpu_count=4)
    cycle()
    # The elastic job gave four GPUs; the spot job (which it could have preempted) still runs.
    assert len(_held(job)) == 3
    assert reload(later).state == S.SCHEDULED and len(_held(later)) == 4
    assert reload(spot).state == S.RUNNING
    assert not set(_held(job)) & set(_held(later))
    assert _resizes(job)[-1]["world_size"] == 3
    ended = Allocation.objects.filter(workload=job, end_reason="resized")
    assert ended.count() == 4


def test_below_min_preemption_decides_as_before(tenant, make_tenant, make_node, submit, cycle):
    make_node(gpus=8)
    other = make_tenant("other")
    spot = submit(other, gpu_count=3, plan="spot")
    job = submit(tenant, gpu_count=5, elastic={"min_gpus": 4, "max_gpus": 5})
    cycle()
    _start_all()
    later = submit(other, gpu_count=3)
    cycle()
    # One GPU above the minimum is not enough: the job keeps 5 and the spot job is preempted.
    assert len(_held(job)) == 5 and _resizes(job) == []
    assert reload(spot).preempted_for_id == later.pk


def test_tenant_resize_shrinks_at_once_and_grows_at_the_next_cycle(
    tenant, make_tenant, make_node, submit, cycle
):
    make_node(gpus=8)
    job = submit(tenant, gpu_count=4, elastic={"min_gpus": 2, "max_gpus": 8})
    with pytest.raises(Conflict):  # not running yet
        workload_resize(workload=job, gpu_count=2, actor=Actor.system())
    cycle()
    _start_all()
    cycle()  # grows to 8
    assert len(_held(job)) == 8
    job = reload(job)
    workload_resize(workload=job, gpu_count=3, actor=Actor.system())
    assert len(_held(job)) == 3 and reload(job).elastic_target_gpus == 3
    assert _resizes(job)[-1]["reason"] == "tenant"
    cycle()  # the target is 3 now: no growth back
    assert len(_held(job)) == 3
    workload_resize(workload=reload(job), gpu_count=5, actor=Actor.system())
    assert len(_held(job)) == 3
    cycle()
    assert len(_held(job)) == 5
    for bad in (1, 9, "4", True):
        with pytest.raises(ValidationFailed) as exc:
            workload_resize(workload=reload(job), gpu_count=bad, actor=Actor.system())
        assert "gpu_count" in exc.value.fields


def test_a_plain_job_cannot_be_resized(tenant, make_node, submit, cycle):
    make_node(gpus=8)
    job = submit(tenant, gpu_count=2)
    cycle()
    _start_all()
    with pytest.raises(Conflict):
        workload_resize(workload=reload(job), gpu_count=3, actor=Actor.system())


def test_several_placements_on_its_borrowed_gpus_make_one_resize(
    tenant, make_tenant, make_node, submit, cycle
):
    node = make_node(gpus=8)
    job = submit(tenant, elastic={"min_gpus": 2, "max_gpus": 8, "on_resize": "restart"})
    cycle()
    _start_all()
    cycle()
    assert len(_held(job)) == 8 and len(_resizes(job)) == 1
    other = make_tenant("other")
    small = [submit(other, gpu_count=1) for _ in range(3)]
    result = cycle()
    # Three placements took three borrowed GPUs: one command to the node (with "restart", each
    # command is a restart of the job), its final size.
    assert all(reload(w).state == S.SCHEDULED for w in small)
    assert result.resized == [job.pk] and len(_held(job)) == 5
    assert [c["world_size"] for c in _resizes(job)] == [8, 5]
    assert NodeCommand.objects.filter(kind=CommandKind.RESIZE_WORKLOAD, node=node).count() == 2
