"""Job dependencies, as Slurm's ``afterok`` and ``afterany``: a job submitted with
``"depends_on": [{"job": ID, "condition": "succeeded" | "finished"}]`` stays PENDING until every job
it names has ended that way ("succeeded": it succeeded; "finished": it succeeded, failed or stopped).
A dependency that can no longer be met (a "succeeded" one that failed or was stopped) fails the job
that waits, naming it. Only the tenant's own jobs may be named: another tenant's id is answered as
an unknown one. A dependency names a job that exists when the dependent is submitted and cannot be
changed afterwards, so the graph has no cycle by construction; ``dependencies_validate`` refuses the
ways one could be spelt anyway (an id not yet given, the same job twice).

The scheduling cycle calls ``dependencies_gate`` before it admits PENDING work: the jobs it returns
are not admitted (their ``pending_reason`` is ``dependency``) or have just failed.

In a Slurm region the wait is Slurm's: a job whose open dependencies are all jobs of its own Slurm
region already submitted there is admitted, and submitted with ``--dependency=afterok:<id>`` (or
``afterany``) and ``--kill-on-invalid-dep=yes`` (``scheduling.services.slurm``).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from nodes.models import RegionBackend
from portal.actors import Actor
from portal.errors import ValidationFailed
from scheduling.locks import lock_workloads_where
from scheduling.models import (
    TERMINAL_STATES,
    DependencyCondition,
    SlurmJob,
    Workload,
    WorkloadDependency,
    WorkloadKind,
    WorkloadState,
)
from scheduling.services.states import workloads_transition

MAX_DEPENDENCIES = 32
SYSTEM = Actor.system()


def _fail(message: str) -> ValidationFailed:
    return ValidationFailed(f"depends_on: {message}", fields={"depends_on": [message]})


def dependencies_validate(*, tenant, raw: Any) -> list[tuple[Workload, str]]:
    """The jobs a submission names in ``depends_on``, with their conditions (400 naming the field)."""
    if raw is None or raw == []:
        return []
    if not isinstance(raw, list):
        raise _fail('A list of {"job": ID, "condition": "succeeded" | "finished"}.')
    if len(raw) > MAX_DEPENDENCIES:
        raise _fail(f"At most {MAX_DEPENDENCIES} dependencies.")
    wanted: dict[int, str] = {}
    for item in raw:
        if not isinstance(item, dict) or set(item) - {"job", "condition"}:
            raise _fail('Each item is {"job": ID, "condition": "succeeded" | "finished"}.')
        job = item.get("job")
        if isinstance(job, bool) or not isinstance(job, int) or job < 1:
            raise _fail("job: a job id.")
        condition = item.get("condition", DependencyCondition.SUCCEEDED)
        if condition not in DependencyCondition.values:
            raise _fail(f"condition: one of {', '.join(DependencyCondition.values)}.")
        if job in wanted:
            raise _fail(f"Job {job} is named twice.")
        wanted[job] = condition
    found = {
        w.pk: w
        for w in Workload.objects.for_tenant(tenant).filter(pk__in=list(wanted), kind=WorkloadKind.JOB)
    }
    for job in wanted:
        if job not in found:
            # Another tenant's job, an instance and an id not given yet read the same.
            raise _fail(f"No job of yours with id {job}.")
    return [(found[job], condition) for job, condition in wanted.items()]


def dependencies_attach(*, tenant, workload: Workload, deps: list[tuple[Workload, str]]) -> None:
    WorkloadDependency.objects.bulk_create(
        [WorkloadDependency(tenant=tenant, workload=workload, on=on, condition=c) for on, c in deps]
    )


def _verdict(condition: str, state: str) -> str:
    """``met``, ``never`` or ``waiting``."""
    if state not in TERMINAL_STATES:
        return "waiting"
    if condition == DependencyCondition.SUCCEEDED and state != WorkloadState.SUCCEEDED:
        return "never"
    return "met"


def dependencies_gate(*, now: datetime) -> set[int]:
    """PENDING workloads whose dependencies are not all met: those that wait get their pending
    reason; those that never can are failed with the reason. Returns both (not to be admitted)."""
    rows = list(
        WorkloadDependency.objects.filter(workload__state=WorkloadState.PENDING)
        .order_by("workload_id", "on_id")
        .values_list(
            "workload_id",
            "on_id",
            "condition",
            "on__state",
            "workload__region__backend",
            "workload__region_id",
        )
    )
    if not rows:
        return set()
    verdicts: dict[int, list[tuple[int, str, str, str]]] = defaultdict(list)
    slurm_regions: dict[int, int] = {}
    for wid, on, condition, state, backend, region_id in rows:
        verdicts[wid].append((on, condition, state, _verdict(condition, state)))
        if backend == RegionBackend.SLURM:
            slurm_regions[wid] = region_id
    if slurm_regions:
        # Dependencies Slurm holds: jobs of the same Slurm region, already submitted there.
        submitted = set(
            SlurmJob.objects.filter(
                workload_id__in=[on for wid in slurm_regions for on, _, _, _ in verdicts[wid]]
            ).values_list("workload_id", "region_id")
        )
        for wid, region_id in slurm_regions.items():
            items = verdicts[wid]
            if all(v == "met" or (v == "waiting" and (on, region_id) in submitted) for on, _, _, v in items):
                verdicts[wid] = [(on, c, st, "met") for on, c, st, _ in items]
    never: dict[int, str] = {}
    waiting: dict[int, str] = {}
    for wid, items in verdicts.items():
        broken = [(on, c, s) for on, c, s, v in items if v == "never"]
        if broken:
            on, _, state = broken[0]
            never[wid] = f"Dependency never satisfied: job {on} {state} (it had to succeed)."
            continue
        open_ = [(on, c, s) for on, c, s, v in items if v == "waiting"]
        if open_:
            text = ", ".join(
                f"job {on} to {'succeed' if c == 'succeeded' else 'finish'} ({s})" for on, c, s in open_
            )
            waiting[wid] = f"Waiting for {text}."[:255]
    if never:
        failing = list(lock_workloads_where(pk__in=list(never), state=WorkloadState.PENDING))
        workloads_transition(
            workloads=failing,
            to=WorkloadState.FAILED,
            reason="dependency_never_satisfied",
            actor=SYSTEM,
            messages={w.pk: never[w.pk] for w in failing},
            now=now,
        )
    changed: dict[str, list[int]] = defaultdict(list)
    current = dict(Workload.objects.filter(pk__in=list(waiting)).values_list("pk", "pending_message"))
    for wid, message in waiting.items():
        if current.get(wid) != message:
            changed[message].append(wid)
    for message, ids in changed.items():
        Workload.objects.filter(pk__in=ids, state=WorkloadState.PENDING).update(
            pending_reason="dependency", pending_message=message, expected_start_at=None
        )
    return set(never) | set(waiting)
