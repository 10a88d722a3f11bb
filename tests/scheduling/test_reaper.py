"""The reaper: no orphans, no phantom RUNNING (issue 25 §3).

Nodes register and heartbeat over HTTP (the real agent views and ingest), so the fleet's signals
reach scheduling's receivers as in production; the health reconciler and the scheduling
reconciler take a ``now``, which stands in for the clock.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from metering.models import RateCard, UsageRecord
from metering.services.rates import rate_card_version_create
from metering.services.usage import billable_interval, usage_build
from nodes.models import OPEN_COMMAND_STATES, CommandKind, GpuModel, NodeCommand, NodeWorkloadStatus
from nodes.services.commands import node_commands_deliver_due, node_commands_expire
from nodes.services.health import node_health_reconcile
from nodes.services.registration import bootstrap_token_create
from portal.actors import Actor
from scheduling.models import Allocation, Plan, WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.lifecycle import (
    scheduling_reconcile,
    workload_on_command_finished,
    workload_preempt,
    workload_stop,
)
from tests.nodes.conftest import (  # noqa: F401  (agent_views_in_test_thread: an autouse fixture)
    Agent,
    agent_register,
    agent_views_in_test_thread,
    registration_body,
)
from tests.portal.conftest import signed_in  # noqa: F401  (fixture)
from tests.scheduling.conftest import H100, reload

pytestmark = pytest.mark.django_db
_n = itertools.count(1)
STARTED = datetime.now(UTC).isoformat().replace("+00:00", "Z")


@pytest.fixture
def register(regions):
    """A node registered over HTTP with ``gpus`` H100s; returns its side of the protocol."""

    def do(gpus: int = 1) -> Agent:
        token = bootstrap_token_create(region=regions["us"], actor=Actor.system())[1]
        return agent_register(registration_body(token, f"reap-{next(_n):03d}", gpus=gpus))

    return do


@pytest.fixture
def beat(django_capture_on_commit_callbacks):
    """One heartbeat reporting ``workloads`` as [(workload or id, state)]; its signals delivered."""

    def do(agent: Agent, *workloads) -> dict:
        now = STARTED  # one time for all: a report repeated unchanged has the same fingerprint
        reports = [
            {"workload_id": str(getattr(w, "pk", w)), "state": state, "exit_code": None,
             "started_at": now, "finished_at": now if state != "running" else None, "message": ""}
            for w, state in workloads
        ]  # fmt: skip
        body = agent.batch(workloads=reports)
        with django_capture_on_commit_callbacks(execute=True):
            response = agent.heartbeat(body)
        assert response.status_code == 200, response.content
        return response.json()

    return do


@pytest.fixture
def mark_down(django_capture_on_commit_callbacks, settings):
    """The health reconciler, run as if the node had been silent past NODE_DOWN_AFTER_S."""

    def do(agent: Agent) -> datetime:
        last = agent.node.last_heartbeat_at
        with django_capture_on_commit_callbacks(execute=True):
            result = node_health_reconcile(now=last + timedelta(seconds=settings.NODE_DOWN_AFTER_S + 1))
        assert agent.node_id in result.down
        return last

    return do


def stops(agent: Agent, w) -> list[NodeCommand]:
    return list(
        NodeCommand.objects.filter(
            node_id=agent.node_id,
            kind=CommandKind.STOP_WORKLOAD,
            payload__workload_id=str(getattr(w, "pk", w)),
        )
    )


def holder(w) -> int:
    (node_id,) = set(Allocation.objects.active().filter(workload=w).values_list("node_id", flat=True))
    return node_id


# --- 1. a DOWN node hears about its workloads when it comes back -----------------------------------


def test_a_down_node_is_sent_a_stop_that_waits_for_its_return(
    register, beat, mark_down, submit, tenant, cycle
):
    a = register()
    w = submit(tenant)
    cycle()
    beat(a, (w, "running"))
    assert reload(w).state == S.RUNNING
    last = mark_down(a)
    assert reload(w).state == S.QUEUED

    (stop,) = stops(a, w)  # the DOWN node's own stop, queued for when it returns
    assert stop.state in OPEN_COMMAND_STATES
    # A partition of days: the stop neither expires nor runs out of attempts while it waits.
    back = last + timedelta(days=3)
    node_commands_expire(now=back)
    delivered, _ = node_commands_deliver_due(node_id=a.node_id, now=back)
    assert [c.pk for c in delivered] == [stop.pk]
    assert reload(w).avoid_nodes == [a.node_id]  # placed elsewhere if it can be


# --- 2. the reaper ---------------------------------------------------------------------------------


def test_the_reaper_stops_work_the_portal_did_not_place_on_that_node(
    register, beat, submit, tenant, cycle, django_capture_on_commit_callbacks
):
    a, b = register(), register()
    w = submit(tenant)
    cycle()
    on, off = (a, b) if holder(w) == a.node_id else (b, a)
    beat(on, (w, "running"))
    assert reload(w).state == S.RUNNING
    assert not NodeCommand.objects.filter(kind=CommandKind.STOP_WORKLOAD).exists()  # placed there: kept

    # The other node reports it running too: it has no business running it.
    beat(off, (w, "running"), ("900123", "running"), ("900124", "exited"))
    (stop,) = stops(off, w)
    assert stop.payload["workload_id"] == str(w.pk)
    assert len(stops(off, "900123")) == 1  # no such workload at all: stopped as well
    assert not stops(off, "900124")  # reported finished: nothing to stop
    beat(off, (w, "running"), ("900123", "running"))  # every heartbeat until it is gone: one stop each
    assert len(stops(off, w)) == 1 and len(stops(off, "900123")) == 1
    assert not stops(on, w) and reload(w).state == S.RUNNING

    # A workload that finished here, still reported running by the node: stopped.
    j = submit(tenant)
    cycle()
    node = a if holder(j) == a.node_id else b
    beat(node, (j, "running"))
    workload_stop(workload=reload(j), actor=Actor.system())
    (user_stop,) = stops(node, j)
    with django_capture_on_commit_callbacks(execute=True):
        assert node.report(user_stop.pk, "succeeded").status_code == 200
    assert reload(j).state == S.STOPPED
    beat(node, (j, "running"))
    assert len(stops(node, j)) == 2


def test_a_down_nodes_stop_and_the_reapers_are_one_stop_for_one_copy(
    register, beat, mark_down, submit, tenant, cycle, django_capture_on_commit_callbacks
):
    """The copy A ran (attempt 1) is stopped once, though the job runs on B by now (attempt 2) and
    A's batches, built before the stop took effect, list it after A accepted and finished it."""
    a = register()
    w = submit(tenant)
    cycle()
    (start,) = node_commands_deliver_due(node_id=a.node_id)[0]
    with django_capture_on_commit_callbacks(execute=True):
        assert a.report(start.pk, "succeeded").status_code == 200
    beat(a, (w, "running"))
    mark_down(a)
    (down_stop,) = stops(a, w)
    b = register()
    cycle()
    assert holder(w) == b.node_id and reload(w).attempt == 2
    beat(b, (w, "running"))

    # A is back: its stop is delivered and accepted (no longer on its way), and a batch still lists it.
    delivered, _ = node_commands_deliver_due(node_id=a.node_id)
    assert [c.pk for c in delivered] == [down_stop.pk]
    assert a.report(down_stop.pk, "accepted").status_code == 200
    beat(a, (w, "running"))
    assert [c.pk for c in stops(a, w)] == [down_stop.pk]
    with django_capture_on_commit_callbacks(execute=True):
        assert a.report(down_stop.pk, "succeeded").status_code == 200
    beat(a, (w, "running"))  # a late batch of A's, built before the stop
    assert [c.pk for c in stops(a, w)] == [down_stop.pk]
    assert not stops(b, w) and holder(w) == b.node_id

    # Positive control: a copy the node was never given (an unknown id) is still stopped, once.
    beat(a, (w, "running"), ("900125", "running"))
    beat(a, (w, "running"), ("900125", "running"))
    assert len(stops(a, "900125")) == 1 and [c.pk for c in stops(a, w)] == [down_stop.pk]


