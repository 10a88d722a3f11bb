"""End to end: a partition heals and the old copy of a job is stopped (issue 25 §3).

The real portal (uvicorn in a thread) and two real agent processes (``python -m nodes.agent.cli
run``, simulated collector and runtime), set up by ``tests.nodes.test_e2e_agent``'s fixtures. The
partition is the agent process stopped (SIGSTOP) and continued (SIGCONT); the health reconciler runs
with a ``now`` past ``NODE_DOWN_AFTER_S`` instead of waiting two minutes.
"""

from __future__ import annotations

import signal
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings as django_settings

from metering.models import RateCard, UsageRecord
from metering.services.rates import rate_card_version_create
from metering.services.usage import usage_build
from nodes.models import (
    CommandKind,
    CommandState,
    Gpu,
    GpuSample,
    HeartbeatBatch,
    Node,
    NodeCommand,
    NodeState,
)
from nodes.services.health import node_health_reconcile
from portal.actors import Actor
from portal.services.tenants import tenant_create
from scheduling.models import Allocation, Plan, Workload, WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.submission import workload_submit
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    HEARTBEAT_INTERVAL_S,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    start_agent,
    wait_for,
)

pytestmark = pytest.mark.slow


def state(w: Workload) -> str:
    return Workload.objects.get(pk=w.pk).state


def holders(w: Workload) -> set[int]:
    return set(Allocation.objects.filter(workload=w, ended_at__isnull=True).values_list("node_id", flat=True))


def ran_on(gpu: Gpu, workload: Workload) -> list[datetime]:
    """When the simulated runtime ran ``workload`` on ``gpu``, as its telemetry shows (per sample)."""
    return sorted(
        ts
        for ts, processes in GpuSample.objects.filter(gpu=gpu).values_list("ts", "processes")
        if any(p.get("workload_id") == str(workload.pk) for p in processes or [])
    )


