"""The workload state machine: every transition in one table, one function to make them.

    PENDING -> QUEUED -> SCHEDULED -> STARTING -> RUNNING -> STOPPING -> STOPPED / SUCCEEDED / FAILED
    PREEMPTED -> QUEUED (jobs that requeue on preemption)

A workload holds GPUs (open Allocation rows) exactly while it is SCHEDULED, STARTING, RUNNING,
STOPPING or PREEMPTED: ``workload_transition`` closes its allocations when it leaves those states,
so the invariant lives here and nowhere else.
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from portal.actors import Actor
from portal.errors import Conflict
from portal.events import publish
from scheduling.models import (
    HOLDING_STATES,
    TERMINAL_STATES,
    Allocation,
    Workload,
    WorkloadEvent,
    WorkloadKind,
)
from scheduling.models import WorkloadState as S

TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.QUEUED, S.STOPPED, S.FAILED}),
    S.QUEUED: frozenset({S.SCHEDULED, S.STOPPED, S.FAILED}),
    # SCHEDULED -> QUEUED: not started in time (reconciler) or its node went down, placed again.
    # SCHEDULED -> SUCCEEDED: the node reports the exit before the start command's report arrives.
    S.SCHEDULED: frozenset(
        {S.STARTING, S.RUNNING, S.QUEUED, S.STOPPING, S.PREEMPTED, S.SUCCEEDED, S.FAILED, S.STOPPED}
    ),
    S.STARTING: frozenset({S.RUNNING, S.STOPPING, S.PREEMPTED, S.QUEUED, S.SUCCEEDED, S.FAILED, S.STOPPED}),
    S.RUNNING: frozenset({S.STOPPING, S.PREEMPTED, S.QUEUED, S.SUCCEEDED, S.FAILED, S.STOPPED}),
    S.STOPPING: frozenset({S.STOPPED, S.SUCCEEDED, S.FAILED}),
    S.PREEMPTED: frozenset({S.QUEUED, S.STOPPED, S.FAILED}),
    S.STOPPED: frozenset(),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
}
# Back to the queue from a running state is for jobs only (instances fail or stop instead).
JOB_ONLY_TARGETS: dict[str, frozenset[str]] = {
    S.QUEUED: frozenset({S.STARTING, S.RUNNING, S.PREEMPTED}),
}


class InvalidTransition(Conflict):
    code = "invalid_transition"


def can_transition(workload: Workload, to: str) -> bool:
    if to not in TRANSITIONS[workload.state]:
        return False
    job_only_from = JOB_ONLY_TARGETS.get(to, frozenset())
    return not (workload.state in job_only_from and workload.kind != WorkloadKind.JOB)


def workload_transition(
    *,
    workload: Workload,
    to: str,
    reason: str,
    actor: Actor,
    message: str = "",
    data: dict | None = None,
    now: datetime | None = None,
) -> WorkloadEvent:
    """Move ``workload`` to ``to``: validate, update the row, write the WorkloadEvent, close the
    allocations when it stops holding GPUs, and publish the event to the tenant after commit.

    The caller holds the workload's row lock (``scheduling.locks.lock_workload``) or is the
    scheduling cycle (which holds the cycle lock); either way this runs in its transaction.
    """
    now = now or timezone.now()
    old = workload.state
    if not can_transition(workload, to):
        raise InvalidTransition(
            f"A {workload.kind} cannot go from {old} to {to}.",
            fields={"state": [f"{old} -> {to} is not allowed."]},
        )
    with transaction.atomic():
        workload.state = to
        workload.state_reason = (message or reason)[:255]
        workload.state_changed_at = now
        fields = ["state", "state_reason", "state_changed_at"]
        if to == S.QUEUED:
            workload.queued_at = now
            fields.append("queued_at")
        if to == S.SCHEDULED:
            workload.scheduled_at = now
            workload.pending_reason, workload.pending_message, workload.expected_start_at = "", "", None
            fields += ["scheduled_at", "pending_reason", "pending_message", "expected_start_at"]
        if to == S.RUNNING and workload.started_at is None:
            workload.started_at = now
            fields.append("started_at")
        if to in TERMINAL_STATES:
            workload.finished_at = now
            workload.pending_reason, workload.pending_message, workload.expected_start_at = "", "", None
            fields += ["finished_at", "pending_reason", "pending_message", "expected_start_at"]
        workload.save(update_fields=fields)
        released = 0
        if old in HOLDING_STATES and to not in HOLDING_STATES:
            released = Allocation.objects.filter(workload=workload, ended_at__isnull=True).update(
                ended_at=now, end_reason=reason[:64]
            )
        event = WorkloadEvent.objects.create(
            tenant_id=workload.tenant_id,
            workload=workload,
            at=now,
            from_state=old,
            to_state=to,
            reason=reason[:64],
            message=message[:500],
            actor_repr=str(actor)[:200],
            data=data or {},
        )
        publish(
            tenant_id=workload.tenant_id,
            event={
                "type": "workload.state",
                "workload_id": workload.pk,
                "kind": workload.kind,
                "from": old,
                "to": to,
                "reason": reason,
                "message": message,
                "at": now.isoformat(),
            },
        )
        if released:
            from scheduling.services.triggers import cycle_request

            cycle_request(reason="release")
    return event
