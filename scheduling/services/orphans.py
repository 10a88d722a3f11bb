"""No orphans: the stops that reach a node running work it was not given, and the record of GPUs
released without their node's word until the node confirms it.

- A node that is gone (DOWN) or runs a workload it holds no open allocation of gets a stop that
  waits for it (``orphan_stop``: deadline ``ORPHAN_STOP_TTL``, attempts to match).
- The reaper (``workloads_reap``) answers a heartbeat that lists such a workload starting or
  running: one stop per (workload, node, attempt), none while a stop or preempt is on its way. The
  attempt is the one the node was started with, so the DOWN node's stop and the reaper's for the
  same copy are one command.
- A forced release (stop timeout, forced preemption, node DOWN) marks the allocations
  ``stop_forced_at``; the node's report that the workload is gone (``stop_confirm``: a terminal
  state, a stop or preempt done, or a newest batch that no longer lists it) sets
  ``stop_confirmed_at``. Until then the GPU takes no new work (``scheduling.services.snapshot``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from nodes.models import OPEN_COMMAND_STATES, CommandKind, Node, NodeCommand, NodeWorkloadStatus
from nodes.services.commands import CommandRequest, node_commands_enqueue_many
from nodes.services.heartbeat_parse import TERMINAL_WORKLOAD_STATES
from portal.actors import Actor
from scheduling.models import Allocation, Workload, WorkloadEvent
from scheduling.services.gangs import gang_addresses_release_on_commit

logger = logging.getLogger(__name__)
SYSTEM = Actor.system()


def workload_id_of(raw: Any) -> int | None:
    """A workload id as a node or a payload gives it (a string), or None when it is not one."""
    try:
        return int(str(raw))
    except (TypeError, ValueError):
        return None


# How long a stop for a node that is gone (DOWN) or runs what it should not waits to be delivered.
ORPHAN_STOP_TTL = timedelta(days=30)
# How far back the reaper looks for the attempt a node runs (placements of one workload).
ATTEMPTS_LOOKED_BACK = 64


def orphan_stop(node_id: int, workload_id: str, attempt: int, now: datetime) -> CommandRequest:
    """A stop for work a node should not run, which waits for the node however long it is away:
    the deadline is ORPHAN_STOP_TTL, and redeliveries at the longest backoff last as long."""
    ttl_s = ORPHAN_STOP_TTL.total_seconds()
    return CommandRequest(
        node_id=node_id,
        kind=CommandKind.STOP_WORKLOAD,
        payload={"workload_id": workload_id, "grace_s": settings.SCHEDULING_STOP_GRACE_S},
        idempotency_key=f"stop:{workload_id}:{attempt}:orphan",
        deadline=now + ORPHAN_STOP_TTL,
        max_attempts=max(
            settings.NODE_COMMAND_DEFAULT_MAX_ATTEMPTS, math.ceil(ttl_s / settings.NODE_COMMAND_RETRY_MAX_S)
        ),
    )


def allocations_held(workload_id: int) -> list[int]:
    """Ids of the workload's open allocations (to mark them forced once a transition ends them)."""
    return list(
        Allocation.objects.filter(workload_id=workload_id, ended_at__isnull=True).values_list("pk", flat=True)
    )


def allocations_mark_forced(allocation_ids: list[int], now: datetime) -> None:
    """Released without the node's word: unconfirmed until the node reports the workload gone."""
    if allocation_ids:
        Allocation.objects.filter(pk__in=allocation_ids).update(stop_forced_at=now)


def stop_confirm(*, workload_id: int, node_id: int, now: datetime, how: str) -> bool:
    """The node reported the workload gone: its forced releases there are confirmed (once)."""
    done = Allocation.objects.filter(
        workload_id=workload_id, node_id=node_id, stop_forced_at__isnull=False, stop_confirmed_at__isnull=True
    ).update(stop_confirmed_at=now)
    if not done:
        return False
    gang_addresses_release_on_commit([workload_id])
    w = Workload.objects.only("tenant_id", "state").get(pk=workload_id)
    host = Node.objects.filter(pk=node_id).values_list("hostname", flat=True).first() or f"node {node_id}"
    WorkloadEvent.objects.create(
        tenant_id=w.tenant_id,
        workload_id=workload_id,
        at=now,
        from_state=w.state,
        to_state=w.state,
        reason="stop_confirmed",
        message=f"{host} reported it gone ({how}): the stop is confirmed.",
        actor_repr=str(SYSTEM),
        data={"node_id": node_id},
    )
    logger.info("workload %s: stop confirmed on node %s (%s)", workload_id, node_id, how)
    return True


