"""Gangs through the services: each member's rank and rendezvous, RUNNING only when every member
started, and a member that fails (or a gang not started in time) stops every member."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from metering.services.usage import billable_interval
from nodes.agent.workload_rules import WorkloadRuleError, check_platform_env, check_start_payload
from nodes.models import CommandKind, NodeCommand
from nodes.services.commands import node_command_report
from nodes.signals import workload_exited
from portal.errors import ValidationFailed
from scheduling.models import Allocation, WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.lifecycle import scheduling_reconcile, workload_on_running
from tests.scheduling.conftest import reload, start_command

pytestmark = pytest.mark.django_db


def _report(capture, w, node, status="succeeded", result=None):
    """The agent's report through the real service (the command row changes, then the signal)."""
    with capture(execute=True):
        node_command_report(
            node_id=node.pk,
            command_id=start_command(w, node).pk,
            status=status,
            result=result if result is not None else {"state": "running"},
        )


def _exit(node, w, state="exited", exit_code=0):
    workload_exited.send(
        sender=type(node),
        node=node,
        workload_id=str(w.pk),
        state=state,
        exit_code=exit_code,
        finished_at=timezone.now(),
        message="",
    )


def _stops(w, node) -> int:
    return NodeCommand.objects.filter(
        node=node, kind=CommandKind.STOP_WORKLOAD, payload__workload_id=str(w.pk)
    ).count()


def _gang(tenant, make_node, submit, cycle, **spec):
    a, b = make_node(), make_node()
    a.address = "10.0.0.1"
    a.save(update_fields=["address"])
    w = submit(tenant, gpu_count=16, gang=True, **spec)
    cycle()
    assert reload(w).state == S.SCHEDULED
    starts = {c.node_id: c for c in NodeCommand.objects.filter(kind=CommandKind.START_WORKLOAD)}
    assert set(starts) == {a.pk, b.pk}
    return w, a, b, starts


def test_each_member_gets_its_rank_and_the_rendezvous(tenant, make_node, submit, cycle, settings):
    settings.SCHEDULING_GANG_PORT_RANGE = (40000, 40001)
    w, a, b, starts = _gang(tenant, make_node, submit, cycle)
    envs = {n: c.payload["platform_env"] for n, c in starts.items()}
    rank0 = next(n for n, e in envs.items() if e["NODE_RANK"] == "0")
    rank1 = next(n for n, e in envs.items() if e["NODE_RANK"] == "1")
    hosts = {a.pk: "10.0.0.1", b.pk: b.hostname}
    port = reload(w).gang_port
    assert port in (40000, 40001)
    for e in envs.values():
        assert e["WORLD_SIZE"] == "16" and e["NNODES"] == "2" and e["LOCAL_WORLD_SIZE"] == "8"
        assert e["MASTER_ADDR"] == hosts[rank0] and e["MASTER_PORT"] == str(port)
        assert e["GPUPOOL_PEERS"] == f"{hosts[rank0]},{hosts[rank1]}"
    # The agent accepts the payload as it is and keeps the tenant's env apart.
    assert check_start_payload(starts[rank1].payload)["platform_env"] == envs[rank1]
    assert "WORLD_SIZE" not in starts[rank1].payload["env"]
    # A second gang gets the other port of the range; a job on one node gets no rendezvous.
    c, d = make_node(), make_node()
    w2 = submit(tenant, gpu_count=16, gang=True)
    single = submit(tenant, gpu_count=2)
    make_node()
    cycle()
    assert {reload(w2).gang_port, port} == {40000, 40001}
    assert "platform_env" not in NodeCommand.objects.get(payload__workload_id=str(single.pk)).payload
    assert {x.node_id for x in NodeCommand.objects.filter(payload__workload_id=str(w2.pk))} == {c.pk, d.pk}


def test_a_gang_runs_only_when_every_member_started(
    tenant, make_node, submit, cycle, django_capture_on_commit_callbacks
):
    w, a, b, _ = _gang(tenant, make_node, submit, cycle)
    _report(django_capture_on_commit_callbacks, w, a)
    assert reload(w).state == S.SCHEDULED
    workload_on_running(node_id=a.pk, workload_id=str(w.pk))  # a heartbeat from the started node
    assert reload(w).state == S.SCHEDULED and reload(w).started_at is None
    _report(django_capture_on_commit_callbacks, w, b)
    assert reload(w).state == S.RUNNING
    # Members end one by one: the first one's GPUs go back at its exit; the gang succeeds with the last.
    _exit(a, w)
    assert reload(w).state == S.RUNNING
    assert not Allocation.objects.active().filter(workload=w, node=a).exists()
    assert Allocation.objects.active().filter(workload=w, node=b).count() == 8
    _exit(b, w)
    assert reload(w).state == S.SUCCEEDED
    ends = dict(Allocation.objects.filter(workload=w).values_list("node_id", "end_reason").distinct())
    assert ends == {a.pk: "member_exited", b.pk: "exited"}
    # Billing: every allocation from the gang's RUNNING (not a member's own start) to its own end.
    running_at = WorkloadEvent.objects.get(workload=w, to_state=S.RUNNING).at
    billed = {
        x.node_id: billable_interval(x, started=running_at) for x in Allocation.objects.filter(workload=w)
    }
    assert billed[a.pk] == (running_at, Allocation.objects.filter(workload=w, node=a).first().ended_at)
    assert billed[b.pk] == (running_at, Allocation.objects.filter(workload=w, node=b).first().ended_at)
    assert billed[a.pk][1] < billed[b.pk][1]


