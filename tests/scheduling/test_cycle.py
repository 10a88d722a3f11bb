from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from nodes.models import CommandKind, Gpu, GpuModel, Node, NodeCommand, NodeState
from scheduling.models import Allocation, Reservation, ReservationStatus, Workload, WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.allocations import gpu_range_choose
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.lifecycle import workload_on_command_finished, workload_on_exited
from tests.scheduling.conftest import H100, reload

pytestmark = pytest.mark.django_db


def _started(w, node):
    cmd = NodeCommand.objects.get(node=node, kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk))
    workload_on_command_finished(
        kind=cmd.kind, payload=cmd.payload, node_id=node.pk, state="succeeded", result={"state": "running"}
    )
    return reload(w)


def test_a_cycle_places_writes_allocations_and_sends_start_commands(tenant, make_node, submit, cycle):
    node = make_node()
    a = submit(tenant, gpu_count=4, cpu_millicores=16000, ram_mib=65536)
    b = submit(tenant, gpu_count=2)
    r = cycle()
    assert sorted(r.placed) == [a.pk, b.pk]
    a = reload(a)
    assert a.state == S.SCHEDULED and a.attempt == 1
    assert [e.to_state for e in WorkloadEvent.objects.filter(workload=a)] == [
        S.PENDING,
        S.QUEUED,
        S.SCHEDULED,
    ]
    allocs = Allocation.objects.filter(workload=a, ended_at__isnull=True)
    assert allocs.count() == 4 and {x.node_id for x in allocs} == {node.pk}
    assert all(x.fraction_milli == 1000 and x.plan == "on_demand" for x in allocs)
    cmd = NodeCommand.objects.get(node=node, payload__workload_id=str(a.pk))
    assert cmd.kind == CommandKind.START_WORKLOAD
    uuids = set(Gpu.objects.filter(pk__in=[x.gpu_id for x in allocs]).values_list("uuid", flat=True))
    assert set(cmd.payload["gpu_uuids"]) == uuids
    assert cmd.payload["cpu_millicores"] == 16000 and cmd.payload["image"] == a.image
    assert cmd.idempotency_key == f"start:{a.pk}:1"
    # Nothing double-booked: the two workloads hold six different GPUs.
    assert Allocation.objects.active().values("gpu_id").distinct().count() == 6
    # A second cycle changes nothing.
    assert cycle().placed == []
    assert NodeCommand.objects.count() == 2


def test_the_snapshot_costs_a_fixed_number_of_queries(tenant, make_node, submit, cycle):
    for _ in range(3):
        make_node()
    for _ in range(3):
        submit(tenant, gpu_count=8, plan="spot")
    cycle()
    counts = []
    for n in (2, 12):
        for _ in range(n):
            submit(tenant, gpu_count=1)
        Workload.objects.filter(state=S.PENDING).update(state=S.QUEUED)
        with CaptureQueriesContext(connection) as q:
            cycle()
        counts.append(len([x for x in q.captured_queries if x["sql"].lstrip().upper().startswith("SELECT")]))
    # Reads do not grow with the queue (writes are per placement); a little slack for savepoints.
    assert counts[1] <= counts[0] + 2 * 10, counts


def test_the_snapshots_statements_do_not_grow_with_the_fleet(make_node):
    """The same statements at one node and at four (the GPUs are read by the nodes' filter, not by a
    list of their ids), so that PostgreSQL prepares and plans them once."""
    from django.db import transaction
    from django.utils import timezone as tz

    from scheduling.services.snapshot import cycle_snapshot_load

    statements, now = [], tz.now()
    for count in (1, 3):
        for _ in range(count):
            make_node()
        make_node(state="down")  # not schedulable: neither it nor its GPUs are in the snapshot
        with transaction.atomic(), CaptureQueriesContext(connection) as q:
            snapshot, _, _ = cycle_snapshot_load(now)
        assert sum(len(n.gpus) for n in snapshot.nodes) == 8 * len(snapshot.nodes)
        statements.append([x["sql"] for x in q.captured_queries])
    assert len(snapshot.nodes) == 4
    assert statements[0] == statements[1]


def test_running_work_keeps_its_gpu_indices_on_nodes_outside_the_snapshot(tenant, make_node, submit, cycle):
    """Allocations take their GPU's index from the GPUs the snapshot read; work on a node that is no
    longer schedulable (its GPUs are not read) is still placed on the right indices."""
    from scheduling.services.snapshot import cycle_snapshot_load

    make_node(gpus=4)
    make_node(gpus=4)
    first = submit(tenant, gpu_count=4)
    second = submit(tenant, gpu_count=2)
    cycle()
    expected, nodes = {}, {}
    for w in (first, second):
        rows = list(Allocation.objects.active().filter(workload=w).select_related("gpu"))
        nodes[w.pk] = rows[0].node
        expected[str(w.pk)] = (str(rows[0].node_id), tuple(sorted(a.gpu.index for a in rows)))
        _started(reload(w), rows[0].node)
    assert nodes[first.pk] != nodes[second.pk]
    Node.objects.filter(pk=nodes[first.pk].pk).update(state=NodeState.DRAINING)
    with transaction.atomic():
        snapshot, _, _ = cycle_snapshot_load(timezone.now())
    assert {r.id: (r.node_id, r.gpu_indices) for r in snapshot.running} == expected
    assert [n.id for n in snapshot.nodes] == [str(nodes[second.pk].pk)]


