"""NodeCommands: enqueue, deliver (long poll), redeliver with backoff, report, expire. At least once.

Lifecycle: ``pending`` -> (delivered by a long poll) ``delivered`` -> (agent report) ``accepted`` ->
``succeeded`` | ``failed``. A delivered command not acknowledged by ``next_attempt_at`` is
delivered again (attempt + 1, exponential backoff) while attempts remain and the deadline has not
passed; otherwise it becomes ``expired``. The deadline bounds acknowledgement: once the agent has
accepted a command, only its report finishes it. Every step is a NodeCommandEvent.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from nodes import metrics as node_metrics
from nodes.locks import lock_command, lock_commands_where
from nodes.models import (
    FINAL_COMMAND_STATES,
    OPEN_COMMAND_STATES,
    CommandKind,
    CommandState,
    Node,
    NodeCommand,
    NodeCommandEvent,
)
from nodes.services.wakeup import node_commands_notify, node_commands_notify_many
from nodes.signals import command_finished, send_on_commit
from portal.bulk import bulk_insert
from portal.errors import NotFound, ValidationFailed

logger = logging.getLogger(__name__)

# Payload keys each kind needs (the agent protocol in nodes/PROTOCOL.md lists them all).
REQUIRED_PAYLOAD_KEYS: dict[str, tuple[str, ...]] = {
    CommandKind.START_WORKLOAD: ("workload_id", "image", "gpu_uuids"),
    CommandKind.STOP_WORKLOAD: ("workload_id",),
    CommandKind.PREEMPT_WORKLOAD: ("workload_id", "notice_s"),
    CommandKind.PREWARM: ("image",),
    CommandKind.CONFIGURE_MIG: ("gpu_uuid", "enable"),
    CommandKind.DRAIN: (),
    CommandKind.DELETE_VOLUME: ("volume_id",),
    CommandKind.UNDRAIN: (),
    CommandKind.UPGRADE: ("upgrade", "timeout_s"),
    CommandKind.GPU_CHECK: (),
    CommandKind.RESIZE_WORKLOAD: ("workload_id", "gpu_uuids", "world_size", "on_resize"),
}
REPORT_STATUSES = ("accepted", "succeeded", "failed")


class PayloadRefused(Exception):
    """A command's payload cannot be completed for delivery (``wire_payload_register``); the command
    fails with this message instead of reaching the node."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# Per command kind, what turns the stored payload into the one the node receives. Scheduling
