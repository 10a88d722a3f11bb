"""Rolling upgrades through the services: batches within a region's share, drain, upgrade, GPU check
and return, the first failure stopping the campaign, pause, resume and abort, and the audit rows.
The agent's side is played by reports through ``node_command_report`` (the end-to-end test in
``test_rollouts_e2e.py`` has real agents)."""

from __future__ import annotations

import itertools
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from nodes.models import (
    CommandKind,
    Node,
    NodeCommand,
    NodeState,
    Region,
    RolloutCampaign,
    RolloutState,
    RolloutStep,
    RolloutStepState,
)
from nodes.services import rollouts
from nodes.services.commands import node_command_report
from nodes.services.health import node_cordon, node_drain, node_uncordon
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.models import AuditEvent, User

H100 = "NVIDIA H100 SXM 80GB"
A100 = "NVIDIA A100 SXM 80GB"
_seq = itertools.count(1)


@pytest.fixture(autouse=True)
def _no_advance_tasks(settings):
    settings.ROLLOUT_ADVANCE_ON_COMMIT = False


@pytest.fixture
def staff(db) -> Actor:
    user = User.objects.create_user(email=f"ops{next(_seq)}@gpupool.example", password="x", is_staff=True)
    return Actor(user=user)


def spec(**overrides):
    data = {
        "name": "driver 560",
        "upgrade": "driver-560",
        "region": "us-east-1",
        "batch_size": 1,
        "max_region_share": "0.5",
        "drain_deadline_s": 600,
    }
    data.update(overrides)
    return {k: v for k, v in data.items() if v is not None}


def steps(campaign) -> list[str]:
    return list(
        RolloutStep.objects.filter(campaign=campaign).order_by("position").values_list("state", flat=True)
    )


def command_of(step: RolloutStep) -> NodeCommand:
    return NodeCommand.objects.get(pk=RolloutStep.objects.get(pk=step.pk).command_id)


def finish(step: RolloutStep, status: str = "succeeded", message: str = "", result=None) -> NodeCommand:
    """The agent reports the step's current command."""
    command = command_of(step)
    node_command_report(node_id=command.node_id, command_id=command.pk, status="accepted")
    node_command_report(
        node_id=command.node_id, command_id=command.pk, status=status, message=message, result=result or {}
    )
    return command


def active(campaign, state) -> list[RolloutStep]:
    return list(RolloutStep.objects.filter(campaign=campaign, state=state).order_by("position"))


# --- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": "two"}, "batch_size"),
        ({"batch_size": None}, "batch_size"),
        ({"max_region_share": "0"}, "max_region_share"),
        ({"max_region_share": "150%"}, "max_region_share"),
        ({"max_region_share": "NaN"}, "max_region_share"),
        ({"max_region_share": [1]}, "max_region_share"),
        ({"upgrade": "apt-get upgrade -y"}, "upgrade"),
        ({"upgrade": "../../bin/sh"}, "upgrade"),
        ({"upgrade": None}, "upgrade"),
        ({"name": ""}, "name"),
        ({"region": "mars-1"}, "region"),
        ({"gpu_model": "Voodoo 2"}, "gpu_model"),
        ({"label": "no-equals-sign"}, "label"),
        ({"drain_deadline_s": -1}, "drain_deadline_s"),
        ({"step_timeout_s": 1}, "step_timeout_s"),
        ({"command": ["/bin/sh"]}, "command"),
        ({"region": None}, "region"),  # no selector at all
        ({"region": "eu-west-1"}, "region"),  # no node matches
        ({"max_region_share": "0.1"}, "max_region_share"),  # less than one of the region's 4 nodes
    ],
)
def test_a_bad_campaign_is_refused_naming_its_field(make_nodes, staff, overrides, field):
    make_nodes(4)
    Region.objects.create(code="eu-west-1", name="EU")
    with pytest.raises(ValidationFailed) as refused:
        rollouts.rollout_start(data=spec(**overrides), actor=staff)
    assert field in refused.value.fields
    assert not RolloutCampaign.objects.exists() and not RolloutStep.objects.exists()


