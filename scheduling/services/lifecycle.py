"""What happens to placed workloads: a tenant stops one; a workload is preempted (by the cycle for
higher-priority work, or by another app through ``workload_preempt``); the fleet reports a command
finished, a workload exited, a node down or a GPU unhealthy; and the reconciler finishes what a crash
or a lost message left (not started in time, stuck preempting or stopping, over its maximum runtime).

Every function here locks the workload rows it changes (``scheduling.locks``) and goes through
``workload_transition``; handlers ignore reports that belong to an earlier placement (another node
or another attempt), so at-least-once delivery and replays change nothing. Only the nodes that hold
a workload (its open allocations) move it; the reconciler trusts no other node's status either.

No orphans: a node runs only what the portal placed there.
- A DOWN node's workloads are requeued or failed at once; the node itself gets a stop for each,
  queued to wait for its return (``orphans.ORPHAN_STOP_TTL``: no expiry, nor attempts run out, in
  any outage the fleet plausibly has), and a requeued job avoids that node.
- The reaper (``orphans.workloads_reap``): a heartbeat that lists a workload starting or running on a node
  that holds no open allocation of it (placed elsewhere, finished, or unknown) is answered with a
  stop, one per (workload, node, attempt), none while one is on its way.
- A release without the node's word (stop timeout, forced preemption, node DOWN) marks the
  allocations ``stop_forced_at``: unconfirmed until the node reports the workload gone (a terminal
  state, a stop or preempt command done, or a newest heartbeat that no longer lists it), which sets
  ``stop_confirmed_at``. Meanwhile its GPUs take no new work (``scheduling.services.snapshot``).
- Billing: a DOWN node's allocations end at its last heartbeat, the last moment the portal knew
  it ran (``metering.services.usage``); what the node reports after it returns changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import DateTimeField, F, Value
from django.db.models.functions import Greatest
from django.utils import timezone

from nodes.models import (
    CommandKind,
    CommandState,
    Node,
    NodeCommand,
    NodeState,
    NodeWorkloadStatus,
)
from nodes.services.commands import CommandRequest, node_command_enqueue, node_commands_enqueue_many
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.events import publish
from portal.logging import log_context
from portal.services.audit import audit_record
from scheduling.locks import lock_workload, lock_workload_if_exists, lock_workloads, lock_workloads_where
from scheduling.models import (
    HOLDING_STATES,
    TERMINAL_STATES,
    WAITING_STATES,
    Allocation,
    Workload,
    WorkloadEvent,
    WorkloadKind,
)
from scheduling.models import WorkloadState as S
from scheduling.services.access import workload_ports_record
from scheduling.services.gangs import gang_member_release, gang_started_nodes
from scheduling.services.orphans import (
    allocations_held,
    allocations_mark_forced,
    orphan_stop,
    stop_confirm,
    stops_confirm_unlisted,
    workload_id_of,
)
from scheduling.services.states import can_transition, workload_transition
from scheduling.services.triggers import cycle_request

logger = logging.getLogger(__name__)
SYSTEM = Actor.system()
# States whose work may be preempted (a workload already being stopped or preempted is leaving).
PREEMPTIBLE_STATES = (S.SCHEDULED, S.STARTING, S.RUNNING)
AVOID_NODES_KEPT = 16


def _nodes_of(workload_id: int) -> list[int]:
    """The agent nodes a workload holds GPUs on (a Slurm region's job is stopped by ``scancel``,
    ``scheduling.services.slurm``: its nodes get no commands)."""
    return sorted(
        set(
            Allocation.objects.filter(workload_id=workload_id, ended_at__isnull=True)
            .exclude(node__state=NodeState.SLURM)
            .values_list("node_id", flat=True)
        )
    )


def _send_stop(w: Workload, node_ids: list[int], *, now: datetime, why: str) -> None:
    for node_id in node_ids:
        node_command_enqueue(
            node=Node(pk=node_id),
            kind=CommandKind.STOP_WORKLOAD,
            payload={"workload_id": str(w.pk), "grace_s": settings.SCHEDULING_STOP_GRACE_S},
            idempotency_key=f"stop:{w.pk}:{w.attempt}:{why}",
            now=now,
        )


def _requeue_or_fail(w: Workload, *, reason: str, message: str, now: datetime, count_retry: bool) -> None:
    """A job goes back to the queue (while retries last, when ``count_retry``); an instance fails."""
    if w.kind == WorkloadKind.JOB and w.stop_requested_at is None and can_transition(w, S.QUEUED):
        if not count_retry or w.retries < w.max_retries:
            if count_retry:
                w.retries += 1
            w.preempted_for = None
            w.save(update_fields=["retries", "preempted_for"])
            workload_transition(
                workload=w, to=S.QUEUED, reason=reason, actor=SYSTEM, message=message, now=now
            )
            return
        message = f"{message} No retries left ({w.max_retries})."
    to = S.STOPPED if w.stop_requested_at is not None or w.state == S.STOPPING else S.FAILED
    workload_transition(workload=w, to=to, reason=reason, actor=SYSTEM, message=message, now=now)


def _avoid(w: Workload, node_ids: list[int]) -> None:
    """Remember nodes that failed to start ``w``: the engine places it elsewhere if it can."""
    ids = list(dict.fromkeys([*(int(n) for n in w.avoid_nodes), *node_ids]))[-AVOID_NODES_KEPT:]
    if ids != w.avoid_nodes:
        w.avoid_nodes = ids
        w.save(update_fields=["avoid_nodes"])


def _not_started_on(w: Workload, node_ids: list[int]) -> list[int]:
    """Of ``node_ids``, those whose start command of the current attempt has not succeeded."""
    done = set(
        NodeCommand.objects.filter(
            kind=CommandKind.START_WORKLOAD,
            node_id__in=node_ids,
            payload__workload_id=str(w.pk),
            payload__attempt=w.attempt,
            state=CommandState.SUCCEEDED,
        ).values_list("node_id", flat=True)
    )
    return [n for n in node_ids if n not in done] or node_ids


def _gang_nodes(w: Workload) -> list[int] | None:
    """The nodes of ``w``'s current placement when it is a gang (or spans nodes), else None."""
    nodes = _nodes_of(w.pk)
    return nodes if (w.gang or len(nodes) > 1) else None