def test_a_member_that_fails_to_start_stops_the_member_that_started(
    tenant, make_node, submit, cycle, django_capture_on_commit_callbacks
):
    w, a, b, _ = _gang(tenant, make_node, submit, cycle)
    _report(django_capture_on_commit_callbacks, w, a)
    _report(django_capture_on_commit_callbacks, w, b, status="failed", result={"reason": "image pull failed"})
    w = reload(w)
    assert w.state == S.QUEUED and "image pull failed" in w.state_reason
    assert _stops(w, a) == 1  # the member that started is told to stop
    assert not Allocation.objects.active().filter(workload=w).exists()
    # A's GPUs take no new work until A confirms the stop; B's never ran anything.
    forced = set(
        Allocation.objects.filter(workload=w, stop_forced_at__isnull=False).values_list("node_id", flat=True)
    )
    assert forced == {a.pk}
    # The gang never ran: nothing is billed, though A's member started.
    assert not WorkloadEvent.objects.filter(workload=w, to_state=S.RUNNING).exists()


def test_a_member_failing_while_running_stops_the_whole_gang_by_its_policy(
    tenant, make_node, submit, cycle, django_capture_on_commit_callbacks
):
    w, a, b, _ = _gang(tenant, make_node, submit, cycle, max_retries=1)
    _report(django_capture_on_commit_callbacks, w, a)
    _report(django_capture_on_commit_callbacks, w, b)
    assert reload(w).state == S.RUNNING
    _exit(b, w, state="failed", exit_code=3)
    w = reload(w)
    assert w.state == S.QUEUED and w.retries == 1 and "gang member failed" in w.state_reason
    assert _stops(w, a) == 1 and _stops(w, b) == 0
    # A's GPUs wait for A's word that the member stopped; then the gang is placed again, and this
    # time a failure fails it (no retries left), stopping the other member.
    cycle()
    assert reload(w).state == S.QUEUED and reload(w).pending_reason == "gang"
    stop = NodeCommand.objects.get(node=a, kind=CommandKind.STOP_WORKLOAD, payload__workload_id=str(w.pk))
    with django_capture_on_commit_callbacks(execute=True):
        node_command_report(node_id=a.pk, command_id=stop.pk, status="succeeded", result={})
    cycle()
    assert reload(w).state == S.SCHEDULED
    nodes = sorted(start_command(w, n).node_id for n in (a, b))
    assert nodes == sorted([a.pk, b.pk])
    _report(django_capture_on_commit_callbacks, w, a)
    _report(django_capture_on_commit_callbacks, w, b)
    _exit(a, w, state="failed", exit_code=1)
    assert reload(w).state == S.FAILED
    assert _stops(w, b) == 1


def test_a_gang_not_started_in_time_is_stopped_on_every_node(
    tenant, make_node, submit, cycle, settings, django_capture_on_commit_callbacks
):
    settings.SCHEDULING_GANG_START_TIMEOUT_S = 30
    settings.SCHEDULING_START_TIMEOUT_S = 3600  # the gang's own timeout applies, not this one
    w, a, b, _ = _gang(tenant, make_node, submit, cycle)
    _report(django_capture_on_commit_callbacks, w, a)
    assert scheduling_reconcile(now=timezone.now() + timedelta(seconds=20)).start_timeouts == []
    out = scheduling_reconcile(now=timezone.now() + timedelta(seconds=40))
    w = reload(w)
    assert (
        out.start_timeouts == [w.pk]
        and w.state == S.QUEUED
        and w.state_reason == "Not started on every node in time."
    )
    assert _stops(w, a) == 1 and _stops(w, b) == 1
    assert w.avoid_nodes == [b.pk]  # only the node that did not start is avoided
    forced = set(
        Allocation.objects.filter(workload=w, stop_forced_at__isnull=False).values_list("node_id", flat=True)
    )
    assert forced == {a.pk}


def test_a_gang_may_not_set_the_rendezvous_itself(tenant, make_node, submit):
    make_node()
    make_node()
    with pytest.raises(ValidationFailed) as err:
        submit(tenant, gpu_count=16, gang=True, env={"MASTER_PORT": "1234"})
    assert "env" in err.value.fields
    # On one node it may (single-node torchrun).
    assert submit(tenant, gpu_count=2, env={"MASTER_PORT": "1234"}).env == {"MASTER_PORT": "1234"}