def workloads_reap(*, node_id: int, workload_ids: list[str]) -> list[str]:
    """The reaper: of the workloads a node's heartbeat lists starting or running, stop those it
    holds no open allocation of (placed elsewhere, finished, requeued, or unknown to the portal).
    One query when all are in place; for an orphan, one stop per (workload, node, attempt), and none
    while a stop or preempt of it is still on its way to that node. Returns the ids stopped.

    The attempt is that of the copy the node runs (its last start there), not the workload's
    current one: a DOWN node's stop (``workloads_on_node_down``) and the reaper's stop for the same
    copy then share one idempotency key, so a batch built before that stop took effect, or two
    batches reaped at once, add no second stop (the key's unique index settles a race)."""
    numbers = {raw: workload_id_of(raw) for raw in workload_ids}
    placed = set(
        Allocation.objects.filter(
            node_id=node_id,
            ended_at__isnull=True,
            workload_id__in={n for n in numbers.values() if n is not None},
        ).values_list("workload_id", flat=True)
    )
    orphans = [raw for raw, n in numbers.items() if n is None or n not in placed]
    if not orphans:
        return []
    now = timezone.now()
    with transaction.atomic():
        attempts = dict(
            Workload.objects.filter(
                pk__in={numbers[r] for r in orphans if numbers[r] is not None}
            ).values_list("pk", "attempt")
        )
        on_the_way = {
            str(x)  # SQLite gives a numeric string back as a number
            for x in NodeCommand.objects.filter(
                node_id=node_id,
                kind__in=(CommandKind.STOP_WORKLOAD, CommandKind.PREEMPT_WORKLOAD),
                state__in=OPEN_COMMAND_STATES,
                payload__workload_id__in=orphans,
            ).values_list("payload__workload_id", flat=True)
        }
        ran_here = _attempts_started(node_id, {raw: numbers[raw] for raw in orphans}, attempts)
        stops = [
            orphan_stop(node_id, raw, ran_here.get(raw, attempts.get(numbers[raw], 0)), now)
            for raw in orphans
            if raw not in on_the_way
        ]
        stops = _again_if_done(node_id, stops, now)
        made = node_commands_enqueue_many(commands=stops, now=now)
    fresh = [c.payload["workload_id"] for c in made if c.created_at == now]
    if fresh:
        logger.warning("Node %s runs workloads it was not given; stopping %s", node_id, ", ".join(fresh))
    return fresh


def _again_if_done(node_id: int, stops: list[CommandRequest], now: datetime) -> list[CommandRequest]:
    """A copy the node started after its stop was done there gets a stop of its own: a healed
    node given a start and the stop of one workload in one poll ran the stop first ("not known on
    this node": done), then the start, and the stop's key (per workload, node and attempt) let no
    second one through. Only when the copy's start finished after the last of its stops (a batch
    built before a stop took effect, arriving late, adds none); each further key counts the
    earlier ones (``...:orphan:2``), so the unique index still settles two batches at once."""
    if not stops:
        return stops
    keys = {c.idempotency_key: c for c in stops}
    done = dict(
        NodeCommand.objects.filter(node_id=node_id, idempotency_key__in=list(keys))
        .exclude(state__in=OPEN_COMMAND_STATES)
        .values_list("idempotency_key", "finished_at")
    )
    if not done:
        return stops
    out = []
    for key, command in keys.items():
        if key not in done:
            out.append(command)
            continue
        _, wid, attempt, _ = key.split(":", 3)
        started = (
            NodeCommand.objects.filter(node_id=node_id, idempotency_key=f"start:{wid}:{attempt}")
            .values_list("finished_at", flat=True)
            .first()
        )
        later = list(
            NodeCommand.objects.filter(node_id=node_id, idempotency_key__startswith=f"{key}:").values_list(
                "state", "finished_at"
            )
        )
        if any(state in OPEN_COMMAND_STATES for state, _ in later):
            continue  # a stop of that copy is on its way
        last_stop = max([done[key], *(f for _, f in later)], key=lambda f: f or now)
        if started is not None and last_stop is not None and started > last_stop:
            out.append(dataclasses.replace(command, idempotency_key=f"{key}:{len(later) + 2}"))
    return out