def _all_started(w: Workload, nodes: list[int]) -> bool:
    return gang_started_nodes(w, nodes) >= set(nodes)


def _gang_fail(w: Workload, *, failed_node: int | None, now: datetime, why: str, end) -> None:
    """A gang member failed (or the gang did not start in time): ``end()`` moves the workload on
    (requeue or fail, which releases every allocation), every other member is sent a stop, and the
    GPUs of the members that had started take no new work until their node confirms the stop."""
    nodes = _nodes_of(w.pk)
    others = [n for n in nodes if n != failed_node]
    started = gang_started_nodes(w, others)
    forced = list(
        Allocation.objects.filter(
            workload_id=w.pk, node_id__in=list(started), ended_at__isnull=True
        ).values_list("pk", flat=True)
    )
    end()
    allocations_mark_forced(forced, now)
    _send_stop(w, others, now=now, why=why)


# --- preemption ------------------------------------------------------------------------------------


def preempt_notice_s(plan: str) -> int:
    notices = settings.SCHEDULING_PREEMPTION_NOTICE_S
    return int(notices.get(plan, notices.get("default", 30)))


def preempt_begin(
    *,
    workload: Workload,
    node_ids: list[int],
    reason: str,
    message: str,
    actor: Actor,
    now: datetime,
    notice_s: int | None = None,
    preemptor: Workload | None = None,
    data: dict[str, Any] | None = None,
) -> list[CommandRequest]:
    """Preempt a locked, placed workload: PREEMPTED (with its event), and the preempt commands (with
    notice) for its nodes, which the caller enqueues. When the agent reports it stopped, or the
    notice and a grace have passed (the reconciler), a job that requeues on preemption goes back to
    the queue and resumes from its checkpoint; anything else stops (``_finish_preempted``). The one
    way the cycle's victims and ``workload_preempt`` go."""
    w = workload
    notice = preempt_notice_s(w.plan) if notice_s is None else notice_s
    w.preempted_for = preemptor
    w.save(update_fields=["preempted_for"])
    workload_transition(
        workload=w,
        to=S.PREEMPTED,
        reason=reason,
        actor=actor,
        message=message.replace("{notice}", str(notice)),
        data={**(data or {}), "notice_s": notice},
        now=now,
    )
    # The tenant's notice (live and webhooks): the workload is stopped after notice_s seconds.
    publish(
        tenant_id=w.tenant_id,
        event={
            "type": "workload.preemption_notice",
            "workload_id": w.pk,
            "kind": w.kind,
            "reason": reason,
            "notice_s": notice,
            "stop_at": (now + timedelta(seconds=notice)).isoformat(),
            "requeues": w.kind == WorkloadKind.JOB and w.requeue_on_preemption,
            "at": now.isoformat(),
        },
    )
    return [
        CommandRequest(
            node_id=node_id,
            kind=CommandKind.PREEMPT_WORKLOAD,
            payload={"workload_id": str(w.pk), "notice_s": notice},
            idempotency_key=f"preempt:{w.pk}:{w.attempt}",
        )
        for node_id in sorted(set(node_ids))
    ]