@pytest.mark.parametrize(
    "name",
    [
        "CUDA_VISIBLE_DEVICES",
        "GPUPOOL_WORKLOAD_ID",
        "LD_PRELOAD",
        "NVIDIA_VISIBLE_DEVICES",
        "PATH",
        "GPUPOOL_PORT_80",
    ],
)
def test_the_agent_takes_only_platform_names_in_platform_env(name):
    with pytest.raises(WorkloadRuleError):
        check_platform_env({name: "x"})
    assert check_platform_env({"WORLD_SIZE": "2", "GPUPOOL_PEERS": "a,b"}) == {
        "WORLD_SIZE": "2",
        "GPUPOOL_PEERS": "a,b",
    }
    with pytest.raises(WorkloadRuleError):
        check_platform_env({"WORLD_SIZE": 2})


# -- GPUs pooled across nodes ------------------------------------------------------------------------


def test_four_gpus_come_as_two_plus_two_in_one_domain_with_ranks(
    tenant, make_node, submit, cycle, django_capture_on_commit_callbacks
):
    a, b, c = make_node(gpus=2), make_node(gpus=2), make_node(gpus=2)
    for n, domain in ((a, "rack-1"), (b, "rack-2"), (c, "rack-1")):
        n.domain = domain
        n.save(update_fields=["domain"])
    with pytest.raises(ValidationFailed) as err:  # on one node only, no node has 4
        submit(tenant, gpu_count=4)
    assert "gpu_count" in err.value.fields
    w = submit(tenant, gpu_count=4, gpus_per_node=[2, 4, 8])
    cycle()
    starts = {x.node_id: x.payload for x in NodeCommand.objects.filter(payload__workload_id=str(w.pk))}
    assert set(starts) == {a.pk, c.pk}  # one domain before two
    for p in starts.values():
        assert len(p["gpu_uuids"]) == 2
        env = p["platform_env"]
        assert (env["WORLD_SIZE"], env["NNODES"], env["LOCAL_WORLD_SIZE"]) == ("4", "2", "2")
    assert sorted(p["platform_env"]["NODE_RANK"] for p in starts.values()) == ["0", "1"]
    # It runs as a gang does: when both pieces have started.
    _report(django_capture_on_commit_callbacks, w, a)
    assert reload(w).state == S.SCHEDULED
    _report(django_capture_on_commit_callbacks, w, c)
    assert reload(w).state == S.RUNNING


def test_pieces_stay_in_one_region_unless_the_request_allows_more(tenant, make_node, submit, cycle):
    make_node(gpus=2, region="us")
    make_node(gpus=2, region="eu")
    w = submit(tenant, gpu_count=4, gpus_per_node="any")
    assert reload(w).gpus_per_node == [1, 2, 3, 4, 5, 6, 7, 8]
    cycle()
    assert reload(w).state == S.QUEUED
    w2 = submit(tenant, gpu_count=4, gpus_per_node=[2], split_regions_ok=True)
    cycle()
    assert reload(w2).state == S.SCHEDULED
    assert Allocation.objects.active().filter(workload=w2).values("node__region").distinct().count() == 2


@pytest.fixture
def client(tenant, make_token, api):
    return api(make_token(tenant))


def test_the_api_takes_gpus_per_node_and_names_it_when_wrong(client, make_node):
    make_node(gpus=2)
    make_node(gpus=2)
    job = {"gpu_models": ["H100"], "image": "ghcr.io/acme/train:1", "command": ["python", "t.py"]}
    r = client.post(
        "/api/v1/jobs/", {**job, "gpu_count": 4, "gpus_per_node": [2]}, content_type="application/json"
    )
    assert r.status_code == 201, r.content
    assert r.json()["gpus_per_node"] == [2] and r.json()["split_regions_ok"] is False
    for spec, field in [
        ({"gpu_count": 4, "gpus_per_node": [3]}, "gpus_per_node"),
        ({"gpu_count": 4, "gpus_per_node": [9]}, "gpus_per_node"),
        ({"gpu_count": 4, "gpus_per_node": "some"}, "gpus_per_node"),
        ({"gpu_count": 4, "gpus_per_node": [True]}, "gpus_per_node"),
        ({"gpu_count": 16, "gang": True, "gpus_per_node": [2]}, "gpus_per_node"),
        ({"gpu_count": 2, "split_regions_ok": True}, "split_regions_ok"),
        ({"gpu_count": 4, "gpus_per_node": [2], "env": {"NODE_RANK": "0"}}, "env"),
    ]:
        r = client.post("/api/v1/jobs/", {**job, **spec}, content_type="application/json")
        assert r.status_code == 400, (spec, r.content)
        assert field in r.json()["error"]["fields"], r.json()


def test_pooled_pieces_are_preempted_together(tenant, make_node, submit, cycle):
    a, b = make_node(gpus=2), make_node(gpus=2)
    spot = submit(tenant, gpu_count=4, gpus_per_node=[2], plan="spot")
    cycle()
    assert reload(spot).state == S.SCHEDULED
    urgent = submit(tenant, gpu_count=2)
    assert cycle().preempted == [spot.pk]
    notices = NodeCommand.objects.filter(kind=CommandKind.PREEMPT_WORKLOAD, payload__workload_id=str(spot.pk))
    assert {c.node_id for c in notices} == {a.pk, b.pk}
    assert reload(urgent).pending_reason == "preempting"