def test_the_reaper_asks_one_query_of_a_heartbeat_that_reports_work(register, beat, submit, tenant, cycle):
    busy, idle = register(gpus=4), register(gpus=1)
    ws = [submit(tenant) for _ in range(4)]
    cycle()
    running = [(w, "running") for w in ws if holder(w) == busy.node_id]
    assert len(running) >= 3
    beat(busy, *running)
    beat(idle)

    def queries(agent, *workloads) -> int:
        beat(agent, *workloads)  # the same report as the last: nothing changes but the reaper's look
        with CaptureQueriesContext(connection) as ctx:
            beat(agent, *workloads)
        return len(ctx.captured_queries)

    assert queries(busy, *running) == queries(idle) + 1
    assert queries(busy, *running[:1]) == queries(idle) + 1  # set-based: not one per workload
    assert not NodeCommand.objects.filter(kind=CommandKind.STOP_WORKLOAD).exists()


# --- 3. a forced stop is unconfirmed until the node reports it gone --------------------------------


def test_a_forced_stop_is_unconfirmed_until_the_node_reports_it_gone(
    register,
    beat,
    submit,
    tenant,
    owner,
    cycle,
    settings,
    signed_in,  # noqa: F811
):
    a = register(gpus=1)
    w = submit(tenant, kind="instance")
    cycle()
    beat(a, (w, "running"))
    workload_stop(workload=reload(w), actor=Actor.system())
    grace = settings.SCHEDULING_STOP_GRACE_S + settings.SCHEDULING_REPORT_GRACE_S
    assert scheduling_reconcile(now=timezone.now() + timedelta(seconds=grace + 1)).stop_forced == [w.pk]
    assert reload(w).state == S.STOPPED
    (alloc,) = Allocation.objects.filter(workload=w)
    assert alloc.ended_at is not None and alloc.stop_forced_at is not None and alloc.stop_confirmed_at is None
    forced = WorkloadEvent.objects.get(workload=w, reason="stop_timeout")
    assert "unconfirmed" in forced.message

    # The tenant sees it on the workload's page.
    page = signed_in(owner, tenant).get(f"/workloads/{w.pk}/").content.decode()
    assert "not confirmed" in page and a.node.hostname in page

    # Its GPU is not given to other work while the node may still run it.
    other = submit(tenant)
    cycle()
    assert reload(other).state == S.QUEUED

    beat(a, (w, "stopped"))  # the node reports it gone
    alloc.refresh_from_db()
    assert alloc.stop_confirmed_at is not None
    assert WorkloadEvent.objects.filter(workload=w, reason="stop_confirmed").count() == 1
    assert "not confirmed" not in signed_in(owner, tenant).get(f"/workloads/{w.pk}/").content.decode()
    cycle()
    assert reload(other).state == S.SCHEDULED and holder(other) == a.node_id


