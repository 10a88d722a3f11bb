"""Workloads across nodes (gangs): they start together, or not at all.

The rule, once: every member (one node's share of a placement) gets its rank and the rendezvous
(``platform_env`` in ``scheduling.services.env``: WORLD_SIZE, NODE_RANK, NNODES, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, GPUPOOL_PEERS, as torchrun and NCCL read them). The workload is RUNNING
only when every member's start succeeded. A member that fails to start or fails while running, or a
gang not started within ``SCHEDULING_GANG_START_TIMEOUT_S``, stops every member (the stops reach the
nodes that did start) and requeues or fails the whole gang by its policy; the released GPUs of
members that had started take no new work until their node confirms the stop. A member that exits
0 gives its GPUs back (its allocations end then); the gang succeeds when the last one does. Billing
follows the allocations: from the gang's RUNNING to each member's own end.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q

from nodes.gang_network import GangNetwork, GangNetworkError, gang_network_check
from nodes.models import CommandKind, CommandState, Node, NodeCommand
from scheduling.models import HOLDING_STATES, Allocation, GangAddress, Workload


@dataclass(frozen=True, slots=True)
class GangMember:
    """One node's share of a placement across nodes, as its start payload tells it."""

    rank: int
    nnodes: int
    local_gpus: int
    world_size: int
    master_addr: str
    master_port: int
    peers: tuple[str, ...]
    """Every member's address, by rank: its node's, or its own on the gang network."""
    network: dict[str, str] | None = None
    """On a gang network: ``{"subnet", "range", "gateway"?, "address"}``, the member's own address
    in ``address`` (the start payload's ``gang_network``); None: rendezvous through rank 0's node."""


def is_gang(w: Workload, node_count: int) -> bool:
    """Whether a placement of ``w`` on ``node_count`` nodes is a gang (its members get ranks)."""
    return w.gang or node_count > 1


def gang_port_choose(*, workload_id: int, used: set[int]) -> int:
    """A rendezvous port from ``SCHEDULING_GANG_PORT_RANGE`` that no other placed gang uses, tried
    from a point that depends on the workload (so that two portals' choices rarely meet); when every
    port is in use, the workload's own point (a clash is then unavoidable and only slows a start)."""
    lo, hi = settings.SCHEDULING_GANG_PORT_RANGE
    size = max(1, hi - lo + 1)
    first = random.Random(workload_id).randrange(size)
    for k in range(size):
        port = lo + (first + k) % size
        if port not in used:
            return port
    return lo + first


def gang_ports_used() -> set[int]:
    """Rendezvous ports of the gangs that hold GPUs now."""
    return set(
        Workload.objects.filter(state__in=HOLDING_STATES, gang_port__isnull=False).values_list(
            "gang_port", flat=True
        )
    )


def gang_members(
    *,
    node_ids: list[int],
    gpus_per_node: list[int],
    port: int,
    addresses: dict[int, str],
    network: dict[str, str] | None = None,
    own: list[str] | None = None,
) -> list[GangMember]:
    """The members of a placement on ``node_ids`` (rank order: rank 0 first). With ``network``
    (the region's gang network) and ``own`` (each rank's address on it), the members reach each
    other at those; else at their nodes' ``addresses``."""
    peers = tuple(own) if own is not None else tuple(addresses[n] for n in node_ids)
    world = sum(gpus_per_node)
    return [
        GangMember(
            rank=rank,
            nnodes=len(node_ids),
            local_gpus=gpus_per_node[rank],
            world_size=world,
            master_addr=peers[0],
            master_port=port,
            peers=peers,
            network={**network, "address": peers[rank]} if network is not None and own else None,
        )
        for rank in range(len(node_ids))
    ]


