from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import CommandKind, GpuModel, NodeCommand
from nodes.services.commands import node_command_report
from scheduling.models import Allocation, WarmPool, WarmSlot, Workload, WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.warm_pools import warm_pool_target_update, warm_pools_reconcile
from tests.scheduling.conftest import H100, reload

pytestmark = pytest.mark.django_db

IMAGE = "ghcr.io/acme/notebook:1"


def _prewarm_done(node, status="succeeded"):
    for cmd in NodeCommand.objects.filter(node=node, kind=CommandKind.PREWARM, finished_at__isnull=True):
        node_command_report(node_id=node.pk, command_id=cmd.pk, status=status, message="pull failed")


@pytest.fixture
def pool(regions):
    return WarmPool.objects.create(
        gpu_model=GpuModel.objects.get(name=H100),
        region=regions["us"],
        image=IMAGE,
        min_size=2,
        max_size=6,
        cold_start_s=300,
    )


def test_the_target_follows_demand_within_min_and_max(pool, tenant, make_node, submit):
    make_node()
    t0 = timezone.now()
    warm_pool_target_update(pool=pool, now=t0)
    assert pool.target_size == 2  # no demand yet: the minimum
    for _ in range(6):
        submit(tenant, kind="instance", image=IMAGE, gpu_count=1)
    Workload.objects.update(submitted_at=t0 + timedelta(seconds=30))
    warm_pool_target_update(pool=pool, now=t0 + timedelta(seconds=60))
    # 6 GPUs in 60 s, weighted by 1 - exp(-60/900): about 0.0065 GPU/s x 300 s = 1.9, so 2.
    assert pool.arrival_rate_per_s == pytest.approx(0.1 * (1 - 2.718281828 ** (-60 / 900)), rel=1e-3)
    first = pool.target_size
    burst = [submit(tenant, kind="instance", image=IMAGE, gpu_count=1).pk for _ in range(20)]
    Workload.objects.filter(pk__in=burst).update(submitted_at=t0 + timedelta(seconds=90))
    warm_pool_target_update(pool=pool, now=t0 + timedelta(seconds=120))
    # 20 GPUs in the next 60 s: about 0.0275 GPU/s x 300 s = 8.3, held to the maximum of 6.
    assert first == 2 and pool.target_size == pool.max_size == 6
    # No demand for hours: back to the minimum.
    warm_pool_target_update(pool=pool, now=t0 + timedelta(hours=5))
    assert pool.target_size == pool.min_size


def test_free_gpus_are_prewarmed_up_to_the_target_and_never_busy_ones(pool, tenant, make_node, submit, cycle):
    busy_node = make_node(gpus=2)
    submit(tenant, gpu_count=2)
    cycle()
    other = make_node(gpus=4)
    r = warm_pools_reconcile()
    assert r.ran and r.targets == {pool.pk: 2} and r.prewarmed == 2
    slots = WarmSlot.objects.filter(ended_at__isnull=True)
    assert {s.node_id for s in slots} == {other.pk}
    cmd = NodeCommand.objects.get(kind=CommandKind.PREWARM)
    assert cmd.node_id == other.pk and cmd.payload["image"] == IMAGE and len(cmd.payload["gpu_uuids"]) == 2
    assert warm_pools_reconcile().prewarmed == 0  # already at target
    assert not Allocation.objects.active().filter(node=other).exists()
    assert busy_node.pk not in {s.node_id for s in slots}


def test_a_matching_request_binds_to_a_warm_slot_at_once(
    pool, tenant, make_node, submit, cycle, django_capture_on_commit_callbacks
):
    make_node(gpus=8)
    warm_node = make_node(gpus=2)
    # Put the slots on the small node: prewarm there only (the big node is busy for now).
    blocker = submit(tenant, gpu_count=8)
    cycle()
    warm_pools_reconcile()
    assert set(WarmSlot.objects.values_list("node_id", flat=True)) == {warm_node.pk}
    with django_capture_on_commit_callbacks(execute=True):
        _prewarm_done(warm_node)
    hit = submit(tenant, kind="instance", image=IMAGE, gpu_count=2)
    r = cycle()
    assert r.placed == [hit.pk]
    assert set(Allocation.objects.filter(workload=hit).values_list("node_id", flat=True)) == {warm_node.pk}
    assert WorkloadEvent.objects.get(workload=hit, to_state=S.SCHEDULED).reason == "warm_hit"
    assert set(WarmSlot.objects.values_list("end_reason", flat=True)) == {"bound"}
    assert reload(blocker).state == S.SCHEDULED