def test_a_forced_preemption_is_confirmed_by_the_nodes_stop_report(
    register, beat, submit, tenant, cycle, settings
):
    a = register(gpus=1)
    w = submit(tenant, plan="spot")
    cycle()
    beat(a, (w, "running"))
    workload_preempt(workload=reload(w), reason="spot_price", notice_s=0)
    grace = settings.SCHEDULING_STOP_GRACE_S + settings.SCHEDULING_REPORT_GRACE_S
    assert scheduling_reconcile(now=timezone.now() + timedelta(seconds=grace + 1)).preempt_forced == [w.pk]
    (alloc,) = Allocation.objects.filter(workload=w)
    assert alloc.stop_forced_at is not None and alloc.stop_confirmed_at is None
    preempt = NodeCommand.objects.get(node_id=a.node_id, kind=CommandKind.PREEMPT_WORKLOAD)
    workload_on_command_finished(
        kind=preempt.kind, payload=preempt.payload, node_id=a.node_id, state="succeeded", result={}
    )
    alloc.refresh_from_db()
    assert alloc.stop_confirmed_at is not None


def test_a_node_that_no_longer_lists_the_workload_confirms_its_stop(
    register, beat, submit, tenant, cycle, settings
):
    settings.SCHEDULING_STOP_GRACE_S = settings.SCHEDULING_REPORT_GRACE_S = 0  # forced at once
    a = register(gpus=1)
    w = submit(tenant, kind="instance")
    cycle()
    beat(a, (w, "running"))
    workload_stop(workload=reload(w), actor=Actor.system())
    assert scheduling_reconcile().stop_forced == [w.pk]
    beat(a, (w, "running"))  # still there; the stop asked for is still on its way: no second one
    assert len(stops(a, w)) == 1
    assert scheduling_reconcile().stop_confirmed == []
    assert Allocation.objects.get(workload=w).stop_unconfirmed
    beat(a)  # the node lists it no more (e.g. it was reinstalled)
    assert scheduling_reconcile().stop_confirmed == [w.pk]
    assert not Allocation.objects.get(workload=w).stop_unconfirmed


