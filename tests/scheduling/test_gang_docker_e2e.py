"""End to end: a gang on two nodes with the docker runtime, on the real Docker Engine.

Two real agent processes (``--runtime docker``, simulated GPUs) share this machine's engine, as two
nodes of one region; the real portal and scheduler place a two-member gang on them. The nodes'
network is one the test makes (a docker bridge whose gateway is an address of this host, so no
traffic leaves the machine): both agents advertise its gateway address, which the portal hands
out as ``MASTER_ADDR`` and ``GPUPOOL_PEERS``. This machine has no NVIDIA container runtime, so the
test takes the GPU device requests out of the scheduler's start commands before the agents read
them (as ``test_proxy_e2e`` does); the rest of each command is the scheduler's.

- The members (busybox ``nc``) find rank 0 at ``MASTER_ADDR:MASTER_PORT`` over TCP and agree on
  the world size; afterwards their containers and the gang's network are gone.
- While the gang runs, its member reaches the rendezvous port and another tenant's container
  (a workload with a port, on a bridge of its own, started by the same docker runtime) does not;
  then a member fails, the portal stops the other member and both nodes remove the gang's network.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from nodes.agent.runtimes import gang_firewall
from nodes.agent.runtimes.docker import DockerRuntime
from nodes.agent.types import WorkloadSpec
from nodes.models import CommandKind, Node, NodeCommand, NodeState
from portal.actors import Actor
from portal.services.tenants import tenant_create
from scheduling.models import Allocation, Workload, WorkloadLogLine
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.submission import workload_submit
from tests.conftest import free_port
from tests.docker_engine import TEST_IMAGE, docker_engine  # noqa: F401  (fixture)
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    AgentProcess,
    _no_scheduling_cycles,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    start_agent,
    wait_for,
)

pytestmark = pytest.mark.slow
_hosts = itertools.count(1)

# Rank 0 answers NNODES-1 connections on MASTER_PORT (each peer says "rank world"; rank 0 answers
# the world size, or -1 if they differ); the others connect to MASTER_ADDR:MASTER_PORT until
# answered. Each prints what it agreed on. MODE=hold: rank 0 then keeps serving the port
# ("gang-open"), rank 1 exits 3 once /tmp/fail exists.
MEMBER = r"""
mkdir -p /tmp || exit 9
answer='read r w; echo "$r $w" >> /tmp/seen; if [ "$w" = "$WORLD_SIZE" ]; then echo $WORLD_SIZE; else echo -1; fi'
if [ "$NODE_RANK" = 0 ]; then
  n=1
  while [ "$n" -lt "$NNODES" ]; do nc -l -p "$MASTER_PORT" -e sh -c "$answer" && n=$((n+1)); done
  agreed=$WORLD_SIZE
  [ "$(wc -l < /tmp/seen)" -eq $((NNODES - 1)) ] || agreed=-1
  while read r w; do [ "$w" = "$WORLD_SIZE" ] || agreed=-1; done < /tmp/seen
else
  agreed=""
  i=0
  while [ -z "$agreed" ] && [ "$i" -lt 600 ]; do
    agreed=$(echo "$NODE_RANK $WORLD_SIZE" | nc -w 5 "$MASTER_ADDR" "$MASTER_PORT") || agreed=""
    i=$((i+1))
    [ -n "$agreed" ] || sleep 0.2
  done
fi
echo "rank $NODE_RANK agreed $agreed nnodes $NNODES local $LOCAL_WORLD_SIZE peers $GPUPOOL_PEERS"
if [ "$MODE" = hold ]; then
  [ "$NODE_RANK" = 0 ] && exec nc -ll -p "$MASTER_PORT" -e echo gang-open
  while [ ! -e /tmp/fail ]; do sleep 0.2; done
  exit 3