def test_shared_gpus_never_pass_1000_milli(tenant, make_node, submit, cycle):
    node = make_node(gpus=1)
    ws = [submit(tenant, gpu_fraction_milli=400) for _ in range(3)]
    cycle()
    states = [reload(w).state for w in ws]
    assert states.count(S.SCHEDULED) == 2
    waiting = reload(ws[states.index(S.QUEUED)])
    assert waiting.pending_reason == "capacity"
    gpu = Gpu.objects.get(node=node)
    assert sum(Allocation.objects.active().filter(gpu=gpu).values_list("fraction_milli", flat=True)) == 800


def test_the_database_refuses_overlapping_allocations(tenant, make_node, submit, cycle):
    make_node(gpus=1)
    w = submit(tenant, gpu_fraction_milli=600)
    cycle()
    held = Allocation.objects.get(workload=w)
    other = submit(tenant, gpu_fraction_milli=300)
    base = {
        "tenant": tenant,
        "workload": other,
        "node_id": held.node_id,
        "gpu_id": held.gpu_id,
        "gpu_model_id": held.gpu_model_id,
        "plan": "on_demand",
    }
    for offset, fraction in [(0, 300), (500, 300), (0, 1000)]:
        with pytest.raises(IntegrityError), transaction.atomic():
            Allocation.objects.create(milli_offset=offset, fraction_milli=fraction, **base)
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.create(milli_offset=800, fraction_milli=300, **base)  # past the GPU's end
    ok = Allocation.objects.create(milli_offset=600, fraction_milli=300, **base)
    # Closed rows do not count; reopening one that would overlap is refused too.
    ok.ended_at = timezone.now()
    ok.save()
    Allocation.objects.create(milli_offset=600, fraction_milli=400, **{**base, "workload": submit(tenant)})
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.filter(pk=ok.pk).update(ended_at=None)


def test_a_gpu_freed_while_the_cycle_runs_is_not_held_twice_in_time(tenant, make_node, submit, monkeypatch):
    """bench/chaos.py: a job's exit, committed after a cycle began and before it read the fleet,
    freed the GPU the cycle then placed the next job on; the new allocation was stamped with the
    cycle's start, 0.1 s before the old one ended. A release between the two stands in for it."""
    from scheduling.services import cycle as cycle_module

    node = make_node(gpus=1)
    first = submit(tenant)
    scheduling_cycle_run()
    _started(first, node)
    second = submit(tenant)
    load = cycle_module.cycle_snapshot_load

    def released_then_load(now):
        assert timezone.now() > now  # the cycle began before the exit below
        workload_on_exited(node_id=node.pk, workload_id=str(first.pk), state="exited", exit_code=0)
        return load(now)

    monkeypatch.setattr(cycle_module, "cycle_snapshot_load", released_then_load)
    assert scheduling_cycle_run().placed == [second.pk]
    old, new = Allocation.objects.get(workload=first), Allocation.objects.get(workload=second)
    assert old.gpu_id == new.gpu_id and old.ended_at is not None
    assert new.started_at >= old.ended_at


def test_ranges_are_packed_when_no_gap_is_large_enough():
    assert gpu_range_choose([], 1000) == (0, [])
    assert gpu_range_choose([(0, 300, 1), (700, 300, 2)], 400) == (300, [])
    # 600 free in two gaps of 300: pack, then take the end.
    assert gpu_range_choose([(300, 200, 1), (700, 200, 2)], 600) == (400, [(1, 0), (2, 200)])
    assert gpu_range_choose([(0, 500, 1)], 600) is None


def test_packing_on_a_shared_gpu_keeps_the_constraint(tenant, make_node, submit, cycle):
    make_node(gpus=1)
    ws = [submit(tenant, gpu_fraction_milli=250) for _ in range(4)]
    cycle()
    for w in (ws[0], ws[2]):
        w = _started(reload(w), w.allocations.first().node)
        workload_on_exited(
            node_id=w.allocations.first().node_id, workload_id=w.pk, state="exited", exit_code=0
        )
    big = submit(tenant, gpu_fraction_milli=500)
    cycle()
    assert reload(big).state == S.SCHEDULED
    offsets = sorted(Allocation.objects.active().values_list("milli_offset", "fraction_milli"))
    assert offsets == [(0, 250), (250, 250), (500, 500)]