def workload_preempt(
    *, workload: Workload, reason: str, notice_s: int | None = None, actor: Actor | None = None
) -> Workload:
    """Preempt a placed workload for a cause outside the cycle (e.g. metering, when the spot price
    passes the workload's maximum): the preempt command with notice (the plan's default unless
    ``notice_s``), the event with ``reason``, and then a job requeues (from its checkpoint) or an
    instance stops, exactly as for the cycle's victims."""
    if not isinstance(reason, str) or not reason.strip() or len(reason.strip()) > 64:
        raise ValidationFailed(
            "reason: 1 to 64 characters.", fields={"reason": ["Give the cause in 1 to 64 characters."]}
        )
    if notice_s is not None and (
        isinstance(notice_s, bool) or not isinstance(notice_s, int) or not 0 <= notice_s <= 86400
    ):
        raise ValidationFailed(
            "notice_s: whole seconds, 0 to 86400.", fields={"notice_s": ["Whole seconds, 0 to 86400."]}
        )
    reason = reason.strip()
    actor = actor or SYSTEM
    now = timezone.now()
    with log_context(workload_id=workload.pk), transaction.atomic():
        w = lock_workload(workload_id=workload.pk)
        if w.state not in PREEMPTIBLE_STATES:
            raise Conflict(
                f"A {w.state} {w.kind} cannot be preempted.", fields={"state": [f"{w.state} is not placed."]}
            )
        commands = preempt_begin(
            workload=w,
            node_ids=_nodes_of(w.pk),
            reason=reason,
            message=f"Preempted ({reason}); stopping in " + "{notice} s.",
            actor=actor,
            now=now,
            notice_s=notice_s,
            data={"cause": reason},
        )
        node_commands_enqueue_many(commands=commands, now=now)
        if actor.kind != "system":
            audit_record(
                tenant=w.tenant, actor=actor, action=f"{w.kind}.preempt", target=w, data={"reason": reason}
            )
    return w


def _notices(ids: list[int]) -> dict[int, int]:
    """The notice each PREEMPTED workload was given (its latest PREEMPTED event)."""
    out: dict[int, int] = {}
    for wid, data in (
        WorkloadEvent.objects.filter(workload_id__in=ids, to_state=S.PREEMPTED)
        .order_by("at", "id")
        .values_list("workload_id", "data")
    ):
        if isinstance(data, dict) and isinstance(data.get("notice_s"), int):
            out[wid] = data["notice_s"]
    return out


# --- tenants ---------------------------------------------------------------------------------------


