"""Workloads as docker containers, through the Docker Engine API (the ``docker`` SDK for Python).

There is no ``docker`` command line: the image, the command and the environment are fields of the
create request, so no tenant string can become an option, and each env value reaches the process
byte for byte (newlines included). Every start payload is checked again here with
:mod:`nodes.agent.workload_rules` (the portal checked it once); a break is a :class:`RuntimeFailure`.

Each container is named ``gpupool-<id>`` and labelled with its workload id, so a second start of the
same workload finds the first container (and starts it, if an earlier try made it but did not)
instead of making another. A container runs hardened, whatever its image asks for:

- ``privileged`` off, every capability dropped (none added back: the NVIDIA hooks that give a
  container its GPUs run on the host, not in it), ``no-new-privileges`` (setuid binaries gain
  nothing), the engine's default seccomp profile;
- a pids limit (``pids_limit``, the agent's ``docker_pids_limit``), the CPU (``NanoCpus``) and
  memory (swap included) the request names; a request that names none gets the node's share for
  its GPUs (the engine's CPUs and memory x the workload's GPUs / the node's GPUs), and a workload
  without GPUs must name both;
- no host namespace (pid, network, uts, user); host IPC only in MPS mode, where an MPS client
  shares memory with the host's MPS daemon (NVIDIA's MPS-in-containers setup);
- two read-only bind mounts, both the platform's: the workload's notice directory at
  ``/run/gpupool`` (the preemption notice ``/run/gpupool/preempt``) and, in MPS mode, the MPS pipe
  directory at its own path; and the workload's volumes, read-write, each its directory under the
  agent's ``volumes_root`` (``nodes.agent.volumes``: derived from the volume id, never a payload
  path) at its checked ``mount_path``; nothing else of the host. The Engine API has no nosuid or
  nodev option for a bind mount: ``no-new-privileges`` makes a setuid file powerless inside, and
  the volumes root is mounted ``nosuid,nodev`` on the host;
- no network (``network_mode: none``) unless the workload asks for ports; then a bridge network of
  its own, ``gpupool-<id>`` (inter-container traffic off; the engine's iptables rules keep bridges
  apart), removed when the workload is forgotten, and each port published on a host port the
  engine picks, read back from the container, kept in the runtime's state file (a restarted agent
  answers the same mapping) and answered by :meth:`DockerRuntime.start`. HTTP ports are bound to
  ``publish_address`` (the private network the portal's proxy reaches, loopback by default), TCP
  ports to ``tcp_publish_address`` (the same unless the operator opens them wider): never to every
  interface by default, since a published port is reachable around the portal's access check;
- a gang's member (its start payload has ``MASTER_PORT``): a bridge network of the gang's,
  ``gpupool-<id>`` (members on one engine join the one network), the container named
  ``gpupool-<id>-rank<k>``; rank 0 publishes ``MASTER_PORT`` on ``MASTER_ADDR`` (or
  ``gang_address``), the same number inside and out, and every member's rendezvous port is closed
  to all but the gang by iptables rules of the agent's (``gang_firewall``), made before the
  container starts and removed with it;
- ``NVIDIA_VISIBLE_DEVICES`` set to the workload's GPUs (``void`` for none), so a CUDA image's own
  ``NVIDIA_VISIBLE_DEVICES=all`` cannot reach every GPU on a node whose default runtime is NVIDIA's;
- json-file logs capped (``LOG_MAX_SIZE`` x ``LOG_MAX_FILES``): a workload cannot fill the disk with
  its output.

GPUs: on NVIDIA they are device requests (``--gpus device=...``, the NVIDIA Container Toolkit): the
UUIDs of the workload's GPUs or MIG slices. On AMD and Intel (the collector says which) there is no
toolkit: the container gets device files, each checked where it is used (an absolute path of a
character device, from the collector, never from a payload): AMD's ``/dev/kfd`` and each of its
GPUs' render node (``/dev/dri/renderD<N>``, found from the GPU's PCI bus id), Intel's render nodes;
the groups that own them (``video``/``render``, by number: never 0), and ``ROCR_VISIBLE_DEVICES`` and
``HIP_VISIBLE_DEVICES`` (AMD) or ``ZE_AFFINITY_MASK`` (Intel) naming its GPUs as the container
numbers them (from 0; it sees no other).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import DeviceRequest, LogConfig, Mount

from nodes.agent import workload_rules
from nodes.agent.runtimes import (
    STREAMS,
    DevicePlan,
    OutputLine,
    Runtime,
    RuntimeFailure,
    gang_firewall,
    gang_network,
    safe_name,
    volume_env,
)
from nodes.agent.types import (
    EXITED,
    FAILED,
    RUNNING,
    STARTING,
    STOPPED,
    WorkloadHandle,
    WorkloadSpec,
    WorkloadStatus,
)
from nodes.agent.volumes import Prepared

log = logging.getLogger(__name__)

LABEL = "gpupool.workload_id"
NOTICE_DIR_IN_CONTAINER = "/run/gpupool"
DEFAULT_PIDS_LIMIT = 4096
LOG_MAX_SIZE = "100m"
LOG_MAX_FILES = "3"
# Where published ports listen unless the agent's configuration says otherwise: only this host.
DEFAULT_PUBLISH_ADDRESS = "127.0.0.1"
# Held by the agents of one host while they look up or make a workload's network.
NETWORK_LOCK = os.path.join(tempfile.gettempdir(), "gpupool-docker-networks.lock")


def parse_docker_time(value: str | None) -> float | None:
    """Docker writes RFC 3339 with nanoseconds; its zero time means "never"."""
    if not value or value.startswith("0001-01-01"):
        return None
    text = value.replace("Z", "+00:00")
    if "." in text:
        head, rest = text.split(".", 1)
        digits = ""
        while rest and rest[0].isdigit():
            digits, rest = digits + rest[0], rest[1:]
        text = f"{head}.{digits[:6]}{rest}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def docker_time_ns(value: str) -> int | None:
    """``2026-12-05T17:00:27.123456789Z`` (the engine's log timestamps) in nanoseconds."""
    head, dot, rest = value.rstrip("Z").partition(".")
    try:
        seconds = int(datetime.fromisoformat(head + "+00:00").timestamp())
    except ValueError:
        return None
    digits = rest[:9] if dot else ""
    if digits and not digits.isdigit():
        return None
    return seconds * 1_000_000_000 + int(digits.ljust(9, "0") or 0)


def docker_since(ns: int) -> float | None:
    """``docker logs``'s ``since`` for lines at or after ``ns``: seconds as a float (docker-py's
    type; the engine takes the fraction to the nanosecond), one microsecond early so the float's
    rounding never passes a line not yet sent. None at first: the whole log."""
    if ns <= 0:
        return None
    return max(ns // 1000 - 1, 1) / 1_000_000


def _log_entries(frames: Iterator[bytes]) -> Iterator[str]:
    """The log's lines from the engine's frames (one message each, but a line is not trusted to
    end where a frame does); a last piece without its newline is a line too."""
    pending = b""
    for frame in frames:
        pending += frame
        if b"\n" not in frame:
            continue
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            yield raw.decode("utf-8", "replace")
    if pending:
        yield pending.decode("utf-8", "replace")


def _explain(exc: DockerException) -> str:
    """Docker's own words for a failure (the engine's message, not the HTTP wrapping)."""
    if isinstance(exc, APIError) and exc.explanation:
        return str(exc.explanation)
    return str(exc)


def published_ports(info: dict[str, Any], skip: int | None = None) -> dict[str, int]:
    """``{"8888": 49153}``: each published container port and the host port the engine gave it
    (but ``skip``, a gang's rendezvous port: the platform's, not one the workload asked for)."""
    ports: dict[str, int] = {}
    for key, bindings in ((info.get("NetworkSettings") or {}).get("Ports") or {}).items():
        port, _, _protocol = key.partition("/")
        if skip is not None and port == str(skip):
            continue
        host_ports = [int(b["HostPort"]) for b in bindings or [] if b.get("HostPort")]
        if host_ports:
            ports[port] = host_ports[0]
    return ports


class DockerRuntime(Runtime):
    name = "docker"

    def __init__(
        self,
        state_dir: str | Path,
        docker_host: str = "",
        pids_limit: int = DEFAULT_PIDS_LIMIT,
        command_timeout_s: float = 120,
        node_gpus: int = 0,
        publish_address: str = DEFAULT_PUBLISH_ADDRESS,
        tcp_publish_address: str = "",
        gang_address: str = "",
        gang_firewall: bool = True,
        gang_parent: str = "",
        gang_sandbox_image: str = gang_network.DEFAULT_SANDBOX_IMAGE,
        gang_sandbox_command: list[str] | None = None,
        **sharing: str,
    ) -> None:
        super().__init__(state_dir, **sharing)
        if pids_limit < 1:
            raise ValueError("pids_limit must be positive")
        self.publish_address = publish_address or DEFAULT_PUBLISH_ADDRESS
        self.tcp_publish_address = tcp_publish_address or self.publish_address
        # Where a gang's rank 0 publishes its rendezvous port; empty: MASTER_ADDR (the node's
        # advertised address, when that is an IP address).
        self.gang_address = gang_address
        # Whether a gang's rendezvous port is closed by this node's firewall to all but its members
        # (nodes/agent/runtimes/gang_firewall.py); off only where the operator isolates it otherwise.
        self.gang_firewall = gang_firewall
        # The interface on the region's gang network (nodes/agent/runtimes/gang_network.py): gang
        # members get addresses of their own there; empty: this node joins no gang network.
        self.gang_parent = gang_parent
        self.gang_network = bool(gang_parent)
        self.gang_sandbox_image = gang_sandbox_image or gang_network.DEFAULT_SANDBOX_IMAGE
        self.gang_sandbox_command = list(gang_sandbox_command or [])
        self.docker_host = docker_host  # empty: $DOCKER_HOST, else the local socket
        self.pids_limit = pids_limit
        self.command_timeout_s = command_timeout_s
        self.node_gpus = node_gpus  # the agent sets it from its inventory
        self._client: docker.DockerClient | None = None
        self._client_lock = threading.Lock()
        self._engine: dict[str, Any] | None = None

    @property
    def client(self) -> docker.DockerClient:
        with self._client_lock:
            if self._client is None:
                timeout = int(self.command_timeout_s)
                try:
                    if self.docker_host:
                        self._client = docker.DockerClient(
                            base_url=self.docker_host, version="auto", timeout=timeout
                        )
                    else:
                        self._client = docker.from_env(timeout=timeout)
                except DockerException as exc:
                    where = self.docker_host or os.environ.get("DOCKER_HOST") or "the local socket"
                    raise RuntimeFailure(f"the Docker Engine at {where} does not answer: {exc}") from exc
            return self._client

    def close(self) -> None:
        """Close the connections to the engine (a later call opens new ones)."""
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    @staticmethod
    def container_name(workload_id: str, rank: str | None = None) -> str:
        """``gpupool-<id>``; a gang member's ``gpupool-<id>-rank<k>``, so that members of one gang
        on nodes that share an engine (a test host, a fleet of agents) are containers of their own."""
        base = f"gpupool-{safe_name(workload_id)}"
        return base if rank is None else f"{base}-rank{rank}"

    @staticmethod
    def network_name(workload_id: str) -> str:
        """The workload's own bridge network: for its published ports, and for a gang's members."""
        return f"gpupool-{safe_name(workload_id)}"

    def _gang(
        self, spec: WorkloadSpec, ports: list[dict[str, Any]]
    ) -> tuple[str | None, tuple[str, int] | None]:
        """(the member's rank, or None outside a gang; rank 0's rendezvous binding: the node's
        address on the network between nodes and ``MASTER_PORT``, or None). Rank 0 publishes
        ``MASTER_PORT`` on ``MASTER_ADDR`` (its own node's address, as the portal gave it; an IP
        address, or ``gang_address`` where the node advertises a name), the same number inside and
        out, so that every member reaches it at the address and port it was told."""
        env = spec.platform_env
        if "MASTER_PORT" not in env:
            return None, None
        rank = env.get("NODE_RANK", "")
        try:
            port = int(env["MASTER_PORT"])
            if not 1024 <= port <= 65535 or not rank.isdigit():
                raise ValueError
        except ValueError:
            raise RuntimeFailure(
                "platform_env: MASTER_PORT must be a port of 1024-65535 and NODE_RANK a rank"
            ) from None
        if spec.gang_network is not None:
            # Its own address on the gang network: nothing published, nothing of the node's used.
            if ports:
                raise RuntimeFailure("ports: a gang member on the gang network publishes none")
            peers = gang_network.peers_checked(
                peers=env.get("GPUPOOL_PEERS", ""),
                address=spec.gang_network["address"],
                subnet=spec.gang_network["subnet"],
                rank=int(rank),
            )
            if env.get("MASTER_ADDR") != peers[0]:
                raise RuntimeFailure("gang_network: MASTER_ADDR is not rank 0's own address")
            return rank, None
        if rank != "0":
            return rank, None
        if any(p["port"] == port for p in ports):
            raise RuntimeFailure(f"ports: {port} is the gang's rendezvous port (MASTER_PORT)")
        address = self.gang_address or env.get("MASTER_ADDR", "")
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise RuntimeFailure(
                f"MASTER_ADDR {address!r} is not an IP address: set the agent's gang_address to "
                "this node's address on the network between nodes"
            ) from None
        return rank, (address, port)

    # -- what a container runs with ---------------------------------------------------------------

    def _checked(self, spec: WorkloadSpec) -> tuple[dict[str, str], list[dict[str, Any]]]:
        if not spec.image:
            raise RuntimeFailure("the docker runtime needs an image")
        try:
            workload_rules.check_image(spec.image)
            workload_rules.check_command(spec.command)
            workload_rules.check_gpu_uuids(spec.gpu_uuids)
            workload_rules.check_platform_env(spec.platform_env)
            return workload_rules.check_env(spec.env), workload_rules.check_ports(spec.ports)
        except workload_rules.WorkloadRuleError as exc:
            raise RuntimeFailure(str(exc)) from exc

    def _limits(self, spec: WorkloadSpec) -> tuple[int, int]:
        """(nano CPUs, memory bytes): the request's, or the node's share for the workload's GPUs."""
        cpu_milli, ram_mib = spec.cpu_millicores or 0, spec.ram_mib or 0
        if cpu_milli and ram_mib:
            return cpu_milli * 1_000_000, ram_mib * 1024 * 1024
        gpu_milli = len(spec.gpu_uuids) * min(1000, spec.gpu_fraction_milli or 1000)
        if not gpu_milli:
            raise RuntimeFailure("a workload without GPUs must name its cpu_millicores and ram_mib")
        if self.node_gpus < 1:
            raise RuntimeFailure("the node's GPU count is not known: cannot size the workload's share")
        if self._engine is None:
            try:
                self._engine = self.client.info()
            except DockerException as exc:
                raise RuntimeFailure(f"docker info failed: {_explain(exc)}") from exc
        share = min(1.0, gpu_milli / (self.node_gpus * 1000))
        nano = cpu_milli * 1_000_000 or max(10_000_000, int(self._engine["NCPU"] * share * 1e9))
        memory = ram_mib * 1024 * 1024 or max(64 << 20, int(self._engine["MemTotal"] * share))
        return nano, memory

    def _environment(
        self, spec: WorkloadSpec, env: dict[str, str], prepared: Prepared, plan: DevicePlan | None
    ) -> list[str]:
        env = dict(env)
        env["GPUPOOL_WORKLOAD_ID"] = spec.workload_id
        env["GPUPOOL_PREEMPT_NOTICE_FILE"] = f"{NOTICE_DIR_IN_CONTAINER}/preempt"
        env["GPUPOOL_RESIZE_FILE"] = f"{NOTICE_DIR_IN_CONTAINER}/resize"
        env["NVIDIA_VISIBLE_DEVICES"] = "void" if plan is not None else ",".join(spec.gpu_uuids) or "void"
        if plan is not None:
            env.update(plan.container_env)
        env.update(self.sharing_env(spec))
        env.update(spec.platform_env)
        env.update(volume_env(prepared, prepared.checkpoint_in_workload))
        return [f"{key}={value}" for key, value in env.items()]

    def _create_options(
        self,
        spec: WorkloadSpec,
        env: dict[str, str],
        ports: list[dict[str, Any]],
        prepared: Prepared,
        gang: tuple[str | None, tuple[str, int] | None] = (None, None),
        network: str | None = None,
    ) -> dict[str, Any]:
        rank, rendezvous = gang
        name = self.container_name(spec.workload_id, rank)
        nano_cpus, memory = self._limits(spec)
        plan = self.device_plan(spec)
        mounts = [
            Mount(
                NOTICE_DIR_IN_CONTAINER,
                str(self.workload_dir(spec.workload_id)),
                type="bind",
                read_only=True,
            )
        ]
        mounts += [
            Mount(v.mount_path, str(v.host_path), type="bind", read_only=False) for v in prepared.volumes
        ]
        options: dict[str, Any] = {
            "name": name,
            "labels": {LABEL: spec.workload_id},
            "environment": self._environment(spec, env, prepared, plan),
            "detach": True,
            "privileged": False,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "pids_limit": self.pids_limit,
            "nano_cpus": nano_cpus,
            "mem_limit": memory,
            "memswap_limit": memory,
            "mounts": mounts,
            "log_config": LogConfig(
                type="json-file", config={"max-size": LOG_MAX_SIZE, "max-file": LOG_MAX_FILES}
            ),
        }
        if plan is not None:
            options["devices"] = [f"{host}:{inside}:rwm" for host, inside in plan.devices]
            if plan.groups:
                options["group_add"] = [str(gid) for gid in plan.groups]
        elif spec.gpu_uuids:
            options["device_requests"] = [
                DeviceRequest(device_ids=list(spec.gpu_uuids), capabilities=[["gpu"]])
            ]
        if self.uses_mps(spec):
            # An MPS client reaches the host's MPS daemon through its pipe directory and shared memory.
            options["ipc_mode"] = "host"
            mounts.append(Mount(self.mps_pipe_dir, self.mps_pipe_dir, type="bind", read_only=True))
        if network is not None:
            options["network"] = network
            # (address,): bound to that address, on a host port the engine picks.
            published: dict[str, Any] = {
                f"{p['port']}/tcp": (
                    self.tcp_publish_address if p["protocol"] == "tcp" else self.publish_address,
                )
                for p in ports
            }
            if rendezvous is not None:
                published[f"{rendezvous[1]}/tcp"] = rendezvous  # (address, the same port outside)
            if published:
                options["ports"] = published
        else:
            options["network_mode"] = "none"
        return options

    def _ensure_network(self, spec: WorkloadSpec) -> str:
        """The id of the workload's network, made unless it exists. A gang's members on nodes that
        share an engine (agents on one host) join one network, and the engine would make two of one
        name if two agents asked at once: so the look-up and the make are done under a lock file
        that agents on one host share (``NETWORK_LOCK``; waited for at most ten seconds)."""
        name = self.network_name(spec.workload_id)
        label = f"{LABEL}={spec.workload_id}"
        with _host_lock(NETWORK_LOCK, timeout_s=10):
            found = self._networks(name, label)
            if found:
                return found[0]
            return str(
                self.client.networks.create(
                    name,
                    driver="bridge",
                    options={"com.docker.network.bridge.enable_icc": "false"},
                    labels={LABEL: spec.workload_id},
                    check_duplicate=True,
                ).id
            )

    def _networks(self, name: str, label: str) -> list[str]:
        """Ids of the networks of exactly that name and label, oldest first."""
        found = self.client.api.networks(names=[name], filters={"label": label})
        found = [n for n in found if n.get("Name") == name]
        return [n["Id"] for n in sorted(found, key=lambda n: (n.get("Created", ""), n["Id"]))]

    # -- the interface ----------------------------------------------------------------------------

    def start(self, spec: WorkloadSpec) -> WorkloadHandle:
        env, ports = self._checked(spec)
        if spec.workload_id not in self.store.records:
            self._ensure_image(spec.image)  # outside the lock: a pull may take minutes
        with self.store.lock:
            record = self.store.records.get(spec.workload_id)
            if record is not None and not record.get("start_error"):
                ports_now = dict(record.get("ports") or {})
                return WorkloadHandle(spec.workload_id, record["container_id"], ports_now)
            gang = self._gang(spec, ports)
            name = self.container_name(spec.workload_id, gang[0])
            routed = spec.gang_network is not None
            if routed and gang[0] is None:
                raise RuntimeFailure("gang_network: only a gang's member (MASTER_PORT, NODE_RANK) joins it")
            if routed and not self.gang_parent:
                raise RuntimeFailure(
                    "gang_network: this node has no gang_parent (the interface on the region's gang network)"
                )
            wants_network = (bool(ports) or gang[0] is not None) and not routed
            network = self.network_name(spec.workload_id) if wants_network else None
            sandbox = f"{name}-net" if routed else None
            try:
                if record is not None:  # an earlier start failed: try again from nothing
                    self._remove(record)
                container = self._find(name)
                if container is None:
                    prepared = self.volumes.prepare(spec)  # refuses a volume over its size
                    if wants_network:
                        made = self._ensure_network(spec)
                        # A gang's network by id: another agent's duplicate may stand for a moment.
                        network = made if gang[0] is not None else network
                    options = self._create_options(spec, env, ports, prepared, gang, network)
                    if sandbox is not None:
                        # The sandbox's namespace, its address and its rules (made first).
                        options["network_mode"] = f"container:{self._gang_sandbox(spec, sandbox)}"
                    container = self.client.containers.create(spec.image, spec.command or None, **options)
                record = {
                    "container_id": container.id,
                    "name": name,
                    "gpu_uuids": spec.gpu_uuids,
                    "network": network,
                    "sandbox": sandbox,
                    "rendezvous_port": gang[1][1] if gang[1] else None,
                    "final_state": None,
                    "status": None,
                }
                self.store.records[spec.workload_id] = record
                self.store.save()
                if gang[0] is not None and self.gang_firewall and not routed:
                    record["firewall"] = f"gpupool-gang-{safe_name(spec.workload_id)}-rank{gang[0]}"
                    self.store.save()
                    try:
                        self._gang_rules(spec, gang, record["firewall"], network or "")
                    except RuntimeFailure as exc:
                        # Kept (and reported failed) until forgotten, as a failed docker start.
                        record["start_error"] = f"the gang's rendezvous could not be set up: {exc}"
                        self.store.save()
                        raise RuntimeFailure(record["start_error"]) from exc
                if container.attrs["State"]["Status"] == "created":
                    container.start()
                info = self.client.api.inspect_container(container.id)
            except DockerException as exc:
                message = f"docker could not start {spec.image}: {_explain(exc)}"
                record = self.store.records.get(spec.workload_id) or {}
                if record:
                    # Kept (and reported failed) until forgotten; `docker inspect` shows what was asked.
                    record["start_error"] = message
                    self.store.save()
                else:
                    self._remove({"container_id": name, "name": name, "network": network, "sandbox": sandbox})
                raise RuntimeFailure(message) from exc
            record["ports"] = published_ports(info, skip=record.get("rendezvous_port"))
            self.store.save()
            return WorkloadHandle(spec.workload_id, container.id, dict(record["ports"]))

    def _gang_rules(
        self, spec: WorkloadSpec, gang: tuple[str | None, tuple[str, int] | None], tag: str, network: str
    ) -> None:
        """The member's firewall rules (``gang_firewall``): its rendezvous port open to the gang's
        own network and, on rank 0's node, to the peers' node addresses; closed to the rest."""
        env = spec.platform_env
        try:
            config = self.client.api.inspect_network(network)["IPAM"]["Config"]
            subnet = next(c["Subnet"] for c in config if ":" not in c.get("Subnet", ":"))
        except (DockerException, StopIteration, KeyError, TypeError) as exc:
            raise RuntimeFailure(f"the gang's network has no IPv4 subnet ({exc})") from None
        rendezvous = gang[1]
        gang_firewall.add(
            tag=tag,
            master_addr=rendezvous[0] if rendezvous else env.get("MASTER_ADDR", ""),
            port=int(env["MASTER_PORT"]),
            subnet=subnet,
            peers=[p for p in env.get("GPUPOOL_PEERS", "").split(",") if p],
            rank0=rendezvous is not None,
        )

    def _gang_sandbox(self, spec: WorkloadSpec, name: str) -> str:
        """Make and start the member's sandbox (``name``) on the gang network at its address, set
        its namespace's rules, and answer its id; on any failure nothing of it is left."""
        net = spec.gang_network or {}
        peers = spec.platform_env["GPUPOOL_PEERS"].split(",")
        wanted = gang_network.rules(
            address=net["address"], peers=peers, subnet=net["subnet"], route_out="gateway" in net
        )
        self._ensure_image(self.gang_sandbox_image)
        with contextlib.suppress(NotFound):
            self.client.api.remove_container(name, force=True)  # an earlier try's
        api = self.client.api
        try:
            network = self._ensure_gang_network(net)
            made = api.create_container(
                self.gang_sandbox_image,
                self.gang_sandbox_command or None,
                name=name,
                # Root without capabilities: the agent (root) may then open its namespace.
                user="0:0",
                labels={LABEL: spec.workload_id, gang_network.SANDBOX_ROLE: "gang-sandbox"},
                host_config=api.create_host_config(
                    network_mode=network,
                    cap_drop=["ALL"],
                    security_opt=["no-new-privileges"],
                    read_only=True,
                    pids_limit=16,
                    mem_limit=32 << 20,
                    sysctls={"net.ipv6.conf.all.disable_ipv6": "1"},
                    log_config=LogConfig(type="json-file", config={"max-size": "1m", "max-file": "1"}),
                ),
                networking_config=api.create_networking_config(
                    {network: api.create_endpoint_config(ipv4_address=net["address"])}
                ),
            )
            api.start(made["Id"])
            pid = int((api.inspect_container(made["Id"]).get("State") or {}).get("Pid") or 0)
            gang_network.apply(pid, wanted)
        except (DockerException, RuntimeFailure) as exc:
            with contextlib.suppress(DockerException):
                api.remove_container(name, force=True)
            reason = _explain(exc) if isinstance(exc, DockerException) else str(exc)
            raise RuntimeFailure(f"the gang member's network could not be set up: {reason}") from exc
        return str(made["Id"])

    def _ensure_gang_network(self, net: dict[str, str]) -> str:
        """The engine's gang network (``gpupool-gangs``, macvlan on ``gang_parent``), made unless it
        exists; one that exists with another parent or subnet is an operator's error, said so."""
        name = gang_network.NETWORK_NAME
        with _host_lock(NETWORK_LOCK, timeout_s=10):
            found = self.client.api.networks(names=[name], filters={"label": gang_network.NETWORK_LABEL})
            found = [n for n in found if n.get("Name") == name]
            if found:
                info = self.client.api.inspect_network(found[0]["Id"])
                subnets = [c.get("Subnet") for c in (info.get("IPAM") or {}).get("Config") or []]
                parent = (info.get("Options") or {}).get("parent")
                if (
                    info.get("Driver") != "macvlan"
                    or parent != self.gang_parent
                    or net["subnet"] not in subnets
                ):
                    raise RuntimeFailure(
                        f"the engine's network {name} is not macvlan on {self.gang_parent} with "
                        f"{net['subnet']} (it has {info.get('Driver')} on {parent}, {subnets}): remove it "
                        "once no gang uses it, or set gang_parent and the region's gang network to match"
                    )
                return str(found[0]["Id"])
            # The engine gives its network a gateway; without the region's, the subnet's first
            # address (which the portal never hands out), and the members' rules send nothing out.
            gateway = net.get("gateway") or str(next(ipaddress.IPv4Network(net["subnet"]).hosts()))
            pool = docker.types.IPAMPool(subnet=net["subnet"], iprange=net["range"], gateway=gateway)
            return str(
                self.client.networks.create(
                    name,
                    driver="macvlan",
                    options={"parent": self.gang_parent, "macvlan_mode": "bridge"},
                    ipam=docker.types.IPAMConfig(pool_configs=[pool]),
                    labels={gang_network.NETWORK_LABEL: net["subnet"]},
                    check_duplicate=True,
                ).id
            )

    def _find(self, name: str) -> Any:
        """The container of an earlier try that lost its record, if any."""
        try:
            return self.client.containers.get(name)
        except NotFound:
            return None

    def _ensure_image(self, image: str) -> None:
        try:
            self.client.images.get(image)
        except ImageNotFound:
            self._pull(image)
        except DockerException as exc:
            raise RuntimeFailure(f"docker could not look up {image}: {_explain(exc)}") from exc

    def _pull(self, image: str) -> None:
        try:
            self.client.images.pull(image)
        except DockerException as exc:
            raise RuntimeFailure(f"docker could not pull {image}: {_explain(exc)}") from exc

    def _from_inspect(
        self, workload_id: str, record: dict[str, Any], info: dict[str, Any] | None
    ) -> WorkloadStatus:
        if record.get("start_error"):
            return WorkloadStatus(
                workload_id=workload_id,
                state=FAILED,
                gpu_uuids=record["gpu_uuids"],
                message=record["start_error"],
                finished_at=time.time(),
            )
        if info is None:
            return WorkloadStatus(
                workload_id=workload_id,
                state=record["final_state"] or FAILED,
                gpu_uuids=record["gpu_uuids"],
                message="the container is gone",
                finished_at=time.time(),
            )
        state = info.get("State") or {}
        docker_status = state.get("Status", "")
        started = parse_docker_time(state.get("StartedAt"))
        common = {"workload_id": workload_id, "started_at": started, "gpu_uuids": record["gpu_uuids"]}
        if docker_status == "created":
            return WorkloadStatus(state=STARTING, **common)
        if docker_status in ("running", "paused", "restarting"):
            return WorkloadStatus(state=RUNNING, **common)
        code = state.get("ExitCode")
        message = "out of memory (OOMKilled)" if state.get("OOMKilled") else str(state.get("Error") or "")
        final = record["final_state"] or (EXITED if code == 0 else FAILED)
        return WorkloadStatus(
            state=final,
            exit_code=code,
            finished_at=parse_docker_time(state.get("FinishedAt")),
            message=message,
            **common,
        )

    def _inspect(self, ref: str) -> dict[str, Any] | None:
        try:
            return self.client.api.inspect_container(ref)
        except NotFound:
            return None
        except DockerException as exc:
            raise RuntimeFailure(f"docker inspect {ref} failed: {_explain(exc)}") from exc

    def status(self) -> list[WorkloadStatus]:
        # Under the store's lock: an elastic restart swaps a workload's container under it too.
        with self.store.lock:
            return self._status_locked()

    def _status_locked(self) -> list[WorkloadStatus]:
        statuses = []
        changed = False
        for wid, record in self.store.items():
            if record.get("status") is not None:
                statuses.append(WorkloadStatus(**record["status"]))
                continue
            info = None if record.get("start_error") else self._inspect(record["container_id"])
            status = self._from_inspect(wid, record, info)
            if status.terminal:
                record["status"] = dict(vars(status))
                changed = True
            statuses.append(status)
        if changed:
            self.store.save()
        return statuses

    def signal_resize(self, workload_id: str, info: dict[str, Any]) -> None:
        """SIGUSR1 to the container's main process. Docker cannot give a running container more
        devices, so a growth is refused here (the job keeps running on the GPUs it has): on docker
        an elastic job grows only with ``on_resize`` "restart" (``restart_resized``)."""
        record = self.store.records.get(workload_id)
        if record is None:
            raise RuntimeFailure(f"no workload {workload_id} on this node")
        if set(info["gpu_uuids"]) - set(record.get("gpu_uuids") or []):
            raise RuntimeFailure(
                "docker cannot add GPUs to a running container; it keeps the GPUs it has "
                '(an elastic job grows on docker with on_resize "restart")'
            )
        try:
            self.client.api.kill(record["container_id"], signal="SIGUSR1")
        except DockerException as exc:
            raise RuntimeFailure(f"docker kill --signal SIGUSR1 failed: {_explain(exc)}") from exc

    def restart_resized(self, workload_id: str, info: dict[str, Any], grace_s: float) -> None:
        """Stop the container and start a new one of the same name on ``info``'s GPUs: the old
        one's image, command, user, working directory, mounts, limits, hardening and network, as
        the engine reports them (``docker inspect``), its published ports pinned to the host ports
        they had, its environment with the GPUs' variables, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``
        and ``GPUPOOL_RESUME=1``. Under the store's lock throughout, so no status is read between
        the stop and the new start: the portal never hears of an end. The old container stays
        (stopped, renamed) until its last lines are shipped (``output``)."""
        with self.store.lock:
            record = self.store.records.get(workload_id)
            old = (
                None if record is None or record.get("start_error") else self._inspect(record["container_id"])
            )
            if record is None or old is None or (old.get("State") or {}).get("Status") != "running":
                raise RuntimeFailure(f"workload {workload_id} is not running on this node")
            uuids = list(info["gpu_uuids"])
            config, host = old["Config"], dict(old["HostConfig"])
            plan = self.device_plan(WorkloadSpec(workload_id, gpu_uuids=uuids))
            env = dict(item.partition("=")[::2] for item in config.get("Env") or [])
            for name in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ZE_AFFINITY_MASK"):
                env.pop(name, None)
            if plan is None:
                env["NVIDIA_VISIBLE_DEVICES"] = ",".join(uuids)
                host["DeviceRequests"] = [
                    {"Driver": "", "Count": 0, "DeviceIDs": uuids, "Capabilities": [["gpu"]], "Options": {}}
                ]
            else:
                env.update(plan.container_env)
                host["Devices"] = [
                    {"PathOnHost": h, "PathInContainer": inside, "CgroupPermissions": "rwm"}
                    for h, inside in plan.devices
                ]
                host["GroupAdd"] = [str(gid) for gid in plan.groups] or None
            env.update(
                WORLD_SIZE=str(info["world_size"]), LOCAL_WORLD_SIZE=str(len(uuids)), GPUPOOL_RESUME="1"
            )
            ports = dict(record.get("ports") or {})
            if host.get("PortBindings"):
                host["PortBindings"] = {
                    key: [
                        {**b, "HostPort": str(ports.get(key.partition("/")[0], b.get("HostPort") or ""))}
                        for b in bindings or []
                    ]
                    for key, bindings in host["PortBindings"].items()
                }
            previous = [*record.get("previous", []), record["container_id"]]
            try:
                self.client.api.stop(record["container_id"], timeout=max(0, int(grace_s)))
                self.client.api.rename(record["container_id"], f"{record['name']}-r{len(previous)}")
                new = self.client.api.create_container(
                    old["Image"],  # by id: the same image, whatever its tag names now
                    config.get("Cmd"),
                    name=record["name"],
                    hostname=config.get("Hostname") or None,
                    labels=config.get("Labels") or {},
                    environment=[f"{k}={v}" for k, v in env.items()],
                    user=config.get("User") or None,
                    working_dir=config.get("WorkingDir") or None,
                    entrypoint=config.get("Entrypoint"),
                    ports=[tuple(key.split("/", 1)) for key in config.get("ExposedPorts") or {}] or None,
                    host_config=host,
                )
                record.update(container_id=new["Id"], gpu_uuids=uuids, previous=previous, status=None)
                self.store.save()
                self.client.api.start(new["Id"])
                record["ports"] = published_ports(self.client.api.inspect_container(new["Id"]))
            except DockerException as exc:
                record["previous"] = previous
                record["start_error"] = f"elastic restart failed: {_explain(exc)}"
                self.store.save()
                raise RuntimeFailure(record["start_error"]) from exc
            self.store.save()

    def stop(self, workload_id: str, grace_s: float, *, final_state: str = STOPPED) -> WorkloadStatus:
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is None:
                return WorkloadStatus(
                    workload_id=workload_id, state=final_state, message="not known on this node"
                )
            current = self.get_status(workload_id)
            if current is not None and current.terminal:
                return current
            record["final_state"] = final_state
            self.store.save()
        try:
            self.client.api.stop(record["container_id"], timeout=int(grace_s))
        except NotFound:
            pass
        except DockerException as exc:
            log.warning("docker stop %s: %s", record["name"], _explain(exc))
        status = self.get_status(workload_id)
        return status or WorkloadStatus(workload_id=workload_id, state=final_state)

    def logs(self, workload_id: str, tail: int = 100) -> str:
        record = self.store.records.get(workload_id)
        if record is None:
            raise RuntimeFailure(f"no workload {workload_id} on this node")
        try:
            output = self.client.api.logs(record["container_id"], stdout=True, stderr=True, tail=int(tail))
        except DockerException as exc:
            raise RuntimeFailure(f"docker logs failed: {_explain(exc)}") from exc
        return output.decode("utf-8", "replace")

    def output(
        self, workload_id: str, cursor: dict[str, Any], limit: int
    ) -> tuple[list[OutputLine], dict[str, Any]]:
        """The container's new lines, each stream asked on its own (``docker logs`` with
        timestamps, streamed, ``since`` a microsecond before the last line sent); the cursor holds,
        per stream, the last line's time in nanoseconds and how many lines had exactly that time,
        so none is sent twice. Lines past ``limit`` are not decoded; the next poll starts at them.
        After an elastic restart the stopped containers come first (their lines are older); one
        with nothing left to send is removed."""
        with self.store.lock:
            record = self.store.records.get(workload_id)
            if record is None or not record.get("container_id"):
                return [], cursor
            previous = list(record.get("previous", []))
            current = None if record.get("start_error") else record["container_id"]
        lines: list[OutputLine] = []
        cursor = dict(cursor)
        drained = []
        for container_id in [*previous, current]:
            if container_id is None:
                continue
            before = len(lines)
            for stream in STREAMS:
                if len(lines) >= limit:
                    break
                got, cursor[stream] = self._read(
                    container_id, stream, cursor.get(stream, (0, 0)), limit - len(lines)
                )
                lines += got
            if container_id != current and len(lines) == before and len(lines) < limit:
                drained.append(container_id)
        if drained:
            with self.store.lock:
                record = self.store.records.get(workload_id)
                if record is not None:
                    record["previous"] = [c for c in record.get("previous", []) if c not in drained]
                    self.store.save()
            for container_id in drained:
                self._remove({"container_id": container_id, "name": container_id})
        return lines, cursor

    def _read(
        self, container_id: str, stream: str, since: tuple[int, int], limit: int
    ) -> tuple[list[OutputLine], tuple[int, int]]:
        """At most ``limit`` lines of one stream of one container after ``since`` (ns, same)."""
        first_ns, first_same = since
        last_ns, same, seen = first_ns, first_same, 0
        lines: list[OutputLine] = []
        try:
            entries = self.client.api.logs(
                container_id,
                stdout=stream == "stdout",
                stderr=stream == "stderr",
                timestamps=True,
                stream=True,
                follow=False,
                since=docker_since(first_ns),
            )
        except NotFound:
            return lines, (first_ns, first_same)
        except DockerException as exc:
            raise RuntimeFailure(f"docker logs failed: {_explain(exc)}") from exc
        try:
            for entry in _log_entries(entries):
                stamp, _, text = entry.partition(" ")
                ns = docker_time_ns(stamp)
                if ns is None or ns < first_ns:
                    continue
                if ns == first_ns:
                    seen += 1
                    if seen <= first_same:
                        continue  # sent before
                if len(lines) >= limit:
                    break
                if ns == last_ns:
                    same += 1
                else:
                    last_ns, same = ns, 1
                lines.append((ns / 1e9, stream, text))
        finally:
            # Read to the end without decoding: a stream closed early leaves its socket open
            # until collected (docker-py's CancellableStream.close only shuts it down).
            for _ in entries:
                pass
        return lines, (last_ns, same)

    def prewarm(self, image: str) -> dict[str, Any]:
        try:
            workload_rules.check_image(image)
        except workload_rules.WorkloadRuleError as exc:
            raise RuntimeFailure(str(exc)) from exc
        self._pull(image)
        return {"image": image, "pulled": True}

    def _remove_container(self, container: str, name: str) -> None:
        """``docker rm -f``: gone already is fine; another failure is logged."""
        try:
            self.client.api.remove_container(container, force=True)
        except NotFound:
            pass
        except DockerException as exc:
            log.warning("docker rm %s: %s", name, _explain(exc))

    def _remove(self, record: dict[str, Any]) -> None:
        """The container and its network, whatever is left of them."""
        self._remove_container(record["container_id"], record["name"])
        if record.get("sandbox"):
            # Its address goes back to the engine's gang network with it.
            self._remove_container(record["sandbox"], record["sandbox"])
        if record.get("firewall"):
            try:
                gang_firewall.remove(record["firewall"])
            except RuntimeFailure as exc:
                log.warning("gang firewall rules %s: %s", record["firewall"], exc)
        if record.get("network"):
            try:
                self.client.networks.get(record["network"]).remove()
            except NotFound:
                pass
            except DockerException as exc:
                log.warning("docker network rm %s: %s", record["network"], _explain(exc))

    def forget(self, workload_id: str) -> None:
        record = self.store.records.get(workload_id)
        if record is None:
            return
        for container_id in record.get("previous", []):
            self._remove({"container_id": container_id, "name": container_id})
        self._remove(record)
        super().forget(workload_id)

    # -- SSH sessions (nodes/agent/ssh.py) ----------------------------------------------------------

    def exec_open(
        self, workload_id: str, argv: list[str], *, tty: bool, env: dict[str, str]
    ) -> tuple[str, socket.socket]:
        """Start ``argv`` inside the workload's running container (``docker exec``, attached) and
        answer the exec's id and a socket of its own on the attached stream: raw with a TTY,
        docker's multiplexed frames (8-byte headers) without. The exec runs as the container's
        process does: its user, working directory, environment and hardening (capabilities,
        no-new-privileges, pids limit, cgroup)."""
        record = self.store.records.get(workload_id)
        status = self.get_status(workload_id) if record is not None else None
        if record is None or status is None or status.state != RUNNING:
            raise RuntimeFailure(f"workload {workload_id} is not running on this node")
        try:
            exec_id = self.client.api.exec_create(
                record["container_id"],
                argv,
                stdin=True,
                stdout=True,
                stderr=True,
                tty=tty,
                environment=[f"{k}={v}" for k, v in env.items()],
            )["Id"]
            stream = self.client.api.exec_start(exec_id, tty=tty, socket=True)
        except DockerException as exc:
            raise RuntimeFailure(f"docker exec failed: {_explain(exc)}") from exc
        # A socket object of our own on the attached connection (the SDK's is a file object of
        # http.client's): asyncio can then read, write and half-close it.
        sock = socket.socket(fileno=os.dup(stream.fileno()))
        stream.close()
        return exec_id, sock

    def exec_resize(self, exec_id: str, width: int, height: int) -> None:
        try:
            self.client.api.exec_resize(exec_id, height=height, width=width)
        except DockerException as exc:
            log.debug("docker exec resize %s: %s", exec_id, _explain(exc))

    def exec_kill(self, exec_id: str) -> None:
        """End an exec that still runs (its SSH client went): the Engine API has no call for it, and
        an exec outlives its attached stream, so its process group is killed by the host PID the
        engine reports (each exec leads a session of its own), or, where the agent may not signal
        it (not root), from inside the container by the same user with the shell's ``kill``."""
        try:
            info = self.client.api.exec_inspect(exec_id)
        except DockerException:
            return
        pid = info.get("Pid") or 0
        if not info.get("Running") or pid <= 0:
            return
        try:
            os.killpg(pid, signal.SIGKILL) if _leads_group(pid) else os.kill(pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        inner = _namespace_pid(pid)
        if inner is None:
            log.warning("docker exec %s: cannot end its process %d", exec_id, pid)
            return
        try:
            killer = self.client.api.exec_create(
                info["ContainerID"],
                ["/bin/sh", "-c", f"kill -KILL -- -{inner} 2>/dev/null || kill -KILL {inner}"],
                user=str(info.get("ProcessConfig", {}).get("user") or ""),
            )["Id"]
            self.client.api.exec_start(killer)
        except DockerException as exc:
            log.warning("docker exec %s: cannot end its process: %s", exec_id, _explain(exc))

    def exec_exit_code(self, exec_id: str, wait_s: float = 5.0) -> int | None:
        """The exec's exit code once it has ended (its stream closes a moment before)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = self.client.api.exec_inspect(exec_id)
            except DockerException:
                return None
            if not info.get("Running") or time.monotonic() > deadline:
                return info.get("ExitCode")
            time.sleep(0.02)

    def workload_for_pid(self, pid: int) -> str | None:
        try:
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return None
        return next((wid for wid, record in self.store.items() if record["container_id"] in cgroup), None)


@contextlib.contextmanager
def _host_lock(path: str, timeout_s: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` shared by the agents of one host, waited for at most
    ``timeout_s`` (then the work goes on without it: a lock held elsewhere must not stop starts)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("%s is held elsewhere; going on without it", path)
                    break
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # releases the lock


def _leads_group(pid: int) -> bool:
    """Whether ``pid`` leads its process group (``/proc/<pid>/stat``'s pgrp, after the command)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()
    return len(fields) > 2 and fields[2] == str(pid)


def _namespace_pid(pid: int) -> int | None:
    """The process's PID inside its own PID namespace (the last of ``NSpid``), or None."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            parts = line.split()[1:]
            return int(parts[-1]) if parts else None
    return None
