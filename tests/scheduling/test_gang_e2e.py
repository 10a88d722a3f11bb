"""End to end: a gang on two nodes, each a real agent process (``python -m nodes.agent.cli run``,
simulated GPUs, the subprocess runtime), placed by the real scheduler through the real portal.

The members' processes find rank 0 over TCP on loopback (``MASTER_ADDR``/``MASTER_PORT`` from the
start payload, both agents advertising 127.0.0.1) and agree on the world size; in the second test
rank 1 fails after the rendezvous, and the portal stops rank 0 on the other node.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodes.models import CommandKind, Node, NodeCommand, NodeState
from portal.actors import Actor
from portal.services.tenants import tenant_create
from scheduling.models import Allocation, Workload
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.submission import workload_submit
from tests.conftest import free_port
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    Portal,
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

# Every member runs this: rank 0 listens on MASTER_ADDR:MASTER_PORT, the others connect and say
# their rank and world size; rank 0 answers the world size if all agree (else -1). Each writes what
# it agreed on to $OUT_DIR; on SIGTERM a member notes it was stopped. MODE=fail: rank 1 then exits
# 3 and rank 0 waits to be stopped.
MEMBER = r"""
import os, pathlib, signal, socket, sys, time
out = pathlib.Path(os.environ["OUT_DIR"])
rank, world, nnodes = int(os.environ["NODE_RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["NNODES"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

def term(*_):
    (out / f"term-{rank}").write_text("stopped")
    sys.exit(143)

signal.signal(signal.SIGTERM, term)
if rank == 0:
    server = socket.create_server((addr, port))
    server.settimeout(60)
    seen = {0: world}
    while len(seen) < nnodes:
        conn, _ = server.accept()
        r, w = conn.makefile().readline().split()
        seen[int(r)] = int(w)
        agreed = world if set(seen.values()) == {world} else -1
        conn.sendall(f"{agreed}\n".encode())
        conn.close()
    agreed = world if set(seen.values()) == {world} else -1
else:
    for _ in range(600):
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            time.sleep(0.1)
    conn.sendall(f"{rank} {world}\n".encode())
    agreed = int(conn.makefile().readline())
    conn.close()
local = os.environ["LOCAL_WORLD_SIZE"]
(out / f"rank-{rank}").write_text(f"{agreed} {nnodes} {local} {os.environ['GPUPOOL_PEERS']}")
if os.environ.get("MODE") == "fail":
    if rank == 1:
        sys.exit(3)
    time.sleep(120)
"""


@pytest.fixture
def out_dir() -> Iterator[Path]:
    """Where the members (as the workloads' unprivileged user) write what they agreed on."""
    path = Path(tempfile.mkdtemp(prefix="gpupool-e2e-gang-"))
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def two_nodes(running_portal, tmp_path, shared_dirs) -> Iterator[list[Node]]:  # noqa: F811
    volumes, work = shared_dirs
    agents = []
    # Hostnames of their own per test: the module's database keeps the earlier tests' nodes.
    for name in (f"gang-{next(_hosts)}", f"gang-{next(_hosts)}"):
        agent = ProcessAgent(running_portal, tmp_path / name, name, f"{work}/{name}", volumes)
        with open(agent.config, "a") as handle:
            handle.write('advertise_address = "127.0.0.1"\n')
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
        # The module's database outlives the test: later tests must not place work on these.
        Node.objects.filter(pk__in=[n.pk for n in nodes]).update(state=NodeState.DOWN)


def _submit(tenant, out: Path, mode: str, **spec) -> Workload:
    spec = {
        "image": "ghcr.io/acme/train:1",
        "command": ["/usr/bin/python3", "-c", MEMBER],
        "env": {"OUT_DIR": str(out), "MODE": mode},
        "gpu_count": 2,
        "gang": True,
        **spec,
    }
    return workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())


def _state(w: Workload) -> str:
    return Workload.objects.get(pk=w.pk).state


def test_gang_members_meet_at_rank_0_and_agree_on_the_world_size(two_nodes, out_dir, settings):
    port = free_port()
    settings.SCHEDULING_GANG_PORT_RANGE = (port, port)
    tenant = tenant_create(slug="gang", name="Gang", owner_email="o@gang.test", actor=Actor.system())
    w = _submit(tenant, out_dir, "ok")
    assert scheduling_cycle_run().placed == [w.pk]
    assert set(Allocation.objects.filter(workload=w).values_list("node_id", flat=True)) == {
        n.pk for n in two_nodes
    }
    wait_for(lambda: _state(w) in (S.RUNNING, S.SUCCEEDED), 30, "the gang to run")
    wait_for(lambda: _state(w) == S.SUCCEEDED, 60, "the gang to succeed")
    for rank in (0, 1):
        assert (out_dir / f"rank-{rank}").read_text() == "2 2 1 127.0.0.1,127.0.0.1"
    assert Workload.objects.get(pk=w.pk).gang_port == port
    assert not Allocation.objects.active().filter(workload=w).exists()


def test_a_member_that_fails_stops_the_other_node(two_nodes, out_dir, settings):
    port = free_port()
    settings.SCHEDULING_GANG_PORT_RANGE = (port, port)
    tenant = tenant_create(slug="gang2", name="Gang2", owner_email="o@gang2.test", actor=Actor.system())
    w = _submit(tenant, out_dir, "fail", max_retries=0)
    assert scheduling_cycle_run().placed == [w.pk]
    assert set(Allocation.objects.filter(workload=w).values_list("node_id", flat=True)) == {
        n.pk for n in two_nodes
    }
    wait_for(lambda: (out_dir / "rank-0").exists() and (out_dir / "rank-1").exists(), 30, "the rendezvous")
    wait_for(lambda: _state(w) == S.FAILED, 30, "the gang to fail")
    assert "gang member failed" in Workload.objects.get(pk=w.pk).state_reason
    # Rank 0, on the other node, got its stop and ended.
    wait_for(lambda: (out_dir / "term-0").exists(), 30, "rank 0 to be stopped")
    rank0 = next(
        c.node_id
        for c in NodeCommand.objects.filter(kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk))
        if c.payload["platform_env"]["NODE_RANK"] == "0"
    )
    stop = NodeCommand.objects.get(
        kind=CommandKind.STOP_WORKLOAD, node_id=rank0, payload__workload_id=str(w.pk)
    )
    wait_for(lambda: NodeCommand.objects.get(pk=stop.pk).state == "succeeded", 30, "the stop to be done")
    assert not Allocation.objects.active().filter(workload=w).exists()
