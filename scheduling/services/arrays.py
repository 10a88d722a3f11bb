"""Job arrays: one submission, N tasks (Slurm's ``--array``, Kubernetes' indexed Jobs).

``"array": {"count": N, "parallelism": P}`` stores an *array job*: it keeps the spec and never
holds GPUs itself. Its tasks are jobs of their own (``array_parent``, ``array_index`` 0..N-1), each
with its state, retries, logs and usage, told ``GPUPOOL_ARRAY_INDEX`` and ``GPUPOOL_ARRAY_COUNT``.
At most P tasks are unfinished at a time: the scheduling cycle (``arrays_advance``, before it admits
PENDING work) makes the next tasks as earlier ones end, lowest index first, and moves the array job
along: PENDING until a task starts, RUNNING while they run; SUCCEEDED when every task has (and, in
work-queue mode, every item is done), else FAILED naming how many failed, or STOPPED when it was
stopped. Stopping the array job stops every unfinished task and makes no more.

Work-queue mode (``"work": {...}``, ``scheduling.services.work``) is an array whose P tasks are
workers that pull items from the portal until none is left.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import datetime

from django.db.models import Count

from portal.actors import Actor
from scheduling.locks import lock_workloads_where
from scheduling.models import (
    TERMINAL_STATES,
    WorkItem,
    WorkItemState,
    Workload,
    WorkloadEvent,
    WorkloadState,
)
from scheduling.services.states import workloads_transition

SYSTEM = Actor.system()
MAX_ARRAY_COUNT = 10_000
# Fields a task does not copy from its array job: its own life, and the array's bookkeeping.
_OWN_FIELDS = frozenset(
    {
        "id",
        "name",
        "state",
        "state_reason",
        "retries",
        "attempt",
        "stop_requested_at",
        "preempted_for",
        "avoid_nodes",
        "pending_reason",
        "pending_message",
        "expected_start_at",
        "exit_code",
        "log_tail",
        "submitted_at",
        "queued_at",
        "scheduled_at",
        "started_at",
        "finished_at",
        "state_changed_at",
        "array_count",
        "array_parallelism",
        "work_lease_s",
        "array_parent",
        "array_index",
        "array_task_ids",
    }
)


def array_tasks_make(*, parent: Workload, indices: list[int], now: datetime) -> list[Workload]:
    """Task rows of ``parent`` at ``indices`` (PENDING, with their reserved ids) made outside the
    cycle: the tasks of a stopped Slurm array that Slurm started before the cycle made their rows
    (``scheduling.services.slurm``), so that what Slurm ran of them is billed. The caller holds the
    array job's lock."""
    _tasks_create(parent, indices, now)
    return list(Workload.objects.filter(array_parent=parent, array_index__in=indices).order_by("array_index"))


def _tasks_create(parent: Workload, indices: Sequence[int], now: datetime) -> None:
    copied = {
        f.attname: getattr(parent, f.attname)
        for f in Workload._meta.concrete_fields
        if f.name not in _OWN_FIELDS
    }
    base = parent.name or f"job {parent.pk}"
    # A Slurm array's task ids were reserved when it was submitted (its batch script has them).
    reserved = parent.array_task_ids or []
    tasks = Workload.objects.bulk_create(
        [
            Workload(
                **copied,
                **({"id": int(reserved[i])} if i < len(reserved) else {}),
                name=f"{base}[{i}]"[:100],
                state=WorkloadState.PENDING,
                pending_reason="submitted",
                pending_message="Waiting for the next scheduling cycle.",
                submitted_at=now,
                state_changed_at=now,
                array_parent=parent,
                array_index=i,
            )
            for i in indices
        ]
    )
    models = list(
        parent.gpu_models.through.objects.filter(workload_id=parent.pk).values_list("gpumodel_id", flat=True)
    )
    if models:
        parent.gpu_models.through.objects.bulk_create(
            [parent.gpu_models.through(workload_id=t.pk, gpumodel_id=m) for t in tasks for m in models]
        )
    WorkloadEvent.objects.bulk_create(
        [
            WorkloadEvent(
                tenant_id=parent.tenant_id,
                workload=t,
                at=now,
                from_state="",
                to_state=WorkloadState.PENDING,
                reason="array_task",
                message=f"Task {t.array_index} of array job {parent.pk}.",
            )
            for t in tasks
        ]
    )


