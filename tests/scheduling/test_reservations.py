"""Reservations hold exactly their count of GPUs: a count that ends inside a node reserves that node
in part, and the rest of it is anyone's."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import CommandKind, GpuModel, NodeCommand
from scheduling.models import Allocation, Reservation, ReservationStatus
from scheduling.models import WorkloadState as S
from scheduling.services.lifecycle import workload_on_command_finished, workload_on_exited
from tests.scheduling.conftest import H100, reload

pytestmark = pytest.mark.django_db


def _reserve(tenant, node, count):
    now = timezone.now()
    return Reservation.objects.create(
        tenant=tenant,
        gpu_model=GpuModel.objects.get(name=H100),
        region=node.region,
        count=count,
        starts_at=now - timedelta(hours=1),
        ends_at=now + timedelta(days=1),
        status=ReservationStatus.ACTIVE,
    )


def _started(w):
    w = reload(w)
    for cmd in NodeCommand.objects.filter(
        kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk), payload__attempt=w.attempt
    ):
        workload_on_command_finished(
            kind=cmd.kind, payload=cmd.payload, node_id=cmd.node_id, state="succeeded", result={}
        )
    return reload(w)


def _gpus(w):
    return Allocation.objects.active().filter(workload=w).count()


def test_four_reserved_on_an_eight_gpu_node_leave_four_to_others(
    tenant, make_tenant, make_node, submit, cycle
):
    node = make_node(gpus=8)
    other = make_tenant("other")
    res = _reserve(tenant, node, 4)
    first = submit(other, gpu_count=4)
    cycle()
    assert reload(first).state == S.SCHEDULED and _gpus(first) == 4
    more = submit(other, gpu_count=1)
    cycle()
    more = reload(more)
    assert more.state == S.QUEUED and more.pending_reason == "capacity"
    # The owner's share is there, untouched, without preempting anyone.
    owner = submit(tenant, gpu_count=4, plan="reserved", reservation=res.pk)
    r = cycle()
    assert r.placed == [owner.pk] and r.preempted == []
    assert set(Allocation.objects.active().filter(workload=owner).values_list("plan", flat=True)) == {
        "reserved"
    }


def test_twelve_reserved_on_eight_gpu_nodes_hold_one_node_and_half_another(
    tenant, make_tenant, make_node, submit, cycle
):
    a, b = make_node(gpus=8), make_node(gpus=8)
    other = make_tenant("other")
    _reserve(tenant, a, 12)
    ws = [submit(other, gpu_count=2) for _ in range(3)]
    cycle()
    states = [reload(w).state for w in ws]
    assert states.count(S.SCHEDULED) == 2 and states.count(S.QUEUED) == 1
    # Both placed on one node (the partly reserved one), four GPUs in all.
    held = Allocation.objects.active().filter(tenant=other)
    assert held.count() == 4 and held.values("node_id").distinct().count() == 1
    assert set(held.values_list("node_id", flat=True)) == {b.pk}  # a is reserved whole


def test_lent_share_of_a_partly_reserved_node_is_taken_back(tenant, make_tenant, make_node, submit, cycle):
    node = make_node(gpus=8)
    other = make_tenant("other")
    res = _reserve(tenant, node, 4)
    on_demand = submit(other, gpu_count=4)
    borrower = submit(other, gpu_count=4, plan="spot", checkpoint_resume=True)
    cycle()
    on_demand, borrower = _started(on_demand), _started(borrower)
    assert on_demand.state == borrower.state == S.RUNNING
    owner = submit(tenant, gpu_count=4, plan="reserved", reservation=res.pk)
    r = cycle()
    assert r.preempted == [borrower.pk]  # the borrower, never the on-demand work
    workload_on_exited(node_id=node.pk, workload_id=borrower.pk, state="preempted", exit_code=None)
    r = cycle()
    assert r.placed == [owner.pk]
    assert reload(borrower).state == S.QUEUED and reload(on_demand).state == S.RUNNING