def workload_stop(
    *, workload: Workload, actor: Actor, now: datetime | None = None, reason: str = "", message: str = ""
) -> Workload:
    """Stop a workload: a waiting one stops at once; a placed one is told to stop (STOPPING) and
    stops when the agent reports it; one being preempted is stopped instead of requeued. Another
    app stopping it names its cause: ``reason`` (a short code, e.g. ``tenant_suspended``) and
    ``message`` go into the event instead of the user's stop."""
    now = now or timezone.now()
    with log_context(workload_id=workload.pk), transaction.atomic():
        w = lock_workload(workload_id=workload.pk)
        if w.state in TERMINAL_STATES or w.state == S.STOPPING or w.stop_requested_at is not None:
            raise Conflict(f"This {w.kind} is already {w.state}.", fields={"state": [w.state]})
        w.stop_requested_at = now
        w.save(update_fields=["stop_requested_at"])
        if w.array_count is not None:
            _array_stop(w, actor=actor, now=now, reason=reason, message=message)
        elif w.state in WAITING_STATES:
            workload_transition(
                workload=w,
                to=S.STOPPED,
                reason=reason or "stopped_by_user",
                message=message,
                actor=actor,
                now=now,
            )
        else:
            nodes = _nodes_of(w.pk)
            if w.state != S.PREEMPTED:
                workload_transition(
                    workload=w,
                    to=S.STOPPING,
                    reason=reason or "stop_requested",
                    message=message,
                    actor=actor,
                    now=now,
                )
            _send_stop(w, nodes, now=now, why="user")
        audit_record(
            tenant=w.tenant,
            actor=actor,
            action=f"{w.kind}.stop",
            target=w,
            data={"reason": reason} if reason else None,
        )
    return w


def _array_stop(w: Workload, *, actor: Actor, now: datetime, reason: str, message: str) -> None:
    """An array job stops at once and makes no more tasks; each unfinished task is stopped as a
    job is (``scheduling.services.arrays``)."""
    workload_transition(
        workload=w, to=S.STOPPED, reason=reason or "stopped_by_user", message=message, actor=actor, now=now
    )
    tasks = Workload.objects.filter(array_parent=w, stop_requested_at__isnull=True).exclude(
        state__in=[*TERMINAL_STATES, S.STOPPING]
    )
    for task in tasks.order_by("pk"):
        workload_stop(
            workload=task,
            actor=actor,
            now=now,
            reason=reason or "array_stopped",
            message=message or f"Array job {w.pk} was stopped.",
        )


# --- the fleet's reports ---------------------------------------------------------------------------


def workload_on_command_finished(*, kind: str, payload: dict, node_id: int, state: str, result: dict) -> None:
    """A start, stop or preempt command reached a final state."""
    wid = workload_id_of(payload.get("workload_id"))
    if wid is None:
        return
    now = timezone.now()
    with log_context(workload_id=wid), transaction.atomic():
        w = lock_workload_if_exists(workload_id=wid)
        if (
            w is not None
            and state == CommandState.SUCCEEDED
            and kind in (CommandKind.STOP_WORKLOAD, CommandKind.PREEMPT_WORKLOAD)
        ):
            stop_confirm(workload_id=w.pk, node_id=node_id, now=now, how=f"{kind} done")
        if w is None or node_id not in _nodes_of(w.pk):
            return  # an earlier placement's command, or the workload has moved on
        if kind == CommandKind.START_WORKLOAD:
            if payload.get("attempt", w.attempt) != w.attempt:
                return
            if state == CommandState.SUCCEEDED:
                target = S.STARTING if result.get("state") == "starting" else S.RUNNING
                gang = _gang_nodes(w)
                if gang is not None and not _all_started(w, gang):
                    pass  # a gang runs when every member has started
                elif w.state == S.SCHEDULED or (w.state == S.STARTING and target == S.RUNNING):
                    workload_transition(workload=w, to=target, reason="started", actor=SYSTEM, now=now)
                if w.state in (S.STARTING, S.RUNNING) or gang is not None:
                    workload_ports_record(workload=w, node_id=node_id, result=result)
            elif w.state == S.SCHEDULED:
                why = result.get("reason") or result.get("error") or state
                _avoid(w, [node_id])
                if _gang_nodes(w) is not None:
                    _gang_fail(
                        w,
                        failed_node=node_id,
                        now=now,
                        why="gang_start_failed",
                        end=lambda: _start_failed(w, result, why, now),
                    )
                    return
                _start_failed(w, result, why, now)
        elif kind == CommandKind.STOP_WORKLOAD and state == CommandState.SUCCEEDED and w.state == S.STOPPING:
            workload_transition(workload=w, to=S.STOPPED, reason="stopped", actor=SYSTEM, now=now)
        elif (
            kind == CommandKind.PREEMPT_WORKLOAD
            and state == CommandState.SUCCEEDED
            and w.state == S.PREEMPTED
        ):
            _finish_preempted(w, now=now)