def _final(parent: Workload, c: Counter, undone: int) -> tuple[str, str, str] | None:
    """The array job's end, once every task has ended: (state, reason, message)."""
    if parent.stop_requested_at is not None:
        return (
            WorkloadState.STOPPED,
            "stopped_by_user",
            f"Stopped: {c[WorkloadState.SUCCEEDED]} task(s) had succeeded.",
        )
    failed, stopped = c[WorkloadState.FAILED], c[WorkloadState.STOPPED]
    if parent.work_lease_s is not None and not undone:
        # Work-queue mode: the work is what counts; a worker that died had its items taken over.
        return WorkloadState.SUCCEEDED, "work_done", f"Every work item done ({failed} worker(s) failed)."
    if failed or stopped:
        return (
            WorkloadState.FAILED,
            "tasks_failed",
            f"{failed} of {parent.array_count} task(s) failed"
            + (f", {stopped} stopped." if stopped else "."),
        )
    if undone:
        return WorkloadState.FAILED, "work_left", f"Every worker ended with {undone} work item(s) not done."
    return WorkloadState.SUCCEEDED, "tasks_succeeded", f"All {parent.array_count} task(s) succeeded."


def arrays_advance(*, now: datetime, blocked: set[int]) -> None:
    """Make the tasks the parallelism allows and move each unfinished array job along (the
    scheduling cycle, under its lock). ``blocked``: array jobs still waiting for dependencies."""
    parents = [
        p
        for p in lock_workloads_where(
            array_count__isnull=False, state__in=[WorkloadState.PENDING, WorkloadState.RUNNING]
        )
        if p.pk not in blocked
    ]
    if not parents:
        return
    ids = [p.pk for p in parents]
    counts: dict[int, Counter] = defaultdict(Counter)
    started: dict[int, int] = defaultdict(int)
    for pid, state, n, s in (
        Workload.objects.filter(array_parent_id__in=ids)
        .values("array_parent_id", "state")
        .annotate(n=Count("id"), s=Count("started_at"))
        .values_list("array_parent_id", "state", "n", "s")
        .order_by()
    ):
        counts[pid][state] += n
        started[pid] += s
    undone = dict(
        WorkItem.objects.filter(job_id__in=ids)
        .exclude(state=WorkItemState.DONE)
        .values("job_id")
        .annotate(n=Count("id"))
        .values_list("job_id", "n")
        .order_by()
    )
    moves: dict[tuple[str, str], list[Workload]] = defaultdict(list)
    messages: dict[int, str] = {}
    pending_changed: list[Workload] = []
    for p in parents:
        c = counts[p.pk]
        created = sum(c.values())
        active = created - sum(c[s] for s in TERMINAL_STATES)
        if p.stop_requested_at is None and created < p.array_count:
            new = min(p.array_parallelism - active, p.array_count - created)
            if new > 0:
                _tasks_create(p, range(created, created + new), now)
                c[WorkloadState.PENDING] += new
                created += new
                active += new
        if created == p.array_count and active == 0:
            state, reason, message = _final(p, c, undone.get(p.pk, 0))
            moves[(state, reason)].append(p)
            messages[p.pk] = message
        elif p.state == WorkloadState.PENDING and started[p.pk]:
            moves[(WorkloadState.RUNNING, "tasks_running")].append(p)
            messages[p.pk] = f"{started[p.pk]} task(s) started."
        elif p.state == WorkloadState.PENDING:
            message = f"{active} task(s) waiting for GPUs; {p.array_count - created} not made yet."
            if (p.pending_reason, p.pending_message) != ("array", message):
                p.pending_reason, p.pending_message = "array", message
                pending_changed.append(p)
    for (state, reason), group in moves.items():
        workloads_transition(
            workloads=group, to=state, reason=reason, actor=SYSTEM, messages=messages, now=now
        )
    for p in pending_changed:
        Workload.objects.filter(pk=p.pk).update(
            pending_reason=p.pending_reason, pending_message=p.pending_message
        )