fi
"""


@pytest.fixture
def nodes_network(docker_engine: docker.DockerClient) -> Iterator[str]:  # noqa: F811
    """The nodes' network: a bridge of the test's own; its gateway (an address of this host) is
    the address both agents advertise. Answers that address."""
    network = None
    for attempt in range(20):
        subnet = ipaddress.ip_network(f"10.{200 + attempt}.{uuid.uuid4().int % 250}.0/24")
        try:
            network = docker_engine.networks.create(
                f"gpupool-test-nodes-{uuid.uuid4().hex[:8]}",
                driver="bridge",
                ipam=docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=str(subnet))]),
                labels={"gpupool.test": "gang-nodes"},
            )
            break
        except docker.errors.APIError:
            continue  # the subnet overlaps one in use
    assert network is not None, "no free subnet for the nodes' network"
    yield str(next(subnet.hosts()))
    network.remove()


@pytest.fixture
def gangs(docker_engine: docker.DockerClient) -> Iterator[list[int]]:  # noqa: F811
    """Gang ids whose containers and network go afterwards, whatever the test left."""
    ids: list[int] = []
    yield ids
    for wid in ids:
        for rank in (0, 1):
            with contextlib.suppress(docker.errors.NotFound):
                docker_engine.api.remove_container(f"gpupool-{wid}-rank{rank}", force=True)
            gang_firewall.remove(f"gpupool-gang-{wid}-rank{rank}")
        for network in docker_engine.networks.list(filters={"label": f"gpupool.workload_id={wid}"}):
            with contextlib.suppress(docker.errors.NotFound):
                network.remove()


@pytest.fixture
def two_docker_nodes(start_agent, nodes_network) -> Iterator[tuple[list[AgentProcess], list[Node]]]:  # noqa: F811
    """Two registered docker agents advertising the nodes' network address, stopped: each test
    edits the start commands before starting them again."""
    address = nodes_network
    # A label of this test's own, which its gang selects: the module's database keeps earlier
    # tests' nodes, and a heartbeat in flight when they were killed may have made them READY.
    group = uuid.uuid4().hex[:8]
    agents = [
        start_agent(
            f"gang-docker-{next(_hosts)}-{uuid.uuid4().hex[:4]}",
            gpus=1,
            runtime="docker",
            extra_args=(
                "--advertise-address",
                address,
                "--publish-address",
                address,
                "--label",
                f"gang={group}",
            ),
        )
        for _ in range(2)
    ]
    nodes = [registered(agent) for agent in agents]
    try:
        for node in nodes:
            wait_for(lambda n=node: Node.objects.get(pk=n.pk).state == NodeState.READY, what="READY nodes")
        for agent in agents:
            assert agent.stop() == 0
        yield agents, nodes, {"gang": group}
    finally:
        for agent in agents:
            agent.kill()
        # The module's database outlives the test: later tests must not place work on these.
        Node.objects.filter(pk__in=[n.pk for n in nodes]).update(state=NodeState.DOWN)


def _submit(tenant, mode: str, **spec: Any) -> Workload:
    spec = {
        "image": TEST_IMAGE,
        "command": ["sh", "-c", MEMBER],
        "env": {"MODE": mode},
        "gpu_count": 2,
        "gang": True,
        "cpu_millicores": 500,
        "ram_mib": 64,
        **spec,
    }
    return workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())


def _place(w: Workload, agents: list[AgentProcess], nodes: list[Node]) -> dict[str, str]:
    """Run the cycle, take the GPU device requests out of both start commands (no NVIDIA runtime
    here) and start the agents. Answers the members' rendezvous variables (rank 0's)."""
    assert scheduling_cycle_run().placed == [w.pk]
    assert set(Allocation.objects.filter(workload=w).values_list("node_id", flat=True)) == {
        n.pk for n in nodes
    }
    commands = NodeCommand.objects.filter(kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk))
    assert commands.count() == 2
    env = {}
    for command in commands:
        command.payload["gpu_uuids"] = []
        command.save(update_fields=["payload"])
        if command.payload["platform_env"]["NODE_RANK"] == "0":
            env = command.payload["platform_env"]
    for agent in agents:
        agent.start()
    return env


def _state(w: Workload) -> str:
    return Workload.objects.get(pk=w.pk).state


def _lines(w: Workload) -> list[str]:
    return list(WorkloadLogLine.objects.filter(workload=w).order_by("id").values_list("text", flat=True))


def _left_on_engine(engine: docker.DockerClient, w: Workload) -> list[str]:
    """The gang's containers and networks the engine still has."""
    label = f"gpupool.workload_id={w.pk}"
    # The low-level lists: the high-level ones inspect each item, which may go meanwhile.
    names = [c["Names"][0] for c in engine.api.containers(all=True, filters={"label": label})]
    return names + [n["Name"] for n in engine.api.networks(filters={"label": label})]