def gang_network_of(node_ids: list[int]) -> tuple[int, GangNetwork] | None:
    """(region id, its gang network) when every node of a placement is in one region that has a
    gang network and every node's agent says it can join it (its heartbeat's ``gang_network``:
    docker with a parent interface); None: the rendezvous goes through rank 0's node."""
    nodes = list(Node.objects.filter(pk__in=node_ids).select_related("region"))
    regions = {n.region_id for n in nodes}
    if len(nodes) != len(set(node_ids)) or len(regions) != 1:
        return None
    if not all((n.status or {}).get("gang_network") is True for n in nodes):
        return None
    region = nodes[0].region
    try:
        network = gang_network_check(
            subnet=region.gang_subnet, range_=region.gang_range, gateway=region.gang_gateway
        )
    except GangNetworkError:
        return None  # a bad setting (the admin refuses one) leaves gangs on the node's address
    return (region.pk, network) if network is not None else None


def gang_addresses_release(*, workload_ids: list[int] | None = None, region_id: int | None = None) -> int:
    """Delete the addresses of members that are gone: their gang no longer holds GPUs, or holds
    them for a later attempt, and no stop of it on the member's node awaits the node's word (a
    member stopped without it may still hold its address there). Of ``workload_ids``, or of the
    region. Returns how many went."""
    rows = GangAddress.objects.all()
    if workload_ids is not None:
        rows = rows.filter(workload_id__in=workload_ids)
    if region_id is not None:
        rows = rows.filter(region_id=region_id)
    pending = Allocation.objects.filter(
        workload_id=OuterRef("workload_id"),
        node_id=OuterRef("node_id"),
        stop_forced_at__isnull=False,
        stop_confirmed_at__isnull=True,
    )
    gone = ~Q(workload__state__in=HOLDING_STATES) | Q(attempt__lt=F("workload__attempt"))
    return rows.filter(gone).exclude(Exists(pending)).delete()[0]


def gang_addresses_release_on_commit(workload_ids: list[int]) -> None:
    """``gang_addresses_release`` once the transaction commits (the stops it sends, and the marks
    on the allocations they leave unconfirmed, are written by then)."""
    ids = list(workload_ids)
    transaction.on_commit(lambda: gang_addresses_release(workload_ids=ids))


def gang_addresses_used(region_id: int) -> set[str]:
    """Addresses of the region's gang network held now (those of members gone are deleted first)."""
    gang_addresses_release(region_id=region_id)
    return set(GangAddress.objects.filter(region_id=region_id).values_list("address", flat=True))


def gang_addresses_choose(
    *, network: GangNetwork, workload_id: int, count: int, used: set[str]
) -> list[str] | None:
    """``count`` free addresses of the network's range, tried from a point that depends on the
    workload (so an address just released is rarely the next one handed out); None when the range
    has too few free (the gang then goes through rank 0's node, as without a gang network)."""
    hosts = network.hosts()
    if not hosts:
        return None
    first = random.Random(workload_id).randrange(len(hosts))
    out: list[str] = []
    for k in range(len(hosts)):
        address = hosts[(first + k) % len(hosts)]
        if address not in used:
            out.append(address)
            if len(out) == count:
                return out
    return None


def gang_network_payload(network: GangNetwork) -> dict[str, str]:
    """What an agent needs to make the region's docker network (all members' the same)."""
    out = {"subnet": str(network.subnet), "range": str(network.range)}
    if network.gateway is not None:
        out["gateway"] = str(network.gateway)
    return out


def node_addresses(node_ids: list[int]) -> dict[int, str]:
    """How members reach each other's node: its advertised address, else its hostname."""
    return {n.pk: n.reach_address for n in Node.objects.filter(pk__in=node_ids).only("address", "hostname")}


def gang_started_nodes(w: Workload, node_ids: list[int]) -> set[int]:
    """Of ``node_ids``, those whose start command of the current attempt succeeded."""
    return set(
        NodeCommand.objects.filter(
            kind=CommandKind.START_WORKLOAD,
            node_id__in=node_ids,
            payload__workload_id=str(w.pk),
            payload__attempt=w.attempt,
            state=CommandState.SUCCEEDED,
        ).values_list("node_id", flat=True)
    )


def gang_member_release(*, w: Workload, node_id: int, now: datetime, reason: str) -> int:
    """End the allocations ``w`` holds on one node (that member is done); returns how many."""
    return Allocation.objects.filter(workload_id=w.pk, node_id=node_id, ended_at__isnull=True).update(
        ended_at=now, end_reason=reason[:64]
    )
