"""A gang member's start payload on the docker runtime (real engine), where it is refused: what the
portal sends is checked again before any network, rule or container is made. The rendezvous
itself, across two real agents, is in ``tests/scheduling/test_gang_docker_e2e.py``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from nodes.agent.config import ConfigError, load_config
from nodes.agent.runtimes import RuntimeFailure, gang_firewall, gang_network, make_runtime
from nodes.agent.runtimes.docker import DockerRuntime
from nodes.agent.types import WorkloadSpec
from tests.docker_engine import TEST_IMAGE


@pytest.fixture
def runtime(tmp_path: Path, docker_engine: docker.DockerClient) -> Iterator[DockerRuntime]:
    made = DockerRuntime(tmp_path / "state", node_gpus=1)
    yield made
    made.close()


def member(rank: int, **env: str) -> tuple[str, WorkloadSpec, dict[str, Any]]:
    wid = f"t{uuid.uuid4().hex[:10]}"
    platform_env = {
        "WORLD_SIZE": "2", "NODE_RANK": str(rank), "NNODES": "2", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "GPUPOOL_PEERS": "10.0.0.1,10.0.0.2", **env,
    }  # fmt: skip
    fields = {"image": TEST_IMAGE, "command": ["true"], "cpu_millicores": 500, "ram_mib": 64}
    return wid, WorkloadSpec(wid, platform_env=platform_env, **fields), fields


def left_on_engine(engine: docker.DockerClient, wid: str) -> list[str]:
    label = f"gpupool.workload_id={wid}"
    return [c["Names"][0] for c in engine.api.containers(all=True, filters={"label": label})] + [
        n["Name"] for n in engine.api.networks(filters={"label": label})
    ]


@pytest.mark.parametrize(
    ("rank", "env", "ports", "message"),
    [
        # Rank 0 binds MASTER_ADDR: a name cannot be bound, and the agent says what to set.
        (0, {"MASTER_ADDR": "node-1.internal"}, [], "set the agent's gang_address"),
        (0, {"MASTER_PORT": "80"}, [], "MASTER_PORT must be a port of 1024-65535"),
        (1, {"MASTER_PORT": "29500; rm"}, [], "MASTER_PORT must be a port"),
        (1, {"NODE_RANK": "-1"}, [], "NODE_RANK a rank"),
        # The tenant's own port cannot take the platform's rendezvous port.
        (0, {}, [29500], "29500 is the gang's rendezvous port"),
    ],
)
def test_a_bad_rendezvous_is_refused_before_anything_is_made(
    runtime: DockerRuntime,
    docker_engine: docker.DockerClient,
    rank,
    env,
    ports,
    message,
) -> None:
    wid, spec, _ = member(rank, **env)
    spec.ports = ports
    with pytest.raises(RuntimeFailure, match=message):
        runtime.start(spec)
    assert left_on_engine(docker_engine, wid) == []


def test_a_hostile_peer_list_becomes_no_rule(
    runtime: DockerRuntime,
    docker_engine: docker.DockerClient,
) -> None:
    """``GPUPOOL_PEERS`` is the portal's, but it reaches iptables' argv: anything but an IPv4
    address fails the start and writes no rule (and the container never runs)."""
    wid, spec, _ = member(0, GPUPOOL_PEERS="10.0.0.1,-j ACCEPT", MASTER_ADDR="127.0.0.1")
    with pytest.raises(RuntimeFailure, match="is not an IP address"):
        runtime.start(spec)
    tag = f"gpupool-gang-{wid}-rank0"
    assert gang_firewall.listed(tag) == []
    status = runtime.get_status(wid)
    assert status is not None and status.state == "failed"
    runtime.forget(wid)
    assert left_on_engine(docker_engine, wid) == []


def test_the_rules_refuse_what_is_not_theirs() -> None:
    ok = {"master_addr": "10.0.0.1", "port": 29500, "subnet": "172.30.0.0/16", "peers": ["10.0.0.2"]}
    assert len(gang_firewall.rules(tag="gpupool-gang-7-rank0", rank0=True, **ok)) == 4
    assert len(gang_firewall.rules(tag="gpupool-gang-7-rank1", rank0=False, **ok)) == 3
    for bad in ("gpupool-gang-7", "x -j ACCEPT", "gpupool-gang-7-rank0 --x"):
        with pytest.raises(RuntimeFailure, match="not a gang rule tag"):
            gang_firewall.rules(tag=bad, rank0=True, **ok)
    with pytest.raises(RuntimeFailure, match="IPv4 only"):
        gang_firewall.rules(tag="gpupool-gang-7-rank0", rank0=True, **{**ok, "master_addr": "fd00::1"})


def test_the_agents_gang_settings_reach_the_runtime(
    tmp_path: Path,
    docker_engine: docker.DockerClient,
    request: pytest.FixtureRequest,
) -> None:
    """``GPUPOOL_GANG_ADDRESS`` is where rank 0 publishes (its node advertises a name here);
    ``GPUPOOL_GANG_FIREWALL=0`` makes no rules (the operator isolates the network otherwise)."""
    env = {
        "GPUPOOL_PORTAL_URL": "https://portal.example",
        "GPUPOOL_GANG_ADDRESS": "127.0.0.1",
        "GPUPOOL_GANG_FIREWALL": "0",
    }
    config = load_config(env=env).validate()
    runtime = make_runtime(config.runtime, tmp_path / "state", node_gpus=1, **config.runtime_options())
    assert isinstance(runtime, DockerRuntime)
    request.addfinalizer(runtime.close)
    wid, spec, _ = member(0, MASTER_ADDR="node-1.internal")
    spec.command = ["sleep", "30"]
    runtime.start(spec)
    try:
        info = docker_engine.api.inspect_container(f"gpupool-{wid}-rank0")
        assert info["HostConfig"]["PortBindings"] == {
            "29500/tcp": [{"HostIp": "127.0.0.1", "HostPort": "29500"}]
        }
        assert gang_firewall.listed(f"gpupool-gang-{wid}-rank0") == []
        # The platform's rendezvous port is not one of the workload's published ports.
        assert runtime.start(spec).ports == {}
    finally:
        runtime.stop(wid, grace_s=0)
        runtime.forget(wid)
    assert left_on_engine(docker_engine, wid) == []
    with pytest.raises(ConfigError, match="gang_address must be an IP address"):
        load_config(env={**env, "GPUPOOL_GANG_ADDRESS": "node-1.internal"}).validate()


def routed_member(rank: int, address: str | None = None, **env: str) -> tuple[str, WorkloadSpec]:
    """A member on a gang network (10.77.0.0/16, members in 10.77.200.0/24)."""
    peers = ["10.77.200.2", "10.77.200.3"]
    wid, spec, _ = member(rank, MASTER_ADDR=peers[0], GPUPOOL_PEERS=",".join(peers))
    spec.platform_env.update(env)
    spec.gang_network = {
        "subnet": "10.77.0.0/16",
        "range": "10.77.200.0/24",
        "address": address or peers[rank],
    }
    return wid, spec


@pytest.mark.parametrize(
    ("rank", "address", "env", "ports", "message"),
    [
        (1, "10.77.200.9", {}, [], "not its rank's in GPUPOOL_PEERS"),
        (0, None, {"GPUPOOL_PEERS": "10.77.200.2,10.78.0.3"}, [], "is not on the gang network"),
        (0, None, {"GPUPOOL_PEERS": "10.77.200.2,-j ACCEPT"}, [], "is not an IPv4 address"),
        (1, None, {"MASTER_ADDR": "10.77.200.9"}, [], "MASTER_ADDR is not rank 0's own address"),
        (0, None, {}, [8888], "publishes none"),
    ],
)
def test_a_bad_gang_network_member_is_refused_before_anything_is_made(
    tmp_path: Path, docker_engine: docker.DockerClient, rank, address, env, ports, message
) -> None:
    runtime = DockerRuntime(tmp_path / "state", node_gpus=1, gang_parent="gpn-none")
    try:
        wid, spec = routed_member(rank, address, **env)
        spec.ports = ports
        with pytest.raises(RuntimeFailure, match=message):
            runtime.start(spec)
        assert left_on_engine(docker_engine, wid) == []
    finally:
        runtime.close()


def test_a_gang_network_needs_a_gang_parent_and_a_gang(runtime: DockerRuntime, docker_engine) -> None:
    wid, spec = routed_member(0)
    with pytest.raises(RuntimeFailure, match="this node has no gang_parent"):
        runtime.start(spec)
    spec.platform_env = {}
    with pytest.raises(RuntimeFailure, match="only a gang's member"):
        runtime.start(spec)
    assert left_on_engine(docker_engine, wid) == []


def test_a_members_rules_let_in_its_peers_only() -> None:
    rules = gang_network.rules(
        address="10.77.200.2", peers=["10.77.200.2", "10.77.200.3"], subnet="10.77.0.0/16"
    )
    assert ["INPUT", "-s", "10.77.200.3", "-j", "ACCEPT"] in rules
    assert ["INPUT", "-s", "10.77.200.2", "-j", "ACCEPT"] not in rules  # itself: loopback
    assert rules.index(["INPUT", "-j", "DROP"]) == 3
    assert rules[-3:] == [
        ["OUTPUT", "-d", "169.254.0.0/16", "-j", "DROP"],
        ["OUTPUT", "-d", "168.63.129.16/32", "-j", "DROP"],
        ["OUTPUT", "-d", "10.77.0.0/16", "-j", "DROP"],
    ]
    # A region without a gateway: nothing out but to the peers.
    closed = gang_network.rules(
        address="10.77.200.2", peers=["10.77.200.2", "10.77.200.3"], subnet="10.77.0.0/16", route_out=False
    )
    assert (
        closed[-1] == ["OUTPUT", "-j", "DROP"]
        and closed.index(["OUTPUT", "-d", "10.77.200.3", "-j", "ACCEPT"]) < len(closed) - 1
    )


def test_the_gang_parent_setting(tmp_path: Path) -> None:
    env = {"GPUPOOL_PORTAL_URL": "https://portal.example", "GPUPOOL_RUNTIME": "docker"}
    config = load_config(env={**env, "GPUPOOL_GANG_PARENT": "eth1"}).validate()
    assert config.runtime_options()["gang_parent"] == "eth1"
    assert DockerRuntime(tmp_path / "a", **config.runtime_options()).gang_network is True
    assert DockerRuntime(tmp_path / "b").gang_network is False
    for bad in ("eth1 -j ACCEPT", "../eth1", "a" * 16):
        with pytest.raises(ConfigError, match="gang_parent must be a network interface"):
            load_config(env={**env, "GPUPOOL_GANG_PARENT": bad}).validate()
    with pytest.raises(ConfigError, match="gang_parent is a docker runtime setting"):
        load_config(env={**env, "GPUPOOL_RUNTIME": "simulated", "GPUPOOL_GANG_PARENT": "eth1"}).validate()
