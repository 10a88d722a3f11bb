"""End to end: placement constraints on three real agent processes (simulated GPUs with rack labels,
the subprocess runtime) registered with the real portal over HTTP, placed by the real scheduler.

A job with a node selector lands on the rack it names; one with anti-affinity to it by rack lands on
the other rack; a gang spread over racks takes one node of each, where packing alone would take the
two nodes of one rack.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from nodes.models import Node, NodeState
from portal.actors import Actor
from portal.services.tenants import tenant_create
from scheduling.models import Allocation, Workload
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.submission import workload_submit
from tests.conftest import free_port
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    wait_for,
)
from tests.scheduling.test_checkpoint_e2e import ProcessAgent, shared_dirs  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
_hosts = itertools.count(1)
RACKS = ("r1", "r1", "r2")


@pytest.fixture
def racked(running_portal, tmp_path, shared_dirs) -> Iterator[list[Node]]:  # noqa: F811
    volumes, work = shared_dirs
    agents = []
    for rack in RACKS:
        name = f"place-{next(_hosts)}"
        agent = ProcessAgent(running_portal, tmp_path / name, name, f"{work}/{name}", volumes)
        with open(agent.config, "a") as handle:
            handle.write(f'advertise_address = "127.0.0.1"\n[labels]\nrack = "{rack}"\n')
        agents.append(agent.start())
    nodes: list[Node] = []
    try:
        nodes = [registered(agent) for agent in agents]
        for node in nodes:
            wait_for(lambda n=node: Node.objects.get(pk=n.pk).state == NodeState.READY, what="READY nodes")
        yield nodes
    finally:
        for agent in agents:
            agent.kill()
        Node.objects.filter(pk__in=[n.pk for n in nodes]).update(state=NodeState.DOWN)


def _submit(tenant, seconds: int, **spec) -> Workload:
    spec = {
        "image": "ghcr.io/acme/train:1",
        "command": ["/usr/bin/python3", "-c", f"import time; time.sleep({seconds})"],
        "gpu_count": 1,
        **spec,
    }
    return workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())


def _nodes(w: Workload) -> set[int]:
    return set(Allocation.objects.filter(workload=w).values_list("node_id", flat=True))


def _state(w: Workload) -> str:
    return Workload.objects.get(pk=w.pk).state


def test_selector_anti_affinity_and_spread_on_real_agents(racked, settings):
    # The labels the agents registered are what the selector reads.
    assert [Node.objects.get(pk=n.pk).labels["rack"] for n in racked] == list(RACKS)
    port = free_port()
    settings.SCHEDULING_GANG_PORT_RANGE = (port, port)
    tenant = tenant_create(slug="place", name="Place", owner_email="o@place.test", actor=Actor.system())
    r2 = {racked[2].pk}
    a = _submit(tenant, 3, node_selector={"rack": "r2"})
    assert scheduling_cycle_run().placed == [a.pk]
    assert _nodes(a) == r2
    b = _submit(tenant, 3, anti_affinity={"workloads": [a.pk], "topology_key": "rack"})
    assert scheduling_cycle_run().placed == [b.pk]
    assert _nodes(b) <= {racked[0].pk, racked[1].pk} and _nodes(b)
    wait_for(lambda: _state(a) == S.SUCCEEDED and _state(b) == S.SUCCEEDED, 60, "both to succeed")
    # All three nodes free again: a two-node gang spread over racks takes one of each rack.
    g = _submit(tenant, 0, gpu_count=2, gang=True, spread={"topology_key": "rack", "max_skew": 1})
    assert scheduling_cycle_run().placed == [g.pk]
    placed = _nodes(g)
    assert len(placed) == 2 and r2 <= placed
    wait_for(lambda: _state(g) == S.SUCCEEDED, 60, "the gang to succeed")