@contextlib.contextmanager
def _listener(address: str, answer: bytes) -> Iterator[int]:
    """A TCP server of the test's own on ``address`` that answers every connection ``answer``."""
    server = socket.create_server((address, 0))
    server.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        thread.join()
        server.close()


def _exec(engine: docker.DockerClient, container: str, script: str) -> tuple[int, str]:
    code, output = engine.containers.get(container).exec_run(["sh", "-c", script])
    return code, output.decode()


def test_docker_gang_members_meet_at_rank_0_and_agree_on_the_world_size(
    two_docker_nodes, nodes_network, gangs, docker_engine, settings  # noqa: F811
):  # fmt: skip
    agents, nodes, selector = two_docker_nodes
    address = nodes_network
    port = free_port()
    settings.SCHEDULING_GANG_PORT_RANGE = (port, port)
    tenant = tenant_create(slug="dgang", name="DGang", owner_email="o@dgang.test", actor=Actor.system())
    w = _submit(tenant, "ok", node_selector=selector)
    gangs.append(w.pk)
    env = _place(w, agents, nodes)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["GPUPOOL_PEERS"]) == (
        address, str(port), f"{address},{address}",
    )  # fmt: skip

    wait_for(lambda: _state(w) == S.SUCCEEDED, 120, "the gang to succeed")
    for rank in (0, 1):
        expected = f"rank {rank} agreed 2 nnodes 2 local 1 peers {address},{address}"
        wait_for(lambda e=expected: e in _lines(w), 30, f"rank {rank}'s line")
    assert not Allocation.objects.active().filter(workload=w).exists()
    # Both nodes forgot their member: containers and the gang's network are gone.
    wait_for(lambda: not _left_on_engine(docker_engine, w), 60, "the gang's containers and network to go")


