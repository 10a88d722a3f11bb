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

from nodes.models import CommandKind, CommandState, Node, NodeCommand
from scheduling.models import HOLDING_STATES, Allocation, Workload


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
    """Every member's node address, by rank."""


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
    *, node_ids: list[int], gpus_per_node: list[int], port: int, addresses: dict[int, str]
) -> list[GangMember]:
    """The members of a placement on ``node_ids`` (rank order: rank 0 first)."""
    peers = tuple(addresses[n] for n in node_ids)
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
        )
        for rank in range(len(node_ids))
    ]


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