def _start_failed(w: Workload, result: dict, why: Any, now: datetime) -> None:
    """A start failed on a node: fail the workload when every node would fail it (the payload was
    refused) or after the last attempt, else place it again."""
    if result.get("rejected") is True:
        # The agent refused the payload itself (the workload rules), or the portal could not
        # complete it (a secret gone): every node would fail it.
        by = "Not started" if result.get("refused_by") == "portal" else "Refused by the node"
        message = f"{by}: {why}"
        to = S.FAILED
    elif w.attempt >= settings.SCHEDULING_MAX_START_ATTEMPTS:
        message, to = f"Could not start after {w.attempt} attempts: {why}", S.FAILED
    else:
        message, to = str(why), S.QUEUED
    workload_transition(workload=w, to=to, reason="start_failed", actor=SYSTEM, message=message, now=now)


def _finish_preempted(w: Workload, *, now: datetime, note: str = "") -> None:
    if w.kind == WorkloadKind.JOB and w.requeue_on_preemption and w.stop_requested_at is None:
        w.preempted_for = None
        w.save(update_fields=["preempted_for"])
        message = (
            "Back in the queue; it resumes from its checkpoint."
            if w.checkpoint_resume
            else "Back in the queue."
        )
        workload_transition(
            workload=w, to=S.QUEUED, reason="preempted", actor=SYSTEM, message=f"{note}{message}", now=now
        )
    else:
        workload_transition(workload=w, to=S.STOPPED, reason="preempted", actor=SYSTEM, message=note, now=now)


def workload_on_running(*, node_id: int, workload_id: Any) -> Workload | None:
    """The agent reports the workload running: a STARTING one (or a SCHEDULED one whose start
    report is still on its way) is RUNNING now, without waiting for the reconciler. A report from a
    node the workload no longer holds changes nothing."""
    wid = workload_id_of(workload_id)
    if wid is None:
        return None
    now = timezone.now()
    with log_context(workload_id=wid), transaction.atomic():
        w = lock_workload_if_exists(workload_id=wid)
        if w is None or w.state not in (S.SCHEDULED, S.STARTING) or node_id not in _nodes_of(w.pk):
            return w
        gang = _gang_nodes(w)
        if gang is not None and not _all_started(w, gang):
            return w  # a gang runs when every member has started
        workload_transition(workload=w, to=S.RUNNING, reason="running", actor=SYSTEM, now=now)
    return w


def workload_on_exited(
    *, node_id: int, workload_id: Any, state: str, exit_code: int | None, message: str = ""
) -> Workload | None:
    """The agent reported the workload in a terminal state (exited, failed, stopped, preempted)."""
    wid = workload_id_of(workload_id)
    if wid is None:
        return None
    now = timezone.now()
    with log_context(workload_id=wid), transaction.atomic():
        w = lock_workload_if_exists(workload_id=wid)
        if w is not None:
            stop_confirm(workload_id=w.pk, node_id=node_id, now=now, how=f"reported {state}")
        if w is None or w.state not in HOLDING_STATES or node_id not in _nodes_of(w.pk):
            return w
        w.exit_code = exit_code
        if message:
            w.log_tail = message[-settings.SCHEDULING_LOG_TAIL_CHARS :]
        w.save(update_fields=["exit_code", "log_tail"])
        detail = f"exit code {exit_code}" if exit_code is not None else state
        gang = _gang_nodes(w)
        if (
            gang is not None
            and w.state in (S.SCHEDULED, S.STARTING, S.RUNNING)
            and w.stop_requested_at is None
        ):
            _gang_member_exited(w, node_id, gang, state, exit_code, detail, message, now)
        elif w.state == S.PREEMPTED:
            _finish_preempted(w, now=now)
        elif w.state == S.STOPPING or w.stop_requested_at is not None:
            workload_transition(
                workload=w, to=S.STOPPED, reason="stopped", actor=SYSTEM, message=detail, now=now
            )
        elif state == "exited" and exit_code == 0:
            to = S.SUCCEEDED if w.kind == WorkloadKind.JOB else S.STOPPED
            workload_transition(workload=w, to=to, reason="exited", actor=SYSTEM, message=detail, now=now)
        elif state == "stopped":
            workload_transition(
                workload=w, to=S.STOPPED, reason="stopped", actor=SYSTEM, message=detail, now=now
            )
        elif state == "preempted":
            _finish_preempted(w, now=now)
        else:
            _requeue_or_fail(
                w, reason="failed", message=f"Failed ({detail}). {message[:200]}", now=now, count_retry=True
            )
    return w


