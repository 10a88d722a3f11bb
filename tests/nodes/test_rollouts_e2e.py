"""End to end: rolling upgrades over three real agent processes (``python -m nodes.agent.cli run``,
simulated GPUs) and the real portal over HTTP. Staff start the campaigns through the staff API with a
staff token; the advance step runs here as beat runs it.

Each agent's configuration names two upgrades: ``driver-560`` writes a marker file on the node (the
proof that the agent ran the configured command), ``broken`` exits 3. The first campaign upgrades the
three nodes one at a time and returns them; the second stops at its first node, which stays drained,
and leaves the other two alone. A third campaign names an upgrade no agent has, which the agent
refuses.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nodes.models import (
    CommandKind,
    Node,
    NodeCommand,
    NodeState,
    RolloutCampaign,
    RolloutState,
    RolloutStep,
)
from nodes.services.rollouts import rollout_advance
from portal.actors import Actor
from portal.models import AuditEvent, StaffScope, User
from portal.staff_tokens import staff_token_create
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    AgentProcess,
    Portal,
    _no_scheduling_cycles,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _advance_here(settings):
    settings.ROLLOUT_ADVANCE_ON_COMMIT = False  # the test runs the advance step itself


@pytest.fixture
def fleet(running_portal: Portal, tmp_path: Path) -> Iterator[list[AgentProcess]]:  # noqa: F811
    agents = []
    for i in range(3):
        hostname = f"e2e-roll-{i}"
        agent = AgentProcess(
            running_portal, tmp_path / hostname, hostname, 1, extra_args=("--label", "pool=roll")
        )
        marker = tmp_path / f"{hostname}.upgraded"
        upgrades = {
            "driver-560": ["/bin/sh", "-c", f'echo "$GPUPOOL_UPGRADE" > {marker}'],
            "broken": ["/bin/sh", "-c", "echo dkms build failed; exit 3"],
        }
        agent.config.write_text(
            agent.config.read_text()
            + "\n[upgrades]\n"
            + "".join(f"{name} = {json.dumps(argv)}\n" for name, argv in upgrades.items())
        )
        agent.marker = marker
        agents.append(agent.start())
    try:
        for agent in agents:
            wait_for(lambda a=agent: (n := a.node) is not None and n.last_heartbeat_at, what="a heartbeat")
        yield agents
    finally:
        for agent in agents:
            agent.kill()


def run_until(campaign_id: int, states: set[str], timeout: float = 60.0) -> RolloutCampaign:
    """Advance as beat would (every 0.2 s here) until the campaign reaches one of ``states``."""
    deadline = time.monotonic() + timeout
    while True:
        rollout_advance()
        campaign = RolloutCampaign.objects.get(pk=campaign_id)
        if (
            campaign.state in states
            and not campaign.steps.filter(state__in=("draining", "upgrading", "checking")).exists()
        ):
            return campaign
        if time.monotonic() > deadline:
            steps = list(campaign.steps.values_list("node__hostname", "state", "message"))
            raise AssertionError(f"campaign {campaign_id} is {campaign.state}: {steps}")
        time.sleep(0.2)


@pytest.fixture
def staff_api(running_portal) -> Iterator[httpx.Client]:  # noqa: F811
    """The staff API over real HTTP with a fleet:write token (closed after the test: a client left
    to the garbage collector leaves its socket unclosed, a ResourceWarning in a later test)."""
    staff = User.objects.create_user(email="ops-e2e@gpupool.example", password="x", is_staff=True)
    _, token = staff_token_create(
        user=staff, name="rollout", scopes=[StaffScope.FLEET_WRITE], actor=Actor(user=staff)
    )
    with httpx.Client(
        base_url=running_portal.url, headers={"Authorization": f"Bearer {token}"}, timeout=10
    ) as api:
        yield api


def test_a_campaign_upgrades_three_nodes_one_by_one_and_a_failing_one_stops(fleet, staff_api):
    api = staff_api
    body = {
        "name": "driver 560",
        "upgrade": "driver-560",
        "label": "pool=roll",
        "batch_size": 1,
        "max_region_share": "1",
        "drain_deadline_s": 30,
        "step_timeout_s": 30,
    }
    created = api.post("/api/staff/v1/rollouts/", json=body)
    assert created.status_code == 201, created.text
    campaign = run_until(created.json()["id"], {RolloutState.COMPLETED, RolloutState.FAILED})
    assert campaign.state == RolloutState.COMPLETED, campaign.state_reason

    # One node at a time, each drained, upgraded by its own configured command, checked, returned.
    steps = list(RolloutStep.objects.filter(campaign=campaign).select_related("node").order_by("position"))
    assert [s.batch for s in steps] == [1, 2, 3] and {s.state for s in steps} == {"returned"}
    for earlier, later in itertools.pairwise(steps):
        assert earlier.finished_at <= later.drain_started_at
    for agent in fleet:
        assert agent.marker.read_text().strip() == "driver-560"
        node = Node.objects.get(hostname=agent.hostname)
        assert node.state == NodeState.READY
        kinds = [
            c.kind
            for c in NodeCommand.objects.filter(node=node).order_by("created_at")
            if c.kind != "stop_workload"
        ]
        assert kinds == ["drain", "upgrade", "gpu_check", "undrain"]
        wait_for(
            lambda n=node: (
                set(NodeCommand.objects.filter(node=n).values_list("state", flat=True)) == {"succeeded"}
            ),
            what=f"{node.hostname}'s commands to succeed",
        )
        check = NodeCommand.objects.get(node=node, kind=CommandKind.GPU_CHECK)
        assert check.result["gpus"] == 1
    # The agents take work again: undrain cleared their draining flag (their heartbeats say so).
    wait_for(
        lambda: all(not Node.objects.get(hostname=a.hostname).status.get("draining") for a in fleet),
        what="the agents to report they take work",
    )
    detail = api.get(f"/api/staff/v1/rollouts/{campaign.pk}/").json()
    assert detail["state"] == "completed" and detail["progress"]["returned"] == 3

    # The second campaign's upgrade exits 3 on its first node: the campaign stops there.
    failing = api.post("/api/staff/v1/rollouts/", json={**body, "name": "broken", "upgrade": "broken"})
    assert failing.status_code == 201, failing.text
    stopped = run_until(failing.json()["id"], {RolloutState.FAILED, RolloutState.COMPLETED})
    assert stopped.state == RolloutState.FAILED
    first = fleet[0].hostname
    assert stopped.state_reason.startswith(f"{first}: upgrade failed: upgrade broken exited with 3")
    assert "dkms build failed" in stopped.state_reason
    assert list(stopped.steps.order_by("position").values_list("state", flat=True)) == [
        "failed", "cancelled", "cancelled",
    ]  # fmt: skip
    assert Node.objects.get(hostname=first).state == NodeState.DRAINING
    for agent in fleet[1:]:
        node = Node.objects.get(hostname=agent.hostname)
        assert node.state == NodeState.READY
        assert not NodeCommand.objects.filter(
            node=node, kind=CommandKind.UPGRADE, payload__upgrade="broken"
        ).exists()
    assert AuditEvent.objects.filter(action="rollout.fail", target_id=str(stopped.pk)).exists()

    # An upgrade the agents were never configured with is refused by the agent itself.
    unknown = api.post(
        "/api/staff/v1/rollouts/",
        json={
            **body,
            "name": "unknown",
            "upgrade": "rm-everything",
            "label": "pool=roll",
            "max_region_share": "1",
        },
    )
    assert unknown.status_code == 201, unknown.text
    refused = run_until(unknown.json()["id"], {RolloutState.FAILED, RolloutState.COMPLETED})
    assert refused.state == RolloutState.FAILED
    assert "no upgrade 'rm-everything' is configured on this node" in refused.state_reason

    # A GPU that fell off the bus: the upgrade runs, the GPU check fails, the node stays drained.
    last = fleet[2]
    (last.state_dir / "faults.json").write_text(json.dumps([{"gpu": 0, "kind": "fell_off_bus"}]))
    checked = api.post("/api/staff/v1/rollouts/", json={**body, "name": "after a fault"})
    assert checked.status_code == 201, checked.text
    failed_check = run_until(checked.json()["id"], {RolloutState.FAILED, RolloutState.COMPLETED})
    assert failed_check.state == RolloutState.FAILED
    assert failed_check.state_reason.startswith(f"{last.hostname}: GPU check failed: GPU ")
    assert "fell off the bus" in failed_check.state_reason
    assert Node.objects.get(hostname=last.hostname).state == NodeState.DRAINING
