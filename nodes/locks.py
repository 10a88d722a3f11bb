"""Every row lock the fleet takes, in one place (Saleor's ``lock_objects.py``).

Lock order, to keep deadlocks out: a bootstrap token, then a RolloutCampaign, then its RolloutStep
rows, then Node rows (several: oldest heartbeat
first, ties by id), then Gpu rows, then NodeCommand rows, then SequenceGap rows. A FleetAlert is
locked on its own. Code that needs several takes them in that order. One node lock is not here: a
heartbeat's head statement (``nodes/services/ingest.py``) locks its node row in the same statement
that checks the credential and records the batch, as the hot path's one round trip; it too comes
before the SequenceGap a late batch fills. Nodes announce changes to scheduling after commit
(``send_on_commit``), so none of these is held while scheduling takes its own (``scheduling/locks.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Q, QuerySet

from nodes.models import (
    FleetAlert,
    Gpu,
    Node,
    NodeBootstrapToken,
    NodeCommand,
    RolloutCampaign,
    RolloutStep,
    SequenceGap,
)


def lock_bootstrap_token(*, key_id: str) -> NodeBootstrapToken | None:
    """The bootstrap token of ``key_id``, locked: two registrations with one token run one after the
    other, so it is spent once."""
    return NodeBootstrapToken.objects.select_for_update().filter(key_id=key_id).first()


def lock_node(*, node_id: int) -> Node:
    """One node row, locked until the transaction ends (staff state changes go through this)."""
    return Node.objects.select_for_update().get(pk=node_id)


def lock_node_if_exists(*, node_id: int) -> Node | None:
    return Node.objects.select_for_update().filter(pk=node_id).first()


def lock_node_by_hostname(*, hostname: str) -> Node | None:
    """The node of ``hostname``, if there is one, locked: a registration that re-keys or retries
    holds it while it checks and rewrites the node."""
    return Node.objects.select_for_update().filter(hostname=hostname).first()


def lock_silent_nodes(*, watched: QuerySet[Node], silent: Q) -> list[Node]:
    """The ``watched`` nodes matching ``silent``, locked oldest heartbeat first (ties by id), with
    only the fields the silence reconciler reads."""
    return list(
        watched.filter(silent)
        .select_for_update()
        .order_by("last_heartbeat_at", "registered_at", "id")
        .only("id", "state", "last_heartbeat_at", "registered_at", "hostname")
    )


def lock_gpus_by_uuid(*, uuids: Iterable[str]) -> dict[str, Gpu]:
    """The GPUs of these UUIDs, on any node, locked by UUID: a registration running beside another
    cannot take them between its check and its write. Locked in id order, so that two registrations
    listing the same GPUs in another order wait for each other instead of deadlocking."""
    rows = Gpu.objects.select_for_update().filter(uuid__in=list(uuids)).order_by("pk")
    return {g.uuid: g for g in rows}


def lock_gpu(*, gpu_id: int) -> Gpu:
    """One GPU row, locked until the transaction ends (staff health actions go through this)."""
    return Gpu.objects.select_for_update().get(pk=gpu_id)


def lock_gpu_and_node(*, gpu_id: int) -> Gpu:
    """One GPU row and its node's, in the lock order (node first), until the transaction ends: a
    change that writes a command for the node (a staff MIG change) must not hold the GPU while it
    waits on the node (a heartbeat holds the node and writes its GPUs)."""
    while True:
        node_id = Gpu.objects.values_list("node_id", flat=True).get(pk=gpu_id)
        lock_node(node_id=node_id)
        gpu = lock_gpu(gpu_id=gpu_id)
        if gpu.node_id == node_id:  # (a registration may move a GPU to another node meanwhile)
            return gpu


def lock_command(*, command_id, node_id: int) -> NodeCommand | None:
    """One command of a node, locked while the agent's report on it is applied."""
    return NodeCommand.objects.select_for_update().filter(pk=command_id, node_id=node_id).first()


def lock_commands_where(*conditions: Q, **filters) -> QuerySet[NodeCommand]:
    """Commands matching the conditions, locked; rows another transaction holds are skipped (the
    next long poll or expiry run comes back to them), so delivery and expiry never wait on each
    other. The caller orders and slices."""
    return NodeCommand.objects.select_for_update(skip_locked=True).filter(*conditions, **filters)


def lock_sequence_gap(*, node_id: int, epoch: int, seq: int) -> SequenceGap | None:
    """The recorded gap of a node's epoch that ``seq`` falls in, locked while a late batch fills it."""
    return (
        SequenceGap.objects.select_for_update()
        .filter(node_id=node_id, epoch=epoch, first_seq__lte=seq, last_seq__gte=seq)
        .first()
    )


def lock_fleet_alert(*, alert_id: int) -> FleetAlert:
    return FleetAlert.objects.select_for_update().get(pk=alert_id)


def lock_rollout(*, campaign_id: int) -> RolloutCampaign:
    """One rollout campaign, locked: staff actions and the advance step change it one at a time."""
    return RolloutCampaign.objects.select_for_update().get(pk=campaign_id)


def lock_rollout_steps(*, campaign_id: int, states: Iterable[str]) -> list[RolloutStep]:
    """The campaign's steps in these states, locked, in the campaign's order (take the campaign's
    lock first)."""
    return list(
        RolloutStep.objects.select_for_update()
        .filter(campaign_id=campaign_id, state__in=list(states))
        .order_by("position")
    )