# registers the start command's: it puts the tenant's secret values in place of the references
# the stored payload keeps, so the values are in no table, only on their way to the node.
_WIRE_PAYLOAD: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def wire_payload_register(kind: str, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Have ``fn(payload)`` make the payload sent for every delivery of a ``kind`` command (done in
    the delivery's transaction); it raises ``PayloadRefused`` to fail the command instead."""
    _WIRE_PAYLOAD[kind] = fn


def command_backoff(attempt: int) -> timedelta:
    """How long a delivery waits for acknowledgement before the next: base * 2^(attempt-1), capped."""
    base = settings.NODE_COMMAND_RETRY_BASE_S
    return timedelta(seconds=min(base * 2 ** max(attempt - 1, 0), settings.NODE_COMMAND_RETRY_MAX_S))


def _event(
    command: NodeCommand, event: str, from_state: str, now: datetime, **detail: Any
) -> NodeCommandEvent:
    return NodeCommandEvent(
        command=command,
        at=now,
        event=event,
        from_state=from_state,
        to_state=command.state,
        attempt=command.attempt,
        detail=detail,
    )


def _validated(
    kind: str,
    payload: Any,
    deadline: datetime | None,
    max_attempts: int | None,
    now: datetime,
) -> tuple[datetime, int]:
    """Check one command's kind, payload, deadline and attempts; returns the deadline and attempts
    with their defaults filled in."""
    if kind not in CommandKind.values:
        raise ValidationFailed(f"Unknown command kind {kind!r}.", fields={"kind": ["Not a valid choice."]})
    if not isinstance(payload, dict):
        raise ValidationFailed("The payload must be an object.", fields={"payload": ["Expected an object."]})
    missing = [k for k in REQUIRED_PAYLOAD_KEYS[kind] if k not in payload]
    if missing:
        raise ValidationFailed(
            f"A {kind} command needs {', '.join(missing)}.",
            fields={"payload": [f"Missing: {', '.join(missing)}."]},
        )
    deadline = deadline or now + timedelta(seconds=settings.NODE_COMMAND_DEFAULT_TTL_S)
    if deadline <= now:
        raise ValidationFailed("The deadline has passed.", fields={"deadline": ["Must be in the future."]})
    max_attempts = max_attempts or settings.NODE_COMMAND_DEFAULT_MAX_ATTEMPTS
    if max_attempts < 1:
        raise ValidationFailed("At least one attempt.", fields={"max_attempts": ["Must be at least 1."]})
    return deadline, max_attempts


def node_command_enqueue(
    *,
    node: Node,
    kind: str,
    payload: dict[str, Any],
    deadline: datetime | None = None,
    max_attempts: int | None = None,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> NodeCommand:
    """Queue a command for a node; the agent's long poll picks it up at once (woken on commit).

    With an ``idempotency_key``, enqueuing the same key for the same node again returns the
    command made the first time.
    """
    now = now or timezone.now()
    deadline, max_attempts = _validated(kind, payload, deadline, max_attempts, now)
    if idempotency_key:
        existing = NodeCommand.objects.filter(node=node, idempotency_key=idempotency_key).first()
        if existing is not None:
            return existing
    try:
        with transaction.atomic():
            command = NodeCommand.objects.create(
                node=node,
                kind=kind,
                payload=payload,
                deadline=deadline,
                max_attempts=max_attempts,
                next_attempt_at=now,
                idempotency_key=idempotency_key or None,
                created_at=now,
            )
            _event(command, "created", "", now, kind=kind).save()
            node_id = node.pk
            transaction.on_commit(lambda: node_commands_notify(node_id=node_id))
    except IntegrityError:
        if not idempotency_key:
            raise
        return NodeCommand.objects.get(node=node, idempotency_key=idempotency_key)
    node_metrics.COMMANDS.labels(kind=kind, event="created").inc()
    return command


@dataclass(frozen=True)
class CommandRequest:
    """One command for ``node_commands_enqueue_many`` (the arguments of ``node_command_enqueue``)."""

    node_id: int
    kind: str
    payload: dict[str, Any]
    idempotency_key: str | None = None
    deadline: datetime | None = None
    max_attempts: int | None = None


def node_commands_enqueue_many(
    *, commands: list[CommandRequest], now: datetime | None = None
) -> list[NodeCommand]:
    """``node_command_enqueue`` for many commands at once (a scheduling cycle starts thousands):
    the same validation and idempotency, in a fixed number of statements (one query for the keys
    already used, one INSERT of the commands, one of their ``created`` events), and one wake-up
    per node on commit. Returns the commands in the order asked, an existing one where its key was
    used before (also twice in ``commands``: the first wins). All or nothing: one invalid command
    refuses the lot."""
    now = now or timezone.now()
    checked = [(c, *_validated(c.kind, c.payload, c.deadline, c.max_attempts, now)) for c in commands]
    if not checked:
        return []
    keys = {c.idempotency_key for c in commands if c.idempotency_key}
    existing: dict[tuple[int, str], NodeCommand] = {}
    if keys:
        # Both columns, so that the (node, idempotency key) unique index serves the look-up.
        nodes = {c.node_id for c in commands if c.idempotency_key}
        for command in NodeCommand.objects.filter(node_id__in=nodes, idempotency_key__in=keys):
            existing[(command.node_id, command.idempotency_key)] = command
    out: list[NodeCommand] = []
    new: list[NodeCommand] = []
    for c, deadline, max_attempts in checked:
        key = (c.node_id, c.idempotency_key) if c.idempotency_key else None
        if key is not None and key in existing:
            out.append(existing[key])
            continue
        command = NodeCommand(
            node_id=c.node_id,
            kind=c.kind,
            payload=c.payload,
            deadline=deadline,
            max_attempts=max_attempts,
            next_attempt_at=now,
            idempotency_key=c.idempotency_key or None,
            created_at=now,
        )
        if key is not None:
            existing[key] = command
        new.append(command)
        out.append(command)
    if not new:
        return out
    try:
        with transaction.atomic():
            bulk_insert(new)
            bulk_insert([_event(command, "created", "", now, kind=command.kind) for command in new])
    except IntegrityError:
        # A concurrent enqueue used one of the keys between our look-up and our insert: fall back
        # to one at a time, which resolves each key on its own.
        return [
            node_command_enqueue(
                node=Node(pk=c.node_id),
                kind=c.kind,
                payload=c.payload,
                deadline=c.deadline,
                max_attempts=c.max_attempts,
                idempotency_key=c.idempotency_key,
                now=now,
            )
            for c in commands
        ]
    node_ids = sorted({command.node_id for command in new})
    transaction.on_commit(lambda: node_commands_notify_many(node_ids=node_ids))
    kinds: dict[str, int] = {}
    for command in new:
        kinds[command.kind] = kinds.get(command.kind, 0) + 1
    for kind, n in kinds.items():
        node_metrics.COMMANDS.labels(kind=kind, event="created").inc(n)
    return out


def _upcoming(node_id: int, limit: int) -> list[tuple[uuid.UUID, datetime]]:
    """(id, next attempt) of the node's open commands, soonest first (every round of a long poll).
    A ``raw()`` statement, names from ``_meta``: its ORM form spent more CPU compiling than the
    rest of a poll's round."""
    commands = NodeCommand.objects.raw(_upcoming_statement(), [node_id, *OPEN_COMMAND_STATES, limit])
    return [(c.pk, c.next_attempt_at) for c in commands]


@functools.cache
def _upcoming_statement() -> str:
    q = connection.ops.quote_name
    meta = NodeCommand._meta
    pk, node, state, at = (q(meta.get_field(n).column) for n in ("id", "node", "state", "next_attempt_at"))
    states = ", ".join(["%s"] * len(OPEN_COMMAND_STATES))
    return (
        f"SELECT {pk}, {at} FROM {q(meta.db_table)} WHERE {node} = %s AND {state} IN ({states})"
        f" ORDER BY {at} LIMIT %s"
    )


def node_commands_deliver_due(
    *, node_id: int, now: datetime | None = None, limit: int = 20
) -> tuple[list[NodeCommand], datetime | None]:
    """Deliver the node's due commands (first delivery or redelivery). Returns them and, when none
    was due, the time the next one becomes due (for the long poll to wake up)."""
    now = now or timezone.now()
    upcoming = _upcoming(node_id, limit)
    due = [pk for pk, at in upcoming if at <= now]
    if not due:
        return [], (upcoming[0][1] if upcoming else None)
    delivered: list[NodeCommand] = []
    events: list[NodeCommandEvent] = []
    with transaction.atomic():
        rows = lock_commands_where(
            pk__in=due, state__in=OPEN_COMMAND_STATES, next_attempt_at__lte=now
        ).order_by("created_at")
        for command in rows:
            old = command.state
            if command.deadline <= now or command.attempt >= command.max_attempts:
                reason = (
                    "deadline passed" if command.deadline <= now else "not acknowledged after all attempts"
                )
                _expire(command, reason, now, events)
                continue
            to_wire = _WIRE_PAYLOAD.get(command.kind)
            if to_wire is not None:
                try:
                    # In memory only (the saves below name their fields): never stored.
                    command.wire_payload = to_wire(command.payload)
                except PayloadRefused as exc:
                    _refuse(command, exc.message, now, events)
                    continue
            command.attempt += 1
            command.state = CommandState.DELIVERED
            command.delivered_at = now
            command.next_attempt_at = now + command_backoff(command.attempt)
            command.save(update_fields=["attempt", "state", "delivered_at", "next_attempt_at"])
            events.append(_event(command, "delivered" if command.attempt == 1 else "redelivered", old, now))
            delivered.append(command)
        NodeCommandEvent.objects.bulk_create(events)
    for command in delivered:
        node_metrics.COMMANDS.labels(kind=command.kind, event="delivered").inc()
    return delivered, None


def _refuse(command: NodeCommand, message: str, now: datetime, events: list[NodeCommandEvent]) -> None:
    """Fail a command the portal cannot complete for delivery; ``rejected``: no node could run it."""
    old = command.state
    command.state = CommandState.FAILED
    command.finished_at = now
    command.result = {"reason": message, "rejected": True, "refused_by": "portal"}
    command.message = message[:2000]
    command.save(update_fields=["state", "finished_at", "result", "message"])
    events.append(_event(command, "refused", old, now, reason=message))
    node_metrics.COMMANDS.labels(kind=command.kind, event="refused").inc()
    send_on_commit(
        command_finished, sender=NodeCommand, command=command, state=command.state, result=command.result
    )


def _expire(command: NodeCommand, reason: str, now: datetime, events: list[NodeCommandEvent]) -> None:
    old = command.state
    command.state = CommandState.EXPIRED
    command.finished_at = now
    command.result = {"reason": reason}
    command.save(update_fields=["state", "finished_at", "result"])
    events.append(_event(command, "expired", old, now, reason=reason))
    node_metrics.COMMANDS.labels(kind=command.kind, event="expired").inc()
    send_on_commit(
        command_finished, sender=NodeCommand, command=command, state=command.state, result=command.result
    )


def node_command_report(
    *,
    node_id: int,
    command_id: str | uuid.UUID,
    status: str,
    result: dict[str, Any] | None = None,
    message: str = "",
    at: datetime | None = None,
    now: datetime | None = None,
) -> NodeCommand:
    """The agent's report. Idempotent: a repeat, or a report for a finished command, changes nothing
    (it is recorded in the history as ``report_ignored``). Another node's command is NotFound."""
    now = now or timezone.now()
    if status not in REPORT_STATUSES:
        raise ValidationFailed(
            f"status: one of {', '.join(REPORT_STATUSES)}.", fields={"status": ["Not a valid choice."]}
        )
    try:
        command_uuid = uuid.UUID(str(command_id))
    except ValueError:
        raise NotFound("No such command.") from None
    with transaction.atomic():
        command = lock_command(command_id=command_uuid, node_id=node_id)
        if command is None:
            raise NotFound("No such command.")
        old = command.state
        detail = {"status": status, "message": message[:2000], "agent_at": at.isoformat() if at else None}
        if command.state in FINAL_COMMAND_STATES or (
            status == "accepted" and command.state == CommandState.ACCEPTED
        ):
            NodeCommandEvent.objects.create(**_event_kwargs(command, "report_ignored", old, now, detail))
            return command
        if status == "accepted":
            command.state = CommandState.ACCEPTED
            command.accepted_at = now
            command.save(update_fields=["state", "accepted_at"])
        else:
            command.state = CommandState.SUCCEEDED if status == "succeeded" else CommandState.FAILED
            command.finished_at = now
            command.accepted_at = command.accepted_at or now
            command.result = result or {}
            command.message = message[:2000]
            command.save(update_fields=["state", "finished_at", "accepted_at", "result", "message"])
            send_on_commit(
                command_finished,
                sender=NodeCommand,
                command=command,
                state=command.state,
                result=command.result,
            )
        NodeCommandEvent.objects.create(**_event_kwargs(command, status, old, now, detail))
    node_metrics.COMMANDS.labels(kind=command.kind, event=status).inc()
    return command


def _event_kwargs(command: NodeCommand, event: str, old: str, now: datetime, detail: dict) -> dict[str, Any]:
    return {
        "command": command,
        "at": now,
        "event": event,
        "from_state": old,
        "to_state": command.state,
        "attempt": command.attempt,
        "detail": detail,
    }


def node_commands_expire(*, now: datetime | None = None, limit: int = 1000) -> int:
    """Beat: expire open commands past their deadline or out of attempts, and wake the long polls of
    nodes whose commands are due again. Returns how many expired."""
    now = now or timezone.now()
    events: list[NodeCommandEvent] = []
    with transaction.atomic():
        rows = list(
            lock_commands_where(state__in=OPEN_COMMAND_STATES)
            .filter(Q(deadline__lte=now) | Q(attempt__gte=F("max_attempts"), next_attempt_at__lte=now))
            .order_by("deadline")[:limit]
        )
        for command in rows:
            reason = "deadline passed" if command.deadline <= now else "not acknowledged after all attempts"
            _expire(command, reason, now, events)
        NodeCommandEvent.objects.bulk_create(events)
    due_nodes = set(
        NodeCommand.objects.filter(
            state=CommandState.DELIVERED, next_attempt_at__lte=now, deadline__gt=now
        ).values_list("node_id", flat=True)[:limit]
    )
    for node_id in due_nodes:
        node_commands_notify(node_id=node_id)
    return len(rows)


def command_as_wire(command: NodeCommand) -> dict[str, Any]:
    return {
        "id": str(command.pk),
        "kind": command.kind,
        "attempt": command.attempt,
        "deadline": command.deadline.isoformat().replace("+00:00", "Z"),
        # What the node needs (``wire_payload_register``), else what is stored.
        "payload": getattr(command, "wire_payload", command.payload),
    }
