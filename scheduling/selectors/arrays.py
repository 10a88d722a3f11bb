"""Reads of job arrays, work queues and dependencies, for the API and the workload page."""

from __future__ import annotations

import functools
from typing import Any

from django.db.models import Count, QuerySet

from scheduling.models import (
    WorkItem,
    WorkItemState,
    Workload,
    WorkloadDependency,
    WorkloadKind,
    WorkloadState,
)


def array_tasks(*, workload: Workload) -> QuerySet[Workload]:
    """An array job's tasks made so far, by index."""
    return Workload.objects.filter(array_parent=workload).select_related("region").order_by("array_index")


def array_summary(*, workload: Workload) -> dict[str, Any] | None:
    """Counts of an array job's tasks by state (tasks not made yet count as pending) and, in
    work-queue mode, of its items; None for a workload that is not an array job."""
    if workload.array_count is None:
        return None
    states = dict.fromkeys(WorkloadState.values, 0)
    made = 0
    for state, n in (
        Workload.objects.filter(array_parent=workload)
        .values("state")
        .annotate(n=Count("id"))
        .values_list("state", "n")
        .order_by()
    ):
        states[state] += n
        made += n
    states[WorkloadState.PENDING] += workload.array_count - made
    out: dict[str, Any] = {
        "count": workload.array_count,
        "parallelism": workload.array_parallelism,
        "made": made,
        "states": states,
        "work": None,
    }
    if workload.work_lease_s is not None:
        items = dict.fromkeys(WorkItemState.values, 0)
        for state, n in (
            WorkItem.objects.filter(job=workload)
            .values("state")
            .annotate(n=Count("id"))
            .values_list("state", "n")
            .order_by()
        ):
            items[state] = n
        out["work"] = {"items": sum(items.values()), "lease_s": workload.work_lease_s, **items}
    return out


def workload_dependencies(*, workload: Workload) -> list[dict[str, Any]]:
    """Each job it depends on, the condition and that job's state now (an instance has none)."""
    if workload.kind != WorkloadKind.JOB:
        return []
    return [
        {"job": on, "condition": c, "state": s} for on, c, s in _dependency_rows().filter(workload=workload)
    ]


@functools.cache
def _dependency_rows() -> QuerySet:
    """Dependencies as ``workload_dependencies`` reads them, built once per process (its names
    resolved once; each call narrows a clone): every job detail makes this read."""
    return WorkloadDependency.objects.order_by("on_id").values_list("on_id", "condition", "on__state")


def array_spec_of(*, workload: Workload) -> dict[str, Any]:
    """An array job's ``array`` as it was submitted (for a restart)."""
    if workload.work_lease_s is None:
        return {"count": workload.array_count, "parallelism": workload.array_parallelism}
    items = WorkItem.objects.filter(job=workload).order_by("index")
    head, tail = items.values("first", "last").first(), items.reverse().values("last").first()
    work = {
        "first": head["first"],
        "last": tail["last"],
        "chunk": head["last"] - head["first"] + 1,
        "lease_s": workload.work_lease_s,
    }
    return {"parallelism": workload.array_parallelism, "work": work}