def test_the_selector_chooses_ready_nodes_by_model_region_and_label(make_nodes, staff):
    us_h100 = make_nodes(2, labels={"pool": "a"})
    make_nodes(1, model=A100, labels={"pool": "a"})
    make_nodes(2, region="eu-west-1", labels={"pool": "a"})
    make_nodes(1, labels={"pool": "b"})
    node_cordon(node=us_h100[1], actor=staff)  # not ready: left out
    campaign = rollouts.rollout_start(
        data=spec(gpu_model=H100, label="pool=a", max_region_share="1"), actor=staff
    )
    assert list(campaign.steps.values_list("node_id", flat=True)) == [us_h100[0].pk]
    # An open campaign holds its nodes: a second one over them finds none.
    with pytest.raises(ValidationFailed):
        rollouts.rollout_start(data=spec(gpu_model=H100, label="pool=a", max_region_share="1"), actor=staff)
    by_label = rollouts.rollout_start(
        data=spec(region=None, label="pool=a", max_region_share="1"), actor=staff
    )
    assert by_label.steps.count() == 3  # the A100 and the two in eu-west-1
    assert AuditEvent.objects.filter(action="rollout.start").count() == 2


# --- the flow -----------------------------------------------------------------------------------------


def test_batches_respect_the_region_share_and_each_node_is_upgraded_checked_and_returned(make_nodes, staff):
    nodes = make_nodes(4)
    campaign = rollouts.rollout_start(data=spec(batch_size=3, max_region_share="50%"), actor=staff)
    assert campaign.max_region_share == Decimal("0.500") and campaign.state == RolloutState.RUNNING

    rollouts.rollout_advance()
    # Batch 1: three asked, but only half the region's 4 nodes may be out at once.
    assert steps(campaign) == ["draining", "draining", "pending", "pending"]
    assert [Node.objects.get(pk=n.pk).state for n in nodes] == ["draining", "draining", "ready", "ready"]
    drains = NodeCommand.objects.filter(kind=CommandKind.DRAIN).values_list("node_id", flat=True)
    assert sorted(drains) == sorted([nodes[0].pk, nodes[1].pk])
    assert AuditEvent.objects.filter(action="node.rollout_drain").count() == 2

    rollouts.rollout_advance()  # nothing runs on them: upgrade
    first, second = active(campaign, RolloutStepState.UPGRADING)
    upgrade = command_of(first)
    assert upgrade.kind == CommandKind.UPGRADE
    assert upgrade.payload == {"upgrade": "driver-560", "timeout_s": campaign.step_timeout_s}

    finish(first)
    rollouts.rollout_advance()
    assert steps(campaign)[:2] == ["checking", "upgrading"]
    assert command_of(first).kind == CommandKind.GPU_CHECK
    finish(first, result={"gpus": 1})
    finish(second)
    rollouts.rollout_advance()
    assert steps(campaign)[:2] == ["returned", "checking"]
    assert Node.objects.get(pk=nodes[0].pk).state == NodeState.READY
    assert NodeCommand.objects.filter(kind=CommandKind.UNDRAIN, node=nodes[0]).count() == 1
    assert steps(campaign)[2:] == ["pending", "pending"]  # the batch is not over yet

    finish(second)
    rollouts.rollout_advance()  # batch 1 returns, and batch 2 starts in the same run
    assert steps(campaign) == ["returned", "returned", "draining", "draining"]
    assert list(campaign.steps.values_list("batch", flat=True)) == [1, 1, 2, 2]
    for _ in range(2):
        rollouts.rollout_advance()
        for step in active(campaign, RolloutStepState.UPGRADING) + active(
            campaign, RolloutStepState.CHECKING
        ):
            finish(step)
    rollouts.rollout_advance()
    rollouts.rollout_advance()
    campaign.refresh_from_db()
    assert campaign.state == RolloutState.COMPLETED and campaign.finished_at is not None
    assert set(Node.objects.values_list("state", flat=True)) == {NodeState.READY}
    assert AuditEvent.objects.filter(action="rollout.completed", target_id=str(campaign.pk)).exists()