def _attempts_started(
    node_id: int, numbers: dict[str, int | None], attempts: dict[int, int]
) -> dict[str, int]:
    """The attempt of the copy of each workload that the node runs: its last start there, found by
    the start commands' idempotency keys (``start:<id>:<attempt>``, unique per node, indexed), of
    the workload's last ATTEMPTS_LOOKED_BACK attempts."""
    keys = {
        f"start:{n}:{k}": (raw, k)
        for raw, n in numbers.items()
        if n is not None
        for k in range(max(attempts.get(n, 0) - ATTEMPTS_LOOKED_BACK, 0) + 1, attempts.get(n, 0) + 1)
    }
    if not keys:
        return {}
    ran: dict[str, int] = {}
    for key in NodeCommand.objects.filter(node_id=node_id, idempotency_key__in=keys).values_list(
        "idempotency_key", flat=True
    ):
        raw, k = keys[key]
        ran[raw] = max(ran.get(raw, 0), k)
    return ran


def stops_confirm_unlisted(now: datetime) -> list[int]:
    """Forced releases whose node has sent a heartbeat since and no longer lists the workload as
    starting or running (its status rows are what its newest batch says): confirmed."""
    pending = set(
        Allocation.objects.filter(
            stop_forced_at__isnull=False,
            stop_confirmed_at__isnull=True,
            node__last_heartbeat_at__gt=F("stop_forced_at"),
        ).values_list("workload_id", "node_id")
    )
    if not pending:
        return []
    listed = set(
        NodeWorkloadStatus.objects.filter(
            node_id__in={n for _, n in pending}, workload_id__in={str(w) for w, _ in pending}
        )
        .exclude(state__in=TERMINAL_WORKLOAD_STATES)
        .values_list("workload_id", "node_id")
    )
    starting = _starts_in_flight(pending)
    confirmed = []
    for wid, node_id in sorted(pending):
        if (str(wid), node_id) not in listed and (str(wid), node_id) not in starting:
            with transaction.atomic():
                if stop_confirm(workload_id=wid, node_id=node_id, now=now, how="no longer listed"):
                    confirmed.append(wid)
    return confirmed


def _starts_in_flight(pairs: set[tuple[int, int]]) -> set[tuple[str, int]]:
    """(workload, node) of ``pairs`` whose start the node may yet run: the start is still open
    (pending, or delivered with no report: its answer may have been lost) and the workload has not
    run since it was placed (no RUNNING event: the node never showed it had the start), or the
    start was reported after the node's last heartbeat. A batch that does not list the workload is
    then no word that it is gone: a partitioned node's buffered batches, older than the start,
    arrive first when it heals, and the start follows."""
    nodes = {n for _, n in pairs}
    last = dict(Node.objects.filter(pk__in=nodes).values_list("pk", "last_heartbeat_at"))
    placed: dict[int, datetime] = {}
    for wid, started in Allocation.objects.filter(
        workload_id__in={w for w, _ in pairs}, node_id__in=nodes, stop_confirmed_at__isnull=True
    ).values_list("workload_id", "started_at"):
        placed[wid] = min(started, placed.get(wid, started))
    ran = {
        wid
        for wid, at in WorkloadEvent.objects.filter(
            workload_id__in=set(placed), to_state="running"
        ).values_list("workload_id", "at")
        if at >= placed[wid]
    }
    out = set()
    for wid, node_id, state, finished in NodeCommand.objects.filter(
        node_id__in=nodes,
        kind=CommandKind.START_WORKLOAD,
        payload__workload_id__in=[str(w) for w, _ in pairs],
    ).values_list("payload__workload_id", "node_id", "state", "finished_at"):
        heard = last.get(node_id)
        unseen = state in OPEN_COMMAND_STATES and workload_id_of(wid) not in ran
        if unseen or (finished is not None and heard is not None and finished >= heard):
            out.add((str(wid), node_id))
    return out