def test_a_healed_partition_leaves_one_copy_and_bills_to_the_down_mark(start_agent, settings):  # noqa: F811
    settings.NODE_MASS_SILENCE_MIN_NODES = 10_000  # two nodes: no mass-silence guard
    begun = time.monotonic()
    a = start_agent("reap-a", gpus=1)
    node_a = registered(a)
    gpu_a = Gpu.objects.get(node=node_a)
    model = gpu_a.model
    card = RateCard.objects.create(name="E2E", currency="USD", is_default=True)
    rate_card_version_create(
        rate_card=card,
        effective_from=datetime(2020, 1, 1, tzinfo=UTC),
        gpu_prices={(model.pk, Plan.ON_DEMAND): "2.00"},
        allow_past=True,
    )
    tenant = tenant_create(slug="reaper", name="Reaper", owner_email="o@reaper.test", actor=Actor.system())

    def submit() -> Workload:
        spec = {"image": "ghcr.io/acme/train:1", "command": ["train"], "gpu_models": [model.name]}
        return workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())

    # The job runs on A (the only node).
    job = submit()
    assert scheduling_cycle_run().ran and holders(job) == {node_a.pk}
    wait_for(lambda: state(job) == S.RUNNING, what="the job to run on A")
    b = start_agent("reap-b", gpus=1)
    node_b = registered(b)
    gpu_b = Gpu.objects.get(node=node_b)
    wait_for(lambda: ran_on(gpu_a, job), what="A's telemetry to show the job")

    # The partition: A's agent freezes; its last heartbeat is the DOWN mark.
    a.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(2 * HEARTBEAT_INTERVAL_S + 0.5)  # any batch in flight lands; B keeps beating
        last = Node.objects.get(pk=node_a.pk).last_heartbeat_at
        down = node_health_reconcile(now=last + timedelta(seconds=django_settings.NODE_DOWN_AFTER_S + 1))
        assert down.down == [node_a.pk]
        assert state(job) == S.QUEUED
        (alloc_a,) = Allocation.objects.filter(workload=job, node=node_a)
        assert alloc_a.end_reason == "node_down" and alloc_a.ended_at == last and alloc_a.stop_unconfirmed
        (orphan_stop,) = NodeCommand.objects.filter(node=node_a, kind=CommandKind.STOP_WORKLOAD)
        assert orphan_stop.state == CommandState.PENDING and orphan_stop.payload["workload_id"] == str(job.pk)

        # The scheduler places the job on B (B, seen as silent at that ``now``, is READY again by
        # its next heartbeat); B runs it.
        wait_for(lambda: Node.objects.get(pk=node_b.pk).state == NodeState.READY, what="B to be READY")
        assert scheduling_cycle_run().ran and holders(job) == {node_b.pk}
        wait_for(lambda: state(job) == S.RUNNING, what="the job to run on B")
        other = submit()  # more work, for A's GPU once A is back
    finally:
        healed = datetime.now(UTC)
        a.proc.send_signal(signal.SIGCONT)

    # A comes back still running its old copy; the stop that waited for it is delivered at once.
    wait_for(lambda: Node.objects.get(pk=node_a.pk).state == NodeState.READY, what="A to be READY")
    # A cycle now places the other job on A only once A has reported the old copy gone (the
    # telemetry checks below show the two never overlap; test_reaper shows the wait itself).
    assert scheduling_cycle_run().ran
    wait_for(lambda: not Allocation.objects.get(pk=alloc_a.pk).stop_unconfirmed, what="A to confirm the stop")
    orphan_stop.refresh_from_db()
    assert orphan_stop.state == CommandState.SUCCEEDED
    assert list(
        NodeCommand.objects.filter(node=node_a, kind=CommandKind.STOP_WORKLOAD).values_list("pk", flat=True)
    ) == [orphan_stop.pk]  # the reaper's stop for this copy is the same command: no second one
    confirmed = Allocation.objects.get(pk=alloc_a.pk).stop_confirmed_at
    back = list(
        HeartbeatBatch.objects.filter(node=node_a, received_at__gte=healed, received_at__lte=confirmed)
        .order_by("seq")
        .values_list("seq", flat=True)
    )
    # Stopped within one heartbeat: the first batch after the heal still lists it running (built
    # before the stop arrived), the next one reports it stopped.
    assert 1 <= len(back) <= 2, back
    assert WorkloadEvent.objects.filter(workload=job, reason="stop_confirmed").count() == 1

    # Now A's GPU takes the other job.
    assert scheduling_cycle_run().ran and holders(other) == {node_a.pk}, state(other)
    wait_for(lambda: ran_on(gpu_a, other), what="the other job to run on A")
    assert state(job) == S.RUNNING and holders(job) == {node_b.pk}

    # No GPU used twice on the hardware: A ran the old copy only until the stop, B runs the job,
    # and no sample of A's GPU shows two workloads.
    old_copy = ran_on(gpu_a, job)
    assert old_copy and max(old_copy) <= orphan_stop.finished_at
    assert min(ran_on(gpu_a, other)) > max(old_copy)
    assert ran_on(gpu_b, job)
    for processes in GpuSample.objects.filter(gpu__in=[gpu_a, gpu_b]).values_list("processes", flat=True):
        assert len({p.get("workload_id") for p in processes or []}) <= 1

    # Billing of A's allocation ends at the DOWN mark, though A came back and reported the job.
    assert Allocation.objects.get(pk=alloc_a.pk).ended_at == last
    usage_build(now=datetime.now(UTC) + timedelta(minutes=5))
    (record,) = UsageRecord.objects.filter(allocation=alloc_a)
    started = WorkloadEvent.objects.filter(workload=job, to_state=S.RUNNING).order_by("at").first().at
    assert (record.start, record.end) == (started, last)
    assert not Allocation.objects.filter(workload=job, node=node_a, ended_at__isnull=True).exists()
    print(
        f"\nreaper e2e: {time.monotonic() - begun:.1f} s; old copy stopped after {len(back)} heartbeat(s) "
        f"of the healed node; billed {record.seconds} s to the DOWN mark"
    )