def test_pending_work_says_why_and_when(tenant, make_node, submit, cycle):
    node = make_node(gpus=2)
    running = submit(tenant, gpu_count=2, estimated_runtime_s=3600)
    cycle()
    _started(reload(running), node)
    waiting = submit(tenant, gpu_count=2)
    cycle()
    waiting = reload(waiting)
    assert waiting.state == S.QUEUED
    assert waiting.pending_reason == "capacity" and waiting.pending_message
    assert waiting.expected_start_at is not None
    assert (
        abs((waiting.expected_start_at - (reload(running).started_at + timedelta(hours=1))).total_seconds())
        < 2
    )


def test_preemption_stops_spot_work_once_and_requeues_the_job(tenant, make_tenant, make_node, submit, cycle):
    node = make_node(gpus=2)
    other = make_tenant("other")
    spot = submit(other, gpu_count=2, plan="spot", checkpoint_resume=True)
    cycle()
    spot = _started(reload(spot), node)
    urgent = submit(tenant, gpu_count=2)
    r = cycle()
    assert r.preempted == [spot.pk]
    spot, urgent = reload(spot), reload(urgent)
    assert spot.state == S.PREEMPTED and spot.preempted_for_id == urgent.pk
    assert urgent.state == S.QUEUED and urgent.pending_reason == "preempting"
    cmd = NodeCommand.objects.get(kind=CommandKind.PREEMPT_WORKLOAD)
    assert cmd.payload == {"workload_id": str(spot.pk), "notice_s": 30}
    # Until the victim stops, nothing else is preempted and its GPUs stay allocated.
    assert cycle().preempted == []
    assert Allocation.objects.active().filter(workload=spot).count() == 2
    workload_on_exited(node_id=node.pk, workload_id=spot.pk, state="preempted", exit_code=None)
    spot = reload(spot)
    assert spot.state == S.QUEUED and not spot.allocations.filter(ended_at__isnull=True).exists()
    r = cycle()
    assert r.placed == [urgent.pk] and r.preempted == []
    assert reload(spot).state == S.QUEUED  # spot never preempts on-demand back
    assert WorkloadEvent.objects.filter(workload=spot, to_state=S.PREEMPTED).count() == 1


def test_reserved_capacity_is_kept_for_its_owner_and_lent_to_spot(
    tenant, make_tenant, make_node, submit, cycle
):
    node = make_node(gpus=2)
    other = make_tenant("other")
    now = timezone.now()
    res = Reservation.objects.create(
        tenant=tenant,
        gpu_model=GpuModel.objects.get(name=H100),
        region=node.region,
        count=2,
        starts_at=now - timedelta(hours=1),
        ends_at=now + timedelta(days=1),
        status=ReservationStatus.ACTIVE,
    )
    on_demand = submit(other, gpu_count=1)
    borrower = submit(other, gpu_count=2, plan="spot")
    cycle()
    assert reload(on_demand).state == S.QUEUED  # the only node is reserved
    borrower = _started(reload(borrower), node)
    assert borrower.state == S.RUNNING
    owner = submit(tenant, gpu_count=2, plan="reserved", reservation=res.pk)
    r = cycle()
    assert r.preempted == [borrower.pk]
    workload_on_exited(node_id=node.pk, workload_id=borrower.pk, state="preempted", exit_code=None)
    r = cycle()
    assert r.placed == [owner.pk]
    assert set(Allocation.objects.filter(workload=owner).values_list("plan", flat=True)) == {"reserved"}


def test_backfill_starts_short_work_that_does_not_delay_the_head(tenant, make_node, submit, cycle):
    node = make_node(gpus=4)
    first = submit(tenant, gpu_count=2, estimated_runtime_s=3600)
    cycle()
    _started(reload(first), node)
    head = submit(tenant, gpu_count=4)
    long_small = submit(tenant, gpu_count=1, estimated_runtime_s=7200)
    short_small = submit(tenant, gpu_count=1, estimated_runtime_s=600)
    r = cycle()
    assert r.placed == [short_small.pk]
    assert reload(head).expected_start_at is not None
    assert reload(long_small).state == S.QUEUED
    assert WorkloadEvent.objects.get(workload=short_small, to_state=S.SCHEDULED).reason == "backfilled"


@pytest.mark.parametrize(("weight", "expected"), [(1, (2, 2)), (3, (3, 1))])
def test_tenants_share_by_their_weight(tenant, make_tenant, make_node, submit, cycle, weight, expected):
    from scheduling.models import Quota

    make_node(gpus=4)
    other = make_tenant("other")
    Quota.objects.create(tenant=tenant, fair_share_weight=weight)
    mine = [submit(tenant) for _ in range(4)]
    theirs = [submit(other) for _ in range(4)]
    cycle()
    got = tuple(sum(reload(w).state == S.SCHEDULED for w in ws) for ws in (mine, theirs))
    assert got == expected