def _gang_member_exited(
    w: Workload,
    node_id: int,
    nodes: list[int],
    state: str,
    exit_code: int | None,
    detail: str,
    message: str,
    now: datetime,
) -> None:
    """One member of a running gang ended. Exit 0: its GPUs go back now, and the gang succeeds
    (a job) or stops (an instance) with its last member. Anything else: the whole gang stops and
    is requeued or failed by its policy."""
    if state == "exited" and exit_code == 0:
        if len(nodes) > 1:
            gang_member_release(w=w, node_id=node_id, now=now, reason="member_exited")
            return
        to = S.SUCCEEDED if w.kind == WorkloadKind.JOB else S.STOPPED
        workload_transition(workload=w, to=to, reason="exited", actor=SYSTEM, message=detail, now=now)
        return
    host = Node.objects.filter(pk=node_id).values_list("hostname", flat=True).first() or f"node {node_id}"
    _gang_fail(
        w,
        failed_node=node_id,
        now=now,
        why="gang_member_failed",
        end=lambda: _requeue_or_fail(
            w,
            reason="failed",
            message=f"A gang member failed on {host} ({detail}); every member is stopped. {message[:200]}",
            now=now,
            count_retry=True,
        ),
    )


def workloads_on_node_down(
    *, node_id: int, reason: str = "", last_heartbeat_at: datetime | None = None
) -> list[int]:
    """A node is DOWN: its jobs go back to the queue (to another node if one can take them), its
    instances fail (with the reason). Gangs are stopped on their other nodes, and the DOWN node is
    sent a stop for each that waits for its return. Its allocations end at its last heartbeat (the
    billing rule) and are released unconfirmed until it reports the workloads gone."""
    now = timezone.now()
    why = reason or "The node stopped sending heartbeats."
    with transaction.atomic():
        ids = set(
            Allocation.objects.filter(node_id=node_id, ended_at__isnull=True).values_list(
                "workload_id", flat=True
            )
        )
        moved = []
        stops = []
        for w in lock_workloads(ids=ids).values():
            if w.state not in HOLDING_STATES:
                continue
            others = [n for n in _nodes_of(w.pk) if n != node_id]
            _requeue_or_fail(w, reason="node_down", message=why, now=now, count_retry=False)
            _avoid(w, [node_id])
            _send_stop(w, others, now=now, why="node_down")
            stops.append(orphan_stop(node_id, str(w.pk), w.attempt, now))
            moved.append(w.pk)
        if moved:
            node_commands_enqueue_many(commands=stops, now=now)
            ended = {"stop_forced_at": now}
            if last_heartbeat_at is not None and last_heartbeat_at < now:
                ended["ended_at"] = Greatest(F("started_at"), Value(last_heartbeat_at, DateTimeField()))
            Allocation.objects.filter(workload_id__in=moved, node_id=node_id, ended_at=now).update(**ended)
    return moved


def workloads_on_gpu_unhealthy(*, gpu_id: int, node_id: int, reason: str) -> list[int]:
    """A GPU failed (and is isolated): work on it is stopped there; jobs are queued again to run
    elsewhere, instances fail with the reason (their local state cannot move)."""
    now = timezone.now()
    with transaction.atomic():
        ids = set(
            Allocation.objects.filter(gpu_id=gpu_id, ended_at__isnull=True).values_list(
                "workload_id", flat=True
            )
        )
        moved = []
        for w in lock_workloads(ids=ids).values():
            if w.state not in HOLDING_STATES:
                continue
            nodes = _nodes_of(w.pk)
            _requeue_or_fail(
                w, reason="gpu_unhealthy", message=f"GPU failed: {reason}", now=now, count_retry=False
            )
            _send_stop(w, nodes, now=now, why="gpu_unhealthy")
            moved.append(w.pk)
    return moved