def test_a_batch_older_than_the_start_confirms_no_stop(register, beat, mark_down, submit, tenant, cycle):
    """bench/chaos.py's long partition: an instance placed on a node already cut off, the node
    DOWN, then healed. Its buffered batches, made before the start reached it, list nothing; the
    start (delivered, its answer lost in the partition) comes after them. Those batches must not
    confirm the stop: the GPU went to other work while the node then ran the instance there."""
    a = register(gpus=1)
    beat(a)  # the last batch before the partition
    w = submit(tenant, kind="instance")
    cycle()
    (start,) = NodeCommand.objects.filter(node_id=a.node_id, kind=CommandKind.START_WORKLOAD)
    node_commands_deliver_due(node_id=a.node_id)  # handed out; the answer never reaches the node
    mark_down(a)
    assert reload(w).state == S.FAILED
    (alloc,) = Allocation.objects.filter(workload=w)
    assert alloc.stop_unconfirmed

    beat(a)  # healed: a buffered batch, older than the start, lists nothing
    assert scheduling_reconcile().stop_confirmed == []
    assert Allocation.objects.get(workload=w).stop_unconfirmed
    other = submit(tenant)
    cycle()
    assert reload(other).state == S.QUEUED  # the GPU the start may yet use takes no new work

    # Positive control: the start reported done, then a batch made after it without the workload.
    NodeCommand.objects.filter(pk=start.pk).update(state="succeeded", finished_at=timezone.now())
    beat(a)
    assert scheduling_reconcile().stop_confirmed == [w.pk]
    cycle()
    assert reload(other).state == S.SCHEDULED and holder(other) == a.node_id


def test_an_end_whose_signal_failed_is_applied_by_the_reconciler(register, beat, submit, tenant, cycle):
    """bench/chaos.py (seed 1): a PostgreSQL restart cut the connection of the heartbeat's
    ``workload_exited`` receiver after the batch committed; the job stayed RUNNING, its GPU held
    and billed, after the node had forgotten it. The reconciler applies the node's word."""
    a = register(gpus=1)
    w = submit(tenant)
    cycle()
    beat(a, (w, "running"))
    assert reload(w).state == S.RUNNING
    assert scheduling_reconcile().exits_applied == []  # positive control: nothing to apply yet
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    report = {"workload_id": str(w.pk), "state": "exited", "exit_code": 0, "started_at": STARTED,
              "finished_at": now, "message": ""}  # fmt: skip
    # The batch commits; its on-commit receivers never run (as when their connection was cut).
    assert a.heartbeat(a.batch(workloads=[report])).status_code == 200
    assert reload(w).state == S.RUNNING
    assert scheduling_reconcile().exits_applied == [w.pk]
    assert reload(w).state == S.SUCCEEDED
    assert Allocation.objects.get(workload=w).ended_at is not None
    assert scheduling_reconcile().exits_applied == []  # once


def test_a_copy_started_after_its_stop_ran_is_stopped_again(register, beat, mark_down, submit, tenant, cycle):
    """bench/chaos.py (seed 2): a healed node got an instance's start and the DOWN node's stop in
    one poll, ran the stop first ("not known on this node": done) and then the start. The
    reaper's stop for that copy had the done stop's key, so none was sent: the instance ran on,
    unplaced, for good. A batch listing it after the stop was reported gets a new stop, once."""
    a = register(gpus=1)
    beat(a)
    w = submit(tenant, kind="instance")
    cycle()
    mark_down(a)
    (stop,) = stops(a, w)
    ran = timezone.now()  # both reported: the stop first ("not known on this node"), then the start
    NodeCommand.objects.filter(pk=stop.pk).update(state="succeeded", finished_at=ran - timedelta(seconds=1))
    NodeCommand.objects.filter(node_id=a.node_id, kind=CommandKind.START_WORKLOAD).update(
        state="succeeded", finished_at=ran
    )
    beat(a, (w, "running"))
    again = [c for c in stops(a, w) if c.pk != stop.pk]
    assert [c.idempotency_key for c in again] == [f"{stop.idempotency_key}:2"]
    assert again[0].state in OPEN_COMMAND_STATES
    beat(a, (w, "running"))  # still listed while that stop is on its way: no third
    assert len(stops(a, w)) == 2


