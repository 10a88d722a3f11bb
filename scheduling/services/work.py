"""Work-queue mode of a job array: uneven work shared by P workers, the faster taking more.

``"array": {"parallelism": P, "work": {"first": 1, "last": 100, "chunk": 5, "lease_s": 300}}``
splits the frames ``first..last`` into items of ``chunk`` frames (the last may be shorter) and runs
P worker tasks. Each worker is given ``GPUPOOL_WORK_URL`` and ``GPUPOOL_WORK_TOKEN`` and loops:
``POST next`` (an item, leased to it for ``lease_s`` seconds), does it, ``POST items/<index>/done``
(``renew`` extends a lease), until ``next`` answers ``done``. An item is handed out again when its
lease runs out or when the task holding it is no longer running that attempt (it failed, its node
went down, it was preempted): a worker that dies returns its items. An item is done once: a worker
whose lease went to another may not complete it (409).

The token is signed by the portal (Django's signing, its own salt) over the task's id and attempt,
made when the start command goes to the node (never stored), and good only while that attempt of
that task holds its GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core import signing
from django.db import transaction
from django.db.models import Exists, OuterRef, Q

from portal.errors import Conflict, DomainError, NotFound, ValidationFailed
from scheduling.locks import lock_next_work_item, lock_work_item
from scheduling.models import HOLDING_STATES, WorkItem, WorkItemState, Workload

TOKEN_SALT = "gpupool.scheduling.work"
WORK_URL_ENV, WORK_TOKEN_ENV = "GPUPOOL_WORK_URL", "GPUPOOL_WORK_TOKEN"
MAX_ITEMS = 100_000
RETRY_AFTER_S = 2


class WorkTokenInvalid(DomainError):
    status_code = 401
    code = "work_token_invalid"


def _fail(key: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"array.work.{key}: {message}", fields={"array": [f"work.{key}: {message}"]})


@dataclass(frozen=True)
class WorkSpec:
    first: int
    last: int
    chunk: int
    lease_s: int

    @property
    def items(self) -> int:
        return -(-(self.last - self.first + 1) // self.chunk)


def work_validate(raw: Any) -> WorkSpec:
    if not isinstance(raw, dict) or set(raw) - {"first", "last", "chunk", "lease_s"}:
        raise _fail("", 'An object: {"first", "last", "chunk", "lease_s"}.')

    def number(key: str, default: int | None, lo: int, hi: int) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise _fail(key, f"An integer between {lo} and {hi}.")
        return value

    first = number("first", None, -(10**9), 10**9)
    last = number("last", None, -(10**9), 10**9)
    if last < first:
        raise _fail("last", "At least first.")
    spec = WorkSpec(first, last, number("chunk", 1, 1, 10**9), number("lease_s", 300, 10, 86400))
    if spec.items > MAX_ITEMS:
        raise _fail("chunk", f"At most {MAX_ITEMS} items; take bigger chunks.")
    return spec


def work_items_create(*, job: Workload, spec: WorkSpec) -> None:
    WorkItem.objects.bulk_create(
        [
            WorkItem(
                tenant_id=job.tenant_id,
                job=job,
                index=i,
                first=spec.first + i * spec.chunk,
                last=min(spec.last, spec.first + (i + 1) * spec.chunk - 1),
            )
            for i in range(spec.items)
        ],
        batch_size=5000,
    )


def work_token_for(*, task_id: int, attempt: int) -> str:
    return signing.dumps({"t": task_id, "a": attempt}, salt=TOKEN_SALT, compress=True)


def work_url() -> str:
    return f"{settings.SITE_URL.rstrip('/')}/api/v1/work/"


def work_task_for_token(token: str | None) -> Workload:
    """The task a worker's token speaks for, while that attempt holds its GPUs (401 otherwise)."""
    if not token:
        raise WorkTokenInvalid("A work token is required (Authorization: Bearer $GPUPOOL_WORK_TOKEN).")
    try:
        claims = signing.loads(token, salt=TOKEN_SALT)
    except signing.BadSignature:
        raise WorkTokenInvalid("Not a valid work token.") from None
    if not isinstance(claims, dict):
        raise WorkTokenInvalid("Not a valid work token.")
    task = (
        Workload.objects.select_related("array_parent")
        .filter(pk=claims.get("t"), attempt=claims.get("a"), state__in=HOLDING_STATES)
        .first()
    )
    if task is None or task.array_parent is None or task.array_parent.work_lease_s is None:
        raise WorkTokenInvalid("This work token's task is not running (anymore).")
    return task


