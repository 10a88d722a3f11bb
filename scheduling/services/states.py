"""The workload state machine: every transition in one table, one function to make them.

    PENDING -> QUEUED -> SCHEDULED -> STARTING -> RUNNING -> STOPPING -> STOPPED / SUCCEEDED / FAILED
    PREEMPTED -> QUEUED (jobs that requeue on preemption)
    Array jobs: PENDING -> RUNNING -> SUCCEEDED / FAILED / STOPPED (their tasks hold the GPUs)

A workload holds GPUs (open Allocation rows) exactly while it is SCHEDULED, STARTING, RUNNING,
STOPPING or PREEMPTED: ``workload_transition`` closes its allocations when it leaves those states,
so the invariant lives here and nowhere else.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.actors import Actor
from portal.bulk import bulk_insert
from portal.errors import Conflict
from portal.events import publish_many
from portal.logging import log_context
from scheduling.models import (
    HOLDING_STATES,
    TERMINAL_STATES,
    Allocation,
    PublishedPort,
    Workload,
    WorkloadEvent,
    WorkloadKind,
)
from scheduling.models import WorkloadState as S
from scheduling.services.gangs import gang_addresses_release_on_commit

logger = logging.getLogger(__name__)

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


# An array job never holds GPUs: it is PENDING until a task starts, RUNNING while tasks run, and
# ends when its tasks have (scheduling.services.arrays).
ARRAY_TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.RUNNING, S.SUCCEEDED, S.FAILED, S.STOPPED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.STOPPED}),
}


def can_transition(workload: Workload, to: str) -> bool:
    if workload.array_count is not None:
        return to in ARRAY_TRANSITIONS.get(workload.state, frozenset())
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
    with log_context(workload_id=workload.pk):
        return workloads_transition(
            workloads=[workload],
            to=to,
            reason=reason,
            actor=actor,
            messages={workload.pk: message},
            data=data,
            now=now,
        )[0]


def _apply(workload: Workload, to: str, reason: str, message: str, now: datetime) -> None:
    workload.state = to
    workload.state_reason = (message or reason)[:255]
    workload.state_changed_at = now
    if to == S.QUEUED:
        workload.queued_at = now
    if to == S.SCHEDULED:
        workload.scheduled_at = now
    if to in (S.SCHEDULED, *TERMINAL_STATES):
        workload.pending_reason, workload.pending_message, workload.expected_start_at = "", "", None
    if to == S.RUNNING and workload.started_at is None:
        workload.started_at = now
    if to in TERMINAL_STATES:
        workload.finished_at = now


_FIELDS = [
    "state",
    "state_reason",
    "state_changed_at",
    "queued_at",
    "scheduled_at",
    "started_at",
    "finished_at",
    "pending_reason",
    "pending_message",
    "expected_start_at",
]


def completion_events(
    workloads: list[Workload], *, to: str, reason: str, at: str
) -> list[tuple[int, dict[str, Any]]]:
    """The events that say a group of work ended, published with the state changes that end it:
    ``gang.completed`` when a gang (one job across nodes) reaches a terminal state,
    ``array.completed`` when an array job does (all its tasks ended, or it was stopped)."""
    if to not in TERMINAL_STATES:
        return []
    events = []
    for w in workloads:
        if w.is_array:
            group = {"type": "array.completed", "array_count": w.array_count}
        elif w.gang:
            group = {"type": "gang.completed", "gpu_count": w.gpu_count}
        else:
            continue
        common = {"workload_id": w.pk, "kind": w.kind, "state": to, "reason": reason, "at": at}
        events.append((w.tenant_id, {"type": group.pop("type"), **common, **group}))
    return events


def workloads_transition(
    *,
    workloads: list[Workload],
    to: str,
    reason: str,
    actor: Actor,
    messages: dict[int, str] | None = None,
    data: dict | None = None,
    extra_updates: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> list[WorkloadEvent]:
    """``workload_transition`` for many workloads at once (the cycle places thousands): the same
    checks and effects, in a fixed number of statements. All or nothing: one invalid transition
    refuses the lot. ``extra_updates`` are other fields the caller changed on the rows (names of
    fields already set on the objects; for several workloads, values or expressions to write)."""
    now = now or timezone.now()
    extra_updates = extra_updates or {}
    messages = messages or {}
    for w in workloads:
        if not can_transition(w, to):
            raise InvalidTransition(
                f"A {w.kind} cannot go from {w.state} to {to}.",
                fields={"state": [f"{w.state} -> {to} is not allowed."]},
            )
    if not workloads:
        return []
    olds = {w.pk: w.state for w in workloads}
    with transaction.atomic():
        for w in workloads:
            _apply(w, to, reason, messages.get(w.pk, ""), now)
        if len(workloads) == 1:
            workloads[0].save(update_fields=[*_FIELDS, *extra_updates])
        else:
            # One UPDATE: every field but the reason text is the same for all (the per-workload
            # message is kept in its event).
            values = {f: getattr(workloads[0], f) for f in _FIELDS if f not in ("state_reason", "started_at")}
            values["state_reason"] = reason[:255]
            if to == S.RUNNING:
                values["started_at"] = Coalesce("started_at", Value(now))
            for w in workloads:
                w.state_reason = reason[:255]
            Workload.objects.filter(pk__in=list(olds)).update(**values, **extra_updates)
        releasing = [w.pk for w in workloads if olds[w.pk] in HOLDING_STATES and to not in HOLDING_STATES]
        released = 0
        if releasing:
            released = Allocation.objects.filter(workload_id__in=releasing, ended_at__isnull=True).update(
                ended_at=now, end_reason=reason[:64]
            )
            # What its node published goes with its placement (a requeued one gets new ports).
            PublishedPort.objects.filter(workload_id__in=releasing).delete()
            # A gang's addresses on its region's gang network go back to the range once its
            # members are gone (after commit: stops sent with this change are marked by then).
            if any(w.gang or w.gang_port is not None for w in workloads if w.pk in releasing):
                gang_addresses_release_on_commit(releasing)
        events = [
            WorkloadEvent(
                tenant_id=w.tenant_id,
                workload=w,
                at=now,
                from_state=olds[w.pk],
                to_state=to,
                reason=reason[:64],
                message=messages.get(w.pk, "")[:500],
                actor_repr=str(actor)[:200],
                data=data or {},
            )
            for w in workloads
        ]
        if len(events) == 1:
            events[0].save()
        else:
            bulk_insert(events)
        at = now.isoformat()
        publish_many(
            events=[
                *(
                    (
                        w.tenant_id,
                        {
                            "type": "workload.state",
                            "workload_id": w.pk,
                            "kind": w.kind,
                            "from": olds[w.pk],
                            "to": to,
                            "reason": reason,
                            "message": messages.get(w.pk, ""),
                            "at": at,
                        },
                    )
                    for w in workloads
                ),
                *completion_events(workloads, to=to, reason=reason, at=at),
            ]
        )
        if len(workloads) == 1:
            w = workloads[0]
            logger.info(
                "%s %s: %s -> %s (%s)", w.kind, w.pk, olds[w.pk], to, reason, extra={"workload_id": w.pk}
            )
        else:  # the cycle's batches: one line, not one per workload
            logger.info("%d workloads -> %s (%s)", len(workloads), to, reason)
        if released:
            from scheduling.services.triggers import cycle_request

            cycle_request(reason="release")
    return events