def test_real_demand_takes_a_warm_gpu_and_the_slot_moves(pool, tenant, make_node, submit, cycle):
    first = make_node(gpus=2)
    warm_pools_reconcile()
    assert set(WarmSlot.objects.values_list("node_id", flat=True)) == {first.pk}
    other = submit(tenant, image="ghcr.io/acme/other:2", gpu_count=2)  # not the pool's image
    cycle()
    assert reload(other).state == S.SCHEDULED  # warm GPUs never keep real work waiting
    second = make_node(gpus=2)
    r = warm_pools_reconcile()
    assert r.ended == 2 and r.prewarmed == 2
    assert set(WarmSlot.objects.filter(ended_at__isnull=True).values_list("node_id", flat=True)) == {
        second.pk
    }
    assert set(WarmSlot.objects.filter(ended_at__isnull=False).values_list("end_reason", flat=True)) == {
        "taken"
    }


def _ready(slot_ids=None):
    qs = WarmSlot.objects.filter(ended_at__isnull=True)
    return {s.pk: s.ready_at is not None for s in (qs if slot_ids is None else qs.filter(pk__in=slot_ids))}


def test_slots_are_ready_when_the_agent_reports_the_prewarm(
    pool, make_node, django_capture_on_commit_callbacks
):
    node = make_node(gpus=2)
    warm_pools_reconcile()
    assert set(_ready().values()) == {False}
    with django_capture_on_commit_callbacks(execute=True):
        _prewarm_done(node)
    assert set(_ready().values()) == {True} and len(_ready()) == 2
    first = set(WarmSlot.objects.values_list("ready_at", flat=True))
    # A replayed report changes nothing.
    cmd = NodeCommand.objects.get(kind=CommandKind.PREWARM)
    with django_capture_on_commit_callbacks(execute=True):
        node_command_report(node_id=node.pk, command_id=cmd.pk, status="succeeded")
    assert set(WarmSlot.objects.values_list("ready_at", flat=True)) == first


def test_a_failed_prewarm_ends_its_slots_and_other_gpus_are_prewarmed(
    pool, make_node, django_capture_on_commit_callbacks
):
    bad = make_node(gpus=2)
    good = make_node(gpus=2)
    warm_pools_reconcile()
    assert set(WarmSlot.objects.values_list("node_id", flat=True)) == {bad.pk}
    with django_capture_on_commit_callbacks(execute=True):
        _prewarm_done(bad, status="failed")
    assert set(WarmSlot.objects.values_list("end_reason", flat=True)) == {"prewarm_failed"}
    r = warm_pools_reconcile()
    assert r.prewarmed == 2
    assert set(WarmSlot.objects.filter(ended_at__isnull=True).values_list("node_id", flat=True)) == {good.pk}


def test_a_lost_report_is_settled_by_the_reconciler(pool, make_node):
    node = make_node(gpus=2)
    warm_pools_reconcile()
    _prewarm_done(node)  # the signal is never sent: no commit here
    assert set(_ready().values()) == {False}
    warm_pools_reconcile()
    assert set(_ready().values()) == {True}


def test_ready_slots_bind_first_and_a_prewarming_bind_says_so(
    pool, tenant, make_node, submit, cycle, django_capture_on_commit_callbacks
):
    first, second = make_node(gpus=1), make_node(gpus=1)
    warm_pools_reconcile()
    assert set(WarmSlot.objects.values_list("node_id", flat=True)) == {first.pk, second.pk}
    with django_capture_on_commit_callbacks(execute=True):
        _prewarm_done(second)  # only the second node's slot is ready
    a = submit(tenant, kind="instance", image=IMAGE)
    cycle()
    assert set(Allocation.objects.filter(workload=a).values_list("node_id", flat=True)) == {second.pk}
    ev = WorkloadEvent.objects.get(workload=a, to_state=S.SCHEDULED)
    assert ev.reason == "warm_hit" and "prewarmed" in ev.message
    b = submit(tenant, kind="instance", image=IMAGE)
    cycle()
    assert set(Allocation.objects.filter(workload=b).values_list("node_id", flat=True)) == {first.pk}
    ev = WorkloadEvent.objects.get(workload=b, to_state=S.SCHEDULED)
    assert ev.reason == "warm_hit_prewarming" and "still prewarming" in ev.message