def _lapsed(now: datetime) -> Q:
    """Leases that no longer hold: run out, or their task is not running the attempt that took it.

    The holder is checked by a subquery, not a join: a worker that finds the row it wants locked
    by another, just leased, has PostgreSQL re-check this condition on the new row version, and a
    join's columns would still be the old (absent) holder's, handing the item out twice."""
    holder_runs = Exists(
        Workload.objects.filter(
            pk=OuterRef("leased_to_id"), attempt=OuterRef("leased_attempt"), state__in=HOLDING_STATES
        )
    )
    return Q(state=WorkItemState.LEASED) & (Q(lease_expires_at__lt=now) | ~Q(holder_runs))


def work_next(*, task: Workload, now: datetime) -> tuple[WorkItem | None, bool]:
    """Lease the next item to ``task``: (item, False), or (None, done) where ``done`` says every
    item is done (the worker may end) rather than all being leased to others for now."""
    job_id = task.array_parent_id
    with transaction.atomic():
        # A lapsed lease first (few rows: the leased ones), so a dead worker's frames come back
        # soon; then the next pending one (the index's next row, whatever the queue's length).
        item = lock_next_work_item(job_id=job_id, available=_lapsed(now)) or lock_next_work_item(
            job_id=job_id, available=Q(state=WorkItemState.PENDING)
        )
        if item is None:
            return None, not WorkItem.objects.filter(job_id=job_id).exclude(state=WorkItemState.DONE).exists()
        item.state = WorkItemState.LEASED
        item.leased_to = task
        item.leased_attempt = task.attempt
        item.lease_expires_at = now + timedelta(seconds=task.array_parent.work_lease_s)
        item.leases += 1
        item.save(update_fields=["state", "leased_to", "leased_attempt", "lease_expires_at", "leases"])
    return item, False


def _held(task: Workload, index: int) -> WorkItem:
    item = lock_work_item(job_id=task.array_parent_id, index=index)
    if item is None:
        raise NotFound(f"No work item {index}.")
    return item


def work_done(*, task: Workload, index: int, now: datetime) -> WorkItem:
    """Mark an item leased to this attempt of ``task`` done (again: nothing changes)."""
    with transaction.atomic():
        item = _held(task, index)
        mine = item.leased_to_id == task.pk and item.leased_attempt == task.attempt
        if item.state == WorkItemState.DONE and mine:
            return item
        if item.state != WorkItemState.LEASED or not mine:
            raise Conflict(f"Work item {index} is not leased to this task (its lease lapsed and went on).")
        item.state = WorkItemState.DONE
        item.done_at = now
        item.save(update_fields=["state", "done_at"])
    return item


def work_renew(*, task: Workload, index: int, now: datetime) -> WorkItem:
    """Extend this task's lease on an item by the job's ``lease_s`` from now."""
    with transaction.atomic():
        item = _held(task, index)
        if not (
            item.state == WorkItemState.LEASED
            and item.leased_to_id == task.pk
            and item.leased_attempt == task.attempt
        ):
            raise Conflict(f"Work item {index} is not leased to this task.")
        item.lease_expires_at = now + timedelta(seconds=task.array_parent.work_lease_s)
        item.save(update_fields=["lease_expires_at"])
    return item