# --- the reconciler --------------------------------------------------------------------------------


@dataclass
class ReconcileResult:
    start_timeouts: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    preempt_forced: list[int] = field(default_factory=list)
    stop_forced: list[int] = field(default_factory=list)
    over_runtime: list[int] = field(default_factory=list)
    stop_confirmed: list[int] = field(default_factory=list)
    exits_applied: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[int]]:
        return asdict(self)


def exits_unapplied_apply() -> list[int]:
    """Ends a node reported that were never acted on: the heartbeat's statuses committed, but the
    receiver of its ``workload_exited`` signal failed after the commit (a database restart cut its
    connection), and the workload stayed RUNNING, its GPU held and billed, once the node forgot
    it (it lists an ended workload for a few batches). Each status row that says a workload
    holding that node ended, after its allocation there began, is applied as the signal would
    have (``workload_on_exited``: idempotent). Returns the workloads it changed."""
    from nodes.services.heartbeat_parse import TERMINAL_WORKLOAD_STATES

    open_on = {
        (str(wid), node_id): started
        for wid, node_id, started in Allocation.objects.filter(
            ended_at__isnull=True, workload__state__in=HOLDING_STATES
        ).values_list("workload_id", "node_id", "started_at")
    }
    if not open_on:
        return []
    applied = []
    for node_id, wid, state, code, message, finished in NodeWorkloadStatus.objects.filter(
        state__in=TERMINAL_WORKLOAD_STATES, workload_id__in={w for w, _ in open_on}
    ).values_list("node_id", "workload_id", "state", "exit_code", "message", "finished_at"):
        started = open_on.get((wid, node_id))
        if started is None or finished is None or finished < started:
            continue  # not held there, or an earlier run's end
        before = Workload.objects.filter(pk=int(wid)).values_list("state", flat=True).first()
        w = workload_on_exited(node_id=node_id, workload_id=wid, state=state, exit_code=code, message=message)
        if w is not None and w.state != before:
            logger.warning("workload %s: the end node %s reported was not applied; applied now", wid, node_id)
            applied.append(w.pk)
    return applied