# --- 4. the reconciler trusts only the nodes that hold the workload --------------------------------


def test_the_reconciler_marks_running_only_on_a_holding_nodes_report(make_node, submit, tenant, cycle):
    first, second = make_node(gpus=1), make_node(gpus=1)
    w = submit(tenant)
    cycle()
    on, off = (first, second) if holder(w) == first.pk else (second, first)
    start = NodeCommand.objects.get(node=on, kind=CommandKind.START_WORKLOAD)
    workload_on_command_finished(
        kind=start.kind, payload=start.payload, node_id=on.pk, state="succeeded", result={"state": "starting"}
    )
    assert reload(w).state == S.STARTING
    NodeWorkloadStatus.objects.create(node=off, workload_id=str(w.pk), state="running")
    assert scheduling_reconcile().running == []
    assert reload(w).state == S.STARTING
    NodeWorkloadStatus.objects.create(node=on, workload_id=str(w.pk), state="running")
    assert scheduling_reconcile().running == [w.pk]
    assert reload(w).state == S.RUNNING


# --- 5. billing ends at the DOWN mark, whatever the node reports later ------------------------------


def test_billing_of_a_down_nodes_allocation_ends_at_its_last_heartbeat(
    register, beat, mark_down, submit, tenant, cycle
):
    model = GpuModel.objects.get(name=H100)
    card = RateCard.objects.create(name="Standard", currency="USD", is_default=True)
    rate_card_version_create(
        rate_card=card,
        effective_from=datetime(2020, 1, 1, tzinfo=UTC),
        gpu_prices={(model.pk, Plan.ON_DEMAND): "2.00"},
        allow_past=True,
    )
    a = register()
    w = submit(tenant)
    cycle()
    beat(a, (w, "running"))
    beat(a, (w, "running"))  # the last heartbeat before the partition
    started = WorkloadEvent.objects.get(workload=w, to_state=S.RUNNING).at
    last = mark_down(a)
    (alloc,) = Allocation.objects.filter(workload=w)
    assert alloc.end_reason == "node_down" and alloc.ended_at == last

    # The node comes back and still runs it: its reports neither reopen nor extend the allocation.
    beat(a, (w, "running"))
    beat(a, (w, "running"))
    assert a.node.last_heartbeat_at > last
    assert list(Allocation.objects.filter(workload=w).values_list("pk", "ended_at")) == [(alloc.pk, last)]
    alloc = Allocation.objects.select_related("node").get(pk=alloc.pk)
    assert billable_interval(alloc, started=started) == (started, last)
    usage_build(now=timezone.now() + timedelta(minutes=5))
    (record,) = UsageRecord.objects.filter(allocation=alloc)
    assert (record.start, record.end) == (started, last)


@pytest.mark.django_db(transaction=True)
def test_the_reaper_answers_a_heartbeat_committed_in_its_pipeline(
    register, beat, submit, tenant, cycle, settings
):
    """A heartbeat that changes nothing commits inside its pipelined writes on PostgreSQL (no
    test transaction around it here): the reaper still hears of it once it has committed."""
    settings.SCHEDULING_STOP_GRACE_S = settings.SCHEDULING_REPORT_GRACE_S = 0
    a = register()
    w = submit(tenant, kind="instance")
    cycle()
    beat(a, (w, "running"))
    workload_stop(workload=reload(w), actor=Actor.system())
    (user_stop,) = stops(a, w)
    assert a.report(user_stop.pk, "accepted").status_code == 200
    assert scheduling_reconcile().stop_forced == [w.pk]  # the agent never finishes it
    NodeCommand.objects.filter(pk=user_stop.pk).update(state="expired")
    beat(a, (w, "running"))  # the same list as before: nothing to write but the samples
    assert len(stops(a, w)) == 2