def test_a_region_with_nodes_out_for_other_reasons_waits(make_nodes, staff):
    nodes = make_nodes(4)
    campaign = rollouts.rollout_start(
        data=spec(max_region_share="0.25", region=None, gpu_model=H100), actor=staff
    )
    node_cordon(node=nodes[3], actor=staff)  # one of four out already: the share is used up
    rollouts.rollout_advance()
    campaign.refresh_from_db()
    assert set(steps(campaign)) == {"pending"}
    assert "1 of 4 nodes out" in campaign.state_reason
    node_uncordon(node=nodes[3], actor=staff)
    rollouts.rollout_advance()
    assert steps(campaign) == ["draining", "pending", "pending", "pending"]


def test_the_first_failure_stops_the_campaign_and_leaves_the_node_drained(make_nodes, staff):
    nodes = make_nodes(3)
    campaign = rollouts.rollout_start(data=spec(batch_size=2, max_region_share="1"), actor=staff)
    rollouts.rollout_advance()
    rollouts.rollout_advance()
    first, second = active(campaign, RolloutStepState.UPGRADING)
    finish(first, status="failed", message="upgrade driver-560 exited with 3: dkms build failed")
    rollouts.rollout_advance()

    campaign.refresh_from_db()
    assert campaign.state == RolloutState.FAILED
    assert campaign.state_reason.startswith(
        f"{nodes[0].hostname}: upgrade failed: upgrade driver-560 exited with 3"
    )
    assert steps(campaign) == ["failed", "upgrading", "cancelled"]
    failed = Node.objects.get(pk=nodes[0].pk)
    assert failed.state == NodeState.DRAINING and "failed" in failed.state_reason
    assert Node.objects.get(pk=nodes[2].pk).state == NodeState.READY  # never touched
    assert AuditEvent.objects.filter(action="rollout.fail", target_id=str(campaign.pk)).exists()

    # The node whose upgrade had started finishes it, and comes back.
    finish(second)
    rollouts.rollout_advance()
    finish(second)
    rollouts.rollout_advance()
    assert steps(campaign) == ["failed", "returned", "cancelled"]
    assert Node.objects.get(pk=nodes[1].pk).state == NodeState.READY
    assert not NodeCommand.objects.filter(node=nodes[2]).exists()
    with pytest.raises(Conflict):
        rollouts.rollout_resume(campaign=campaign, actor=staff)


def test_a_failed_gpu_check_or_an_upgrade_without_an_answer_fails(make_nodes, staff):
    make_nodes(2)
    campaign = rollouts.rollout_start(data=spec(max_region_share="1", step_timeout_s=60), actor=staff)
    rollouts.rollout_advance()
    rollouts.rollout_advance()
    (step,) = active(campaign, RolloutStepState.UPGRADING)
    finish(step)
    rollouts.rollout_advance()
    finish(step, status="failed", message="GPU check failed: GPU GPU-1 fell off the bus")
    rollouts.rollout_advance()
    campaign.refresh_from_db()
    assert campaign.state == RolloutState.FAILED and "fell off the bus" in campaign.state_reason

    other = rollouts.rollout_start(data=spec(max_region_share="1", step_timeout_s=60), actor=staff)
    rollouts.rollout_advance()
    rollouts.rollout_advance()
    (step,) = active(other, RolloutStepState.UPGRADING)
    rollouts.rollout_advance(now=timezone.now() + timedelta(seconds=61))  # the agent never answers
    other.refresh_from_db()
    assert other.state == RolloutState.FAILED and "no result within 60 s" in other.state_reason


