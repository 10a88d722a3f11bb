"""End to end: a gang whose members have addresses of their own on the region's gang network, on
the real Docker Engine, with two real agents and the real portal and scheduler.

The nodes' data network is an interface the test makes on this machine (one end of a veth pair,
with an address of the host's on it; the other end in an empty network namespace: this kernel
has no dummy interfaces): the agents' ``gang_parent``, so the engine's macvlan network sits on
it and no frame leaves the machine (macvlan children of one parent meet in its bridge mode). The region gets a gang network (the dummy's subnet, a range for members);
the portal hands each member an address there, and names those in ``MASTER_ADDR`` and
``GPUPOOL_PEERS``. As in ``test_gang_docker_e2e``, the GPU device requests are taken out of the
start commands (no NVIDIA runtime here), and the sandbox image is the local busybox one.

- the members meet at rank 0's own address (the rendezvous), and rank 0 reaches rank 1's own
  address too (the direction of NCCL's and Gloo's connections after it);
- another container on the same gang network (another tenant's member, any host of the data
  network) reaches a listener of the test's there, but neither member; the members reach neither
  that listener nor the node's own address on the data network, which a container on a bridge
  reaches;
- a member fails: the portal stops the other; containers, sandboxes and addresses are gone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from nodes.agent.runtimes import gang_network
from nodes.agent.runtimes.docker import DockerRuntime
from nodes.agent.types import WorkloadSpec
from nodes.models import CommandKind, Node, NodeCommand, NodeState, Region
from portal.actors import Actor
from portal.services.tenants import tenant_create
from scheduling.models import Allocation, GangAddress, Workload, WorkloadLogLine
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
from tests.scheduling.test_gang_docker_e2e import _exec, _listener

pytestmark = pytest.mark.slow
RANK1_PORT = 29501

# The rendezvous of test_gang_docker_e2e (rank 1 finds rank 0 at MASTER_ADDR:MASTER_PORT and they
# agree on the world size), then: rank 0 keeps serving MASTER_PORT ("gang-open"), rank 1 serves
# RANK1_PORT ("rank1-open") and exits 3 once /tmp/fail exists.
MEMBER = r"""
mkdir -p /tmp || exit 9
answer='read r w; if [ "$w" = "$WORLD_SIZE" ]; then echo $WORLD_SIZE; else echo -1; fi'
if [ "$NODE_RANK" = 0 ]; then
  nc -l -p "$MASTER_PORT" -e sh -c "$answer"
  agreed=$WORLD_SIZE
else
  agreed=""
  i=0
  while [ -z "$agreed" ] && [ "$i" -lt 600 ]; do
    agreed=$(echo "$NODE_RANK $WORLD_SIZE" | nc -w 5 "$MASTER_ADDR" "$MASTER_PORT") || agreed=""
    i=$((i+1))
    [ -n "$agreed" ] || sleep 0.2
  done