def test_a_docker_gang_is_closed_to_other_tenants_and_a_failed_member_stops_it(
    two_docker_nodes, nodes_network, gangs, docker_engine, settings, tmp_path: Path  # noqa: F811
):  # fmt: skip
    agents, nodes, selector = two_docker_nodes
    address = nodes_network
    port = free_port()
    settings.SCHEDULING_GANG_PORT_RANGE = (port, port)
    tenant = tenant_create(slug="dgang2", name="DGang2", owner_email="o@dgang2.test", actor=Actor.system())
    w = _submit(tenant, "hold", max_retries=0, node_selector=selector)
    gangs.append(w.pk)
    _place(w, agents, nodes)
    wait_for(lambda: _state(w) == S.RUNNING, 120, "the gang to run")
    wait_for(lambda: sum(line.startswith("rank ") for line in _lines(w)) == 2, 60, "the rendezvous")
    rank0, rank1 = f"gpupool-{w.pk}-rank0", f"gpupool-{w.pk}-rank1"
    info = docker_engine.api.inspect_container(rank0)
    # Rank 0's rendezvous port is published on the node's address only, the same port outside.
    assert info["HostConfig"]["PortBindings"] == {f"{port}/tcp": [{"HostIp": address, "HostPort": str(port)}]}
    (network,) = docker_engine.api.networks(names=[f"gpupool-{w.pk}"])
    for name in (rank0, rank1):
        # One network for both members here, as their nodes share an engine.
        networks = docker_engine.api.inspect_container(name)["NetworkSettings"]["Networks"]
        assert [n["NetworkID"] for n in networks.values()] == [network["Id"]]
    assert network["Labels"]["gpupool.workload_id"] == str(w.pk)
    assert network["Options"]["com.docker.network.bridge.enable_icc"] == "false"

    # Each member's agent closed the port to all but the gang (rank 0 also opens it to the peers'
    # node addresses: the members' traffic arrives from there between real hosts), and the node's
    # own addresses to the gang's network.
    subnet = network["IPAM"]["Config"][0]["Subnet"]
    match = f"-m conntrack --ctorigdst {address} --ctorigdstport {port}"
    for rank, sources in ((0, {subnet, f"{address}/32"}), (1, {subnet})):
        rules = gang_firewall.listed(f"gpupool-gang-{w.pk}-rank{rank}")
        accepted = {r.split()[3] for r in rules if r.endswith("-j RETURN") and match in r}
        assert accepted == sources, rules
        assert rules[-2].endswith("-j DROP") and match in rules[-2], rules
        assert rules[-1].startswith(f"-A GPUPOOL-GANGS -s {subnet} -m addrtype --dst-type LOCAL"), rules

    # Positive control: the gang's member reaches the rendezvous port at MASTER_ADDR.
    probe = f"nc -w 3 {address} {port} </dev/null"
    code, output = _exec(docker_engine, rank1, probe)
    assert "gang-open" in output, (code, output)

    # Another tenant's workload on the same engine: a bridge of its own (it asked for a port),
    # started by the docker runtime as its node's agent would. It reaches this host's address on
    # the nodes' network (a listener of the test's own there answers), but not the gang's port.
    other = DockerRuntime(tmp_path / "other-tenant", node_gpus=1)
    other_id = f"t{uuid.uuid4().hex[:10]}"
    try:
        other.start(
            WorkloadSpec(
                other_id, image=TEST_IMAGE, command=["sleep", "60"], cpu_millicores=500, ram_mib=64,
                ports=[8080],
            )
        )  # fmt: skip
        with _listener(address, b"host-open\n") as control_port:
            code, output = _exec(docker_engine, f"gpupool-{other_id}", f"nc -w 3 {address} {control_port}")
            assert "host-open" in output, (code, output)
            # The gang's members reach nothing of the node but the rendezvous port (the agent's SSH
            # endpoint, the portal here, anything else listening there).
            for member in (rank0, rank1):
                code, output = _exec(docker_engine, member, f"nc -w 3 {address} {control_port} </dev/null")
                assert "host-open" not in output, (member, code, output)
        code, output = _exec(docker_engine, f"gpupool-{other_id}", probe)
        assert "gang-open" not in output, (code, output)
        assert code != 0, (code, output)
    finally:
        other.stop(other_id, grace_s=0)
        other.forget(other_id)
        other.close()

    # A member fails: the portal fails the gang, stops rank 0 on the other node, and both nodes
    # remove their member and the gang's network.
    code, output = _exec(docker_engine, rank1, "touch /tmp/fail")
    assert code == 0, output
    wait_for(lambda: _state(w) == S.FAILED, 60, "the gang to fail")
    assert "gang member failed" in Workload.objects.get(pk=w.pk).state_reason
    node0 = next(
        c.node_id
        for c in NodeCommand.objects.filter(kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk))
        if c.payload["platform_env"]["NODE_RANK"] == "0"
    )
    stop = NodeCommand.objects.get(
        kind=CommandKind.STOP_WORKLOAD, node_id=node0, payload__workload_id=str(w.pk)
    )
    wait_for(lambda: NodeCommand.objects.get(pk=stop.pk).state == "succeeded", 60, "rank 0's stop to be done")
    assert not Allocation.objects.active().filter(workload=w).exists()
    wait_for(lambda: not _left_on_engine(docker_engine, w), 60, "the gang's containers and network to go")
    assert not gang_firewall.listed(f"gpupool-gang-{w.pk}-rank0")
    assert not gang_firewall.listed(f"gpupool-gang-{w.pk}-rank1")