def scheduling_reconcile(*, now: datetime | None = None) -> ReconcileResult:
    """Finish what messages or crashes left behind. Safe to run any time, any number of times."""
    now = now or timezone.now()
    out = ReconcileResult()
    start_timeout = now - timedelta(seconds=settings.SCHEDULING_START_TIMEOUT_S)
    with transaction.atomic():
        # SCHEDULED but not started in time: stop it there (in case it starts late) and place it
        # again (elsewhere if that node is the problem), or fail after the last attempt.
        for w in lock_workloads_where(state=S.SCHEDULED, state_changed_at__lt=start_timeout):
            nodes = _nodes_of(w.pk)
            if w.gang or len(nodes) > 1:
                continue  # gangs: below, by their own timeout
            _avoid(w, _not_started_on(w, nodes))
            if w.attempt >= settings.SCHEDULING_MAX_START_ATTEMPTS:
                msg = f"Not started after {w.attempt} attempts."
                workload_transition(
                    workload=w, to=S.FAILED, reason="start_timeout", actor=SYSTEM, message=msg, now=now
                )
            else:
                workload_transition(
                    workload=w,
                    to=S.QUEUED,
                    reason="start_timeout",
                    actor=SYSTEM,
                    message="Not started in time.",
                    now=now,
                )
            _send_stop(w, nodes, now=now, why="start_timeout")
            out.start_timeouts.append(w.pk)

        # Gangs not started on every member in time: stopped on every node (those that started
        # keep their GPUs out of use until they confirm), then placed again or failed.
        gang_timeout = now - timedelta(seconds=settings.SCHEDULING_GANG_START_TIMEOUT_S)
        for w in lock_workloads_where(state__in=(S.SCHEDULED, S.STARTING), state_changed_at__lt=gang_timeout):
            nodes = _gang_nodes(w)
            if nodes is None:
                continue
            _avoid(w, _not_started_on(w, nodes))
            last = w.attempt >= settings.SCHEDULING_MAX_START_ATTEMPTS
            msg = (
                f"Not started on every node after {w.attempt} attempts."
                if last
                else "Not started on every node in time."
            )

            def end(w: Workload = w, last: bool = last, msg: str = msg) -> None:
                to = S.FAILED if last else S.QUEUED
                workload_transition(
                    workload=w, to=to, reason="gang_start_timeout", actor=SYSTEM, message=msg, now=now
                )

            _gang_fail(w, failed_node=None, now=now, why="gang_start_timeout", end=end)
            out.start_timeouts.append(w.pk)

        # STARTING workloads that a node holding them reports running (no other node's word counts).
        starting = {w.pk: w for w in lock_workloads_where(state=S.STARTING)}
        if starting:
            reports = NodeWorkloadStatus.objects.filter(
                workload_id__in=[str(pk) for pk in starting], state="running"
            ).values_list("workload_id", "node_id")
            held = set(
                Allocation.objects.filter(workload_id__in=list(starting), ended_at__isnull=True).values_list(
                    "workload_id", "node_id"
                )
            )
            running_on: dict[int, set[int]] = {}
            for wid, node_id in reports:
                if (int(wid), node_id) in held:
                    running_on.setdefault(int(wid), set()).add(node_id)
            # A gang (spanning nodes) runs when every node it holds reports it running.
            holding: dict[int, set[int]] = {}
            for wid, node_id in held:
                holding.setdefault(wid, set()).add(node_id)
            running_ids = {
                wid
                for wid, on in running_on.items()
                if not (starting[wid].gang or len(holding[wid]) > 1) or on >= holding[wid]
            }
            for wid in sorted(running_ids):
                workload_transition(
                    workload=starting[wid], to=S.RUNNING, reason="running", actor=SYSTEM, now=now
                )
                out.running.append(wid)

        # Preempted past its notice (plus a grace), or stopping past its grace: the agent did not
        # report; release the capacity.
        grace = settings.SCHEDULING_STOP_GRACE_S + settings.SCHEDULING_REPORT_GRACE_S
        preempted = list(lock_workloads_where(state=S.PREEMPTED))
        notices = _notices([w.pk for w in preempted])
        unconfirmed = "No report from the node: the stop is unconfirmed until it reports the workload gone."
        for w in preempted:
            notice = notices.get(w.pk, preempt_notice_s(w.plan))
            if w.state_changed_at + timedelta(seconds=notice + grace) < now:
                held = allocations_held(w.pk)
                _finish_preempted(w, now=now, note=f"{unconfirmed} ")
                allocations_mark_forced(held, now)
                out.preempt_forced.append(w.pk)
        for w in lock_workloads_where(state=S.STOPPING, state_changed_at__lt=now - timedelta(seconds=grace)):
            held = allocations_held(w.pk)
            workload_transition(
                workload=w, to=S.STOPPED, reason="stop_timeout", actor=SYSTEM, message=unconfirmed, now=now
            )
            allocations_mark_forced(held, now)
            out.stop_forced.append(w.pk)

        # Over the maximum runtime.
        for w in lock_workloads_where(
            state=S.RUNNING, max_runtime_s__isnull=False, started_at__isnull=False, array_count__isnull=True
        ):
            if w.started_at + timedelta(seconds=w.max_runtime_s) <= now:
                nodes = _nodes_of(w.pk)
                w.stop_requested_at = now
                w.save(update_fields=["stop_requested_at"])
                workload_transition(
                    workload=w,
                    to=S.STOPPING,
                    reason="max_runtime",
                    actor=SYSTEM,
                    message="Maximum runtime reached.",
                    now=now,
                )
                _send_stop(w, nodes, now=now, why="max_runtime")
                out.over_runtime.append(w.pk)

    out.exits_applied = exits_unapplied_apply()
    out.stop_confirmed = stops_confirm_unlisted(now)
    if out.start_timeouts or out.preempt_forced or out.stop_forced or out.stop_confirmed or out.exits_applied:
        cycle_request(reason="reconcile")
    return out