def test_pause_resume_and_abort_are_audited_and_abort_returns_draining_nodes(make_nodes, staff):
    nodes = make_nodes(3)
    campaign = rollouts.rollout_start(data=spec(max_region_share="1"), actor=staff)
    rollouts.rollout_pause(campaign=campaign, actor=staff, reason="holiday")
    rollouts.rollout_advance()
    assert set(steps(campaign)) == {"pending"}  # paused: nothing starts
    with pytest.raises(Conflict):
        rollouts.rollout_pause(campaign=campaign, actor=staff)
    rollouts.rollout_resume(campaign=campaign, actor=staff)
    rollouts.rollout_advance()
    assert steps(campaign) == ["draining", "pending", "pending"]

    rollouts.rollout_abort(campaign=campaign, actor=staff)
    campaign.refresh_from_db()
    assert campaign.state == RolloutState.ABORTED and campaign.finished_at
    assert steps(campaign) == ["cancelled", "cancelled", "cancelled"]
    assert Node.objects.get(pk=nodes[0].pk).state == NodeState.READY
    assert NodeCommand.objects.filter(kind=CommandKind.UNDRAIN, node=nodes[0]).exists()
    rollouts.rollout_advance()
    assert not NodeCommand.objects.filter(kind=CommandKind.UPGRADE).exists()
    actions = list(
        AuditEvent.objects.filter(target_id=str(campaign.pk), action__startswith="rollout.")
        .order_by("id")
        .values_list("action", "actor_user__email")
    )
    email = staff.user.email
    assert actions == [
        ("rollout.start", email), ("rollout.pause", email), ("rollout.resume", email), ("rollout.abort", email),
    ]  # fmt: skip
    with pytest.raises(Conflict):
        rollouts.rollout_abort(campaign=campaign, actor=staff)


def test_a_draining_node_waits_for_its_work_and_gets_notice_then_the_final_notice(
    make_nodes, staff, settings
):
    nodes = make_nodes(1)
    work = {nodes[0].pk: 2}
    notices: list[dict] = []

    def notice(**kwargs):
        notices.append(kwargs)
        return 1

    saved = list(rollouts._hooks)
    rollouts.rollout_drain_register(work=lambda ids: {i: work[i] for i in ids if work.get(i)}, notice=notice)
    try:
        campaign = rollouts.rollout_start(data=spec(max_region_share="1", drain_deadline_s=300), actor=staff)
        rollouts.rollout_advance()
        (step,) = active(campaign, RolloutStepState.DRAINING)
        assert [n["final"] for n in notices] == [False] and notices[0]["node_id"] == nodes[0].pk
        rollouts.rollout_advance()
        assert steps(campaign) == ["draining"] and len(notices) == 1  # told once
        assert RolloutStep.objects.get(pk=step.pk).message == "Draining: 2 workload(s) left."
        later = timezone.now() + timedelta(seconds=301)
        rollouts.rollout_advance(now=later)
        assert [n["final"] for n in notices] == [False, True]
        rollouts.rollout_advance(now=later)
        assert len(notices) == 2
        too_late = later + timedelta(seconds=settings.ROLLOUT_DRAIN_GRACE_S)
        rollouts.rollout_advance(now=too_late)
        campaign.refresh_from_db()
        assert (
            campaign.state == RolloutState.FAILED
            and "2 workload(s) still on the node" in campaign.state_reason
        )
    finally:
        rollouts._hooks[:] = saved


def test_staff_uncordon_tells_the_agent_to_take_work_again(make_nodes, staff):
    (node,) = make_nodes(1)
    node_drain(node=node, actor=staff)
    node_uncordon(node=node, actor=staff)
    kinds = list(NodeCommand.objects.filter(node=node).order_by("created_at").values_list("kind", flat=True))
    assert kinds == [CommandKind.DRAIN, CommandKind.UNDRAIN]


def test_advance_is_single_flight(make_nodes, staff, transactional_db):
    """A second advance while one holds the lock returns at once (PostgreSQL's advisory lock)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("SQLite serialises writers instead")
    import threading

    from django.db import connections

    make_nodes(1)
    rollouts.rollout_start(data=spec(max_region_share="1"), actor=staff)
    held = threading.Event()
    release = threading.Event()

    def hold():
        try:
            assert rollouts._try_advance_lock()
            held.set()
            release.wait(10)
            rollouts._release_advance_lock()
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    try:
        assert rollouts.rollout_advance() == {"campaigns": 0, "skipped": 1}
    finally:
        release.set()
        thread.join()
    assert rollouts.rollout_advance()["campaigns"] == 1