fi
echo "rank $NODE_RANK agreed $agreed master $MASTER_ADDR peers $GPUPOOL_PEERS"
[ "$NODE_RANK" = 0 ] && exec nc -ll -p "$MASTER_PORT" -e echo gang-open
nc -ll -p RANK1_PORT -e echo rank1-open &
while [ ! -e /tmp/fail ]; do sleep 0.2; done
exit 3
""".replace("RANK1_PORT", str(RANK1_PORT))


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)


def _drop_gang_network(engine: docker.DockerClient) -> None:
    for net in engine.api.networks(names=[gang_network.NETWORK_NAME]):
        info = engine.api.inspect_network(net["Id"])
        for container in info.get("Containers") or {}:
            with contextlib.suppress(docker.errors.NotFound):
                engine.api.remove_container(container, force=True)
        with contextlib.suppress(docker.errors.NotFound):
            engine.api.remove_network(net["Id"])


@pytest.fixture
def data_network(docker_engine: docker.DockerClient) -> Iterator[dict[str, Any]]:  # noqa: F811
    """The nodes' data network: a dummy interface with the host's address on it, and the region's
    gang network on its subnet (the range: the subnet's upper quarter). Answers its facts."""
    _drop_gang_network(docker_engine)  # an earlier run's, made on another dummy
    tag = uuid.uuid4().hex[:8]
    name, wire = f"gpn{tag}", f"gpn{tag}w"
    subnet = ipaddress.ip_network(f"10.{120 + uuid.uuid4().int % 60}.{uuid.uuid4().int % 250}.0/24")
    hosts = list(subnet.hosts())
    # The node's interface on the data network, and the wire's other end in a namespace of its own
    # with nothing on it (this kernel has no dummy interfaces): frames leaving go nowhere.
    _ip("netns", "add", name)
    _ip("link", "add", name, "type", "veth", "peer", "name", wire)
    region = Region.objects.get(code="e2e-1")
    try:
        _ip("link", "set", wire, "netns", name)
        _ip("-n", name, "link", "set", wire, "up")
        _ip("addr", "add", f"{hosts[1]}/{subnet.prefixlen}", "dev", name)
        _ip("link", "set", name, "up")
        region.gang_subnet, region.gang_range = str(subnet), str(list(subnet.subnets(new_prefix=26))[3])
        region.gang_gateway = None
        region.full_clean()
        region.save()
        yield {
            "parent": name,
            "subnet": subnet,
            "range": ipaddress.ip_network(region.gang_range),
            "host": str(hosts[1]),
        }
    finally:
        Region.objects.filter(pk=region.pk).update(gang_subnet="", gang_range="", gang_gateway=None)
        _drop_gang_network(docker_engine)
        _ip("link", "del", name)
        _ip("netns", "del", name)


@pytest.fixture
def two_gang_nodes(start_agent, data_network) -> Iterator[tuple[list[AgentProcess], list[Node], dict]]:  # noqa: F811
    """Two registered docker agents on the data network (``--gang-parent``), stopped once the portal
    knows they can join the gang network: the test edits the start commands first."""
    group = uuid.uuid4().hex[:8]
    options = ("--gang-parent", data_network["parent"], "--gang-sandbox-image", TEST_IMAGE)
    options += ("--gang-sandbox-command", "sleep 2147483647", "--label", f"gang={group}")
    agents = [
        start_agent(f"gangnet-{k}-{uuid.uuid4().hex[:4]}", gpus=1, runtime="docker", extra_args=options)
        for k in range(2)
    ]
    nodes = [registered(agent) for agent in agents]
    try:
        for node in nodes:
            wait_for(
                lambda n=node: (
                    (x := Node.objects.get(pk=n.pk)).state == NodeState.READY
                    and x.status.get("gang_network") is True
                ),
                what="READY nodes that can join the gang network",
            )
        for agent in agents:
            assert agent.stop() == 0
        yield agents, nodes, {"gang": group}
    finally:
        for agent in agents:
            agent.kill()
        Node.objects.filter(pk__in=[n.pk for n in nodes]).update(state=NodeState.DOWN)


@pytest.fixture
def gang_ids(docker_engine: docker.DockerClient) -> Iterator[list[int]]:  # noqa: F811
    ids: list[int] = []
    yield ids
    for wid in ids:
        for container in docker_engine.api.containers(
            all=True, filters={"label": f"gpupool.workload_id={wid}"}
        ):
            with contextlib.suppress(docker.errors.NotFound):
                docker_engine.api.remove_container(container["Id"], force=True)


def _lines(w: Workload) -> list[str]:
    return list(WorkloadLogLine.objects.filter(workload=w).order_by("id").values_list("text", flat=True))


def _reach(engine: docker.DockerClient, container: str, address: str, port: int) -> str:
    _code, output = _exec(engine, container, f"nc -w 3 {address} {port} </dev/null")
    return output


def test_gang_members_reach_each_other_at_their_own_addresses_and_nobody_else_does(
    two_gang_nodes, data_network, gang_ids, docker_engine, settings, tmp_path: Path  # noqa: F811
):  # fmt: skip
    agents, _nodes, selector = two_gang_nodes
    port = free_port()
    settings.SCHEDULING_GANG_PORT_RANGE = (port, port)
    tenant = tenant_create(slug="gnet", name="GNet", owner_email="o@gnet.test", actor=Actor.system())
    w = workload_submit(
        tenant=tenant,
        kind="job",
        spec={
            "image": TEST_IMAGE, "command": ["sh", "-c", MEMBER], "gpu_count": 2, "gang": True,
            "cpu_millicores": 500, "ram_mib": 64, "max_retries": 0, "node_selector": selector,
        },
        actor=Actor.system(),
    )  # fmt: skip
    gang_ids.append(w.pk)
    assert scheduling_cycle_run().placed == [w.pk]
    commands = list(
        NodeCommand.objects.filter(kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk))
    )
    assert len(commands) == 2
    own: dict[int, str] = {}
    for command in commands:
        command.payload["gpu_uuids"] = []  # no NVIDIA runtime here
        command.save(update_fields=["payload"])
        own[int(command.payload["platform_env"]["NODE_RANK"])] = command.payload["gang_network"]["address"]
    # The portal's addresses: two of the range, held in the database, named in the rendezvous.
    assert {ipaddress.ip_address(a) in data_network["range"] for a in own.values()} == {True}
    assert dict(GangAddress.objects.filter(workload=w).values_list("rank", "address")) == own
    for command in commands:
        env = command.payload["platform_env"]
        assert (env["MASTER_ADDR"], env["GPUPOOL_PEERS"]) == (own[0], f"{own[0]},{own[1]}")
    for agent in agents:
        agent.start()

    wait_for(lambda: Workload.objects.get(pk=w.pk).state == S.RUNNING, 120, "the gang to run")
    for rank in (0, 1):
        expected = f"rank {rank} agreed 2 master {own[0]} peers {own[0]},{own[1]}"
        wait_for(lambda e=expected: e in _lines(w), 60, f"rank {rank}'s rendezvous line")
    rank0, rank1 = f"gpupool-{w.pk}-rank0", f"gpupool-{w.pk}-rank1"
    for rank, name in ((0, rank0), (1, rank1)):
        sandbox = docker_engine.api.inspect_container(f"{name}-net")
        (net,) = sandbox["NetworkSettings"]["Networks"].values()
        assert net["IPAddress"] == own[rank]
        info = docker_engine.api.inspect_container(name)
        assert info["HostConfig"]["NetworkMode"] == f"container:{sandbox['Id']}"
        assert not info["HostConfig"].get("PortBindings")  # nothing published on the node
        # The rules in the member's namespace, set by its agent before the tenant's process ran.
        rules = gang_network.listed(sandbox["State"]["Pid"])
        peer = own[1 - rank]
        assert f"-A INPUT -s {peer}/32 -j ACCEPT" in rules, rules
        assert f"-A OUTPUT -d {data_network['subnet']} -j DROP" in rules, rules
        assert rules[-1] == "-A OUTPUT -j DROP", rules  # the region has no gateway: nothing out
        assert "-A INPUT -j DROP" in rules, rules

    # The members meet at their own addresses, both ways: rank 1 to rank 0, rank 0 to rank 1.
    wait_for(lambda: "rank1-open" in _reach(docker_engine, rank0, own[1], RANK1_PORT), 30, "rank 0 -> rank 1")
    assert "gang-open" in _reach(docker_engine, rank1, own[0], port)

    # Another container on the same gang network (another tenant's member, or any host of the
    # data network), beside a listener of the test's own there.
    spare = [str(a) for a in data_network["range"].hosts() if str(a) not in own.values()]
    made = []
    try:
        for name, ip, command in (
            (
                f"gpupool-test-witness-{w.pk}",
                spare[-1],
                ["nc", "-ll", "-p", "7000", "-e", "echo", "witness-open"],
            ),
            (f"gpupool-test-intruder-{w.pk}", spare[-2], ["sleep", "300"]),
        ):
            config = docker_engine.api.create_networking_config(
                {gang_network.NETWORK_NAME: docker_engine.api.create_endpoint_config(ipv4_address=ip)}
            )
            made.append(
                docker_engine.api.create_container(
                    TEST_IMAGE, command, name=name, networking_config=config,
                    host_config=docker_engine.api.create_host_config(network_mode=gang_network.NETWORK_NAME),
                )["Id"]
            )  # fmt: skip
            docker_engine.api.start(made[-1])
        intruder = f"gpupool-test-intruder-{w.pk}"
        # Positive control: the network carries the intruder's traffic to the witness.
        wait_for(
            lambda: "witness-open" in _reach(docker_engine, intruder, spare[-1], 7000), 30, "the witness"
        )
        assert "gang-open" not in _reach(docker_engine, intruder, own[0], port)
        assert "rank1-open" not in _reach(docker_engine, intruder, own[1], RANK1_PORT)
        # The members reach nothing else of the data network.
        for member in (rank0, rank1):
            assert "witness-open" not in _reach(docker_engine, member, spare[-1], 7000), member
    finally:
        for container in made:
            docker_engine.api.remove_container(container, force=True)

    # The node itself: its address on the data network answers a container on a bridge (another
    # tenant's workload with a port, as its node's runtime starts it), not the members.
    other = DockerRuntime(tmp_path / "other-tenant", node_gpus=1)
    other_id = f"t{uuid.uuid4().hex[:10]}"
    try:
        other.start(
            WorkloadSpec(
                other_id,
                image=TEST_IMAGE,
                command=["sleep", "60"],
                cpu_millicores=500,
                ram_mib=64,
                ports=[8080],
            )
        )
        with _listener(data_network["host"], b"host-open\n") as control:
            assert "host-open" in _reach(docker_engine, f"gpupool-{other_id}", data_network["host"], control)
            for member in (rank0, rank1):
                assert "host-open" not in _reach(docker_engine, member, data_network["host"], control), member
    finally:
        other.stop(other_id, grace_s=0)
        other.forget(other_id)
        other.close()

    # A member fails: the gang fails, the portal stops the other member; both nodes remove their
    # member and its sandbox, and the addresses go back once the stop is confirmed.
    code, output = _exec(docker_engine, rank1, "touch /tmp/fail")
    assert code == 0, output
    wait_for(lambda: Workload.objects.get(pk=w.pk).state == S.FAILED, 60, "the gang to fail")
    label = f"gpupool.workload_id={w.pk}"
    wait_for(
        lambda: not docker_engine.api.containers(all=True, filters={"label": label}), 60, "the members to go"
    )
    wait_for(lambda: not GangAddress.objects.filter(workload=w).exists(), 60, "the addresses to go back")
    assert not Allocation.objects.active().filter(workload=w).exists()
    attached = docker_engine.api.inspect_network(gang_network.NETWORK_NAME).get("Containers") or {}
    assert not {c["IPv4Address"].split("/")[0] for c in attached.values()} & set(own.values())
