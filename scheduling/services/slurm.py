"""Jobs of Slurm regions: gpupool admits them (quota, budget, dependencies, at submission and in the
cycle as everywhere), Slurm places and runs them. The rules, in the order one sync applies them:

1. Inventory: the region's nodes and GRES GPUs are read into the fleet (``nodes.services.slurm``).
2. Submission: a QUEUED job of the region becomes one ``sbatch`` (``--gres=gpu:<type>:<n>`` of the
   first acceptable model the region maps to a GRES type, CPUs, memory, time limit, the tenant's
   account, the plan's partition and the priority class's QOS). Its Slurm name is
   ``gpupool-<workload id>``: a job sbatch made but whose row was not saved (a crash in between)
   is found by that name in ``squeue`` and adopted, never submitted twice. Slurm refusing it (an
   account, partition or GRES it does not have) fails the job with Slurm's words.
   An array job (``scheduling.services.arrays``) becomes ONE Slurm array job,
   ``--array=0-<N-1>%<P>``, once the cycle has made its first tasks (its dependencies are met or
   Slurm's); each task row gpupool makes is Slurm's task ``<job id>_<index>``, followed on its own.
   A gang (``gang`` or ``gpus_per_node``) becomes one job of ``--nodes=<n> --ntasks-per-node=1``
   with the GRES per node, whose batch script runs the command on every node through ``srun`` with
   the rendezvous variables gang members get everywhere (``scheduling.services.slurm_jobs``).
3. State: squeue's state and pending reason become the workload's (``PENDING_REASONS``); a job
   Slurm runs goes SCHEDULED then RUNNING at Slurm's start time, and from then holds open
   Allocation rows for the GPUs Slurm gave it (per node, by GRES type), as agent-run work does: so
   quotas (per model) and budgets (cost to date) count it while it runs, by the same code.
4. Stop: a stop asked in gpupool (the job STOPPED while queued, or STOPPING while running) is an
   ``scancel``; the job ends when Slurm says so. A stopped array job is one ``scancel`` of the
   Slurm array job (every task); one task stopped alone is ``scancel <id>_<index>``.
5. Accounting: once a job has ended, sacct (slurmdbd) gives its start, end and GPUs by GRES type
   (an array's: each task's); its allocations end at sacct's end (made then, if the job started and
   ended between two syncs), so metering prices and invoices them as every allocation. The
   workload's terminal state comes with them, in the same transaction.
6. Output: the job's output file (``output_dir``, stdout and stderr together; an array task's
   own) is read into the workload's log lines from where the last sync stopped.
"""

from __future__ import annotations

import getpass
import logging
from dataclasses import dataclass, field, replace
from datetime import datetime

from django.db import connection, transaction
from django.db.models import Count, F, Q, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from nodes.models import Gpu, GpuModel, Node, Region, RegionBackend
from nodes.services.slurm import slurm_config, slurm_hostname, slurm_inventory_store
from nodes.slurm.cli import JOB_NAME_PREFIX, JobKey, SlurmAccounting, SlurmError
from nodes.slurm.cli import SlurmJob as LiveJob
from nodes.slurm.config import SlurmConfig
from nodes.slurm.rest import SlurmConnector, slurm_connector_for
from portal.actors import Actor
from portal.errors import ValidationFailed
from scheduling.locks import lock_workload
from scheduling.models import (
    MILLI,
    SLURM_RELEASED,
    SLURM_REQUEUED,
    TERMINAL_STATES,
    Allocation,
    LogStream,
    SlurmJob,
    Workload,
    WorkloadEvent,
    WorkloadLogLine,
    WorkloadState,
)
from scheduling.services.arrays import array_tasks_make
from scheduling.services.gangs import gang_port_choose, gang_ports_used
from scheduling.services.slurm_jobs import gres_type_for, job_shape, mapped_candidates, sbatch_request
from scheduling.services.states import workload_transition

logger = logging.getLogger(__name__)
SYSTEM = Actor.system()

ENDED = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "NODE_FAIL",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
    }
)
RUNNING = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STAGE_OUT", "SIGNALING"})
# Slurm's pending reason -> gpupool's (the API's ``pending.reason``); the message keeps Slurm's word.
PENDING_REASONS = {
    "Resources": "capacity",
    "ReqNodeNotAvail": "capacity",
    "NodeDown": "capacity",
    "PartitionDown": "capacity",
    "PartitionInactive": "capacity",
    "Priority": "priority",
    "Dependency": "dependency",
    "DependencyNeverSatisfied": "dependency",
    "BeginTime": "scheduled",
    "JobHeldUser": "held",
    "JobHeldAdmin": "held",
    "JobArrayTaskLimit": "array",
}
QUOTA_PREFIXES = ("QOSMax", "QOSGrp", "AssocGrp", "AssocMax", "QOSJobLimit", "AccountingPolicy")
MAX_SUBMIT_PER_SYNC = 200
MAX_LOG_BYTES_PER_SYNC = 1 << 20


@dataclass
class SyncResult:
    region: str
    nodes: int = 0
    submitted: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    started: list[int] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    error: str = ""


def pending_reason(reason: str) -> str:
    if reason in PENDING_REASONS:
        return PENDING_REASONS[reason]
    if reason.startswith(QUOTA_PREFIXES):
        return "quota"
    return "slurm"


def slurm_account_name(config: SlurmConfig, tenant) -> str:
    """The Slurm account of a tenant: the prefix and the tenant's slug (a slug is [a-z0-9-])."""
    return f"{config.account_prefix}{tenant.slug}"[:64].lower()


def slurm_regions_sync(*, now: datetime | None = None) -> list[SyncResult]:
    return [
        slurm_region_sync(region=r, now=now)
        for r in Region.objects.filter(backend=RegionBackend.SLURM).order_by("pk")
    ]


def slurm_region_sync(*, region: Region, now: datetime | None = None) -> SyncResult:
    """One pass of the rules above for one region; Slurm not answering is reported, not raised."""
    result = SyncResult(region=region.code)
    try:
        config = slurm_config(region)
    except ValidationFailed as exc:
        result.error = f"configuration: {exc.message}"
        logger.error("Slurm region %s: %s", region.code, result.error)
        return result
    cli = slurm_connector_for(config)
    try:
        result.nodes = slurm_inventory_store(region=region, nodes=cli.nodes(), config=config, now=now).nodes
        live = cli.jobs()
        _submit(region, cli, live, result)
        live = cli.jobs()
        _cancel(region, cli, live, result)
        _follow(region, cli, live, result)
    except SlurmError as exc:
        result.error = str(exc)
        logger.warning("Slurm region %s: %s", region.code, exc)
    if result.ended:
        # Ended tasks make room for an array's next ones (the cycle makes them).
        from scheduling.services.triggers import cycle_request

        cycle_request(reason="slurm")
    return result


# --- submission ------------------------------------------------------------------------------------


def _refuse(w: Workload, message: str, result: SyncResult) -> None:
    workload_transition(
        workload=w, to=WorkloadState.FAILED, reason="slurm_refused", message=message[:255], actor=SYSTEM
    )
    result.refused.append(w.pk)


def _submit(region: Region, cli: SlurmConnector, live: dict[JobKey, LiveJob], result: SyncResult) -> None:
    config = cli.config
    known = set(
        SlurmJob.objects.filter(
            region=region, job_id__in=[k[0] for k in live], array_task_id__isnull=True
        ).values_list("job_id", flat=True)
    )
    for earlier in (
        SlurmJob.objects.filter(region=region)
        .exclude(earlier_job_ids=[])
        .values_list("earlier_job_ids", flat=True)
    ):
        known.update(int(i) for i in earlier)  # an earlier attempt's job is never adopted
    adoptable: dict[int, LiveJob] = {}
    for job in live.values():
        wid = job.name.removeprefix(JOB_NAME_PREFIX)
        if wid.isdigit() and job.key[0] not in known:
            adoptable[int(wid)] = job
    # Jobs (an array's tasks are its Slurm array's), jobs queued again for a retry (their row's
    # last Slurm job accounted), and array jobs whose first tasks the cycle made.
    ids = list(
        Workload.objects.filter(region=region, state=WorkloadState.QUEUED, array_parent__isnull=True)
        .filter(Q(slurm_job__isnull=True) | Q(slurm_job__accounted_at__isnull=False))
        .order_by("pk")
        .values_list("pk", flat=True)[:MAX_SUBMIT_PER_SYNC]
    )
    ids += list(
        Workload.objects.filter(
            region=region,
            array_count__isnull=False,
            state__in=[WorkloadState.PENDING, WorkloadState.RUNNING],
            stop_requested_at__isnull=True,
            slurm_job__isnull=True,
            array_tasks__state=WorkloadState.QUEUED,
        )
        .distinct()
        .order_by("pk")
        .values_list("pk", flat=True)[:MAX_SUBMIT_PER_SYNC]
    )
    user = getpass.getuser()
    accounts: set[str] = set()
    for wid in sorted(ids):
        _array_task_ids_reserve(wid)
        with transaction.atomic():
            w = lock_workload(workload_id=wid)
            waiting = (
                (WorkloadState.PENDING, WorkloadState.RUNNING) if w.is_array else (WorkloadState.QUEUED,)
            )
            current = SlurmJob.objects.filter(workload=w).first()
            if w.state not in waiting or w.stop_requested_at or (current and current.accounted_at is None):
                continue
            account = slurm_account_name(config, w.tenant)
            if account not in accounts:
                cli.account_ensure(account=account, description=f"gpupool tenant {w.tenant_id}", user=user)
                accounts.add(account)
            model, _ = gres_type_for(w, config)
            if model is None and mapped_candidates(w, config):
                # Every mapped model is at the tenant's per-model quota: it waits, as in the cycle.
                message = "Every acceptable GPU model is at your per-model GPU quota."
                if (w.pending_reason, w.pending_message) != ("quota", message):
                    w.pending_reason, w.pending_message = "quota", message
                    w.save(update_fields=["pending_reason", "pending_message"])
                continue
            shape = job_shape(region, w, config)
            if (w.gang or w.gpus_per_node) and shape is None:
                _refuse(w, f"No node of {region.code} takes {w.gpu_count} GPUs in these shapes.", result)
                continue
            if shape is not None and w.gang_port is None:
                w.gang_port = gang_port_choose(workload_id=w.pk, used=gang_ports_used())
                w.save(update_fields=["gang_port"])
            options, script, output = sbatch_request(w, config, account, shape=shape, port=w.gang_port or 0)
            # Adopted only if made for this workload: same name, not another row's, and submitted
            # since it was (a name alone may be an older installation's job, kept by MinJobAge).
            found = adoptable.get(w.pk)
            job_id = None
            if (
                found is not None
                and found.submitted
                and found.submitted >= (w.queued_at or w.submitted_at).replace(microsecond=0)
            ):
                job_id = found.key[0]
            if job_id is None:
                try:
                    job_id = cli.submit(options=options, script=script)
                except SlurmError as exc:
                    if exc.transient:
                        raise
                    # An array job fails with its tasks made so far, all with Slurm's words.
                    for task in Workload.objects.filter(array_parent=w).exclude(state__in=TERMINAL_STATES):
                        _refuse(lock_workload(workload_id=task.pk), f"Slurm refused the job: {exc}", result)
                    _refuse(w, f"Slurm refused the job: {exc}", result)
                    continue
            fields = {
                "region": region,
                "job_id": job_id,
                "account": account,
                "partition": config.partition(w.plan),
                "gres": next((o.split("=", 1)[1] for o in options if o.startswith("--gres=")), ""),
                "output_path": output.replace("%j", str(job_id)),
                "state": "PENDING",
            }
            if current is None:
                SlurmJob.objects.create(workload=w, **fields)
            else:
                # A retry: the row follows the new Slurm job; the earlier one is kept by its id.
                SlurmJob.objects.filter(pk=current.pk).update(
                    **fields,
                    earlier_job_ids=[*current.earlier_job_ids, current.job_id],
                    reason="",
                    submitted_at=timezone.now(),
                    cancel_sent_at=None,
                    output_offset=0,
                    accounted_at=None,
                )
            message = f"Submitted to Slurm as {'array ' if w.is_array else ''}job {job_id}."
            w.pending_reason, w.pending_message = "slurm", message
            w.attempt += 1  # placements so far, as the cycle counts them in agent regions
            w.save(update_fields=["pending_reason", "pending_message", "attempt"])
            result.submitted.append(w.pk)
    _tasks_attach(region)


def _array_task_ids_reserve(workload_id: int) -> None:
    """An array job's task ids, one per index, before its Slurm array is submitted: the ids of the
    tasks the cycle made, and ids taken from the workload sequence for the rest (the cycle makes
    those rows with them, ``arrays._tasks_create``). Committed before sbatch runs, so a job sbatch
    made before a crash, adopted later, has the ids its script was given."""
    with transaction.atomic():
        w = lock_workload(workload_id=workload_id)
        if not w.is_array or (w.array_task_ids and len(w.array_task_ids) == w.array_count):
            return
        made = dict(Workload.objects.filter(array_parent=w).values_list("array_index", "pk"))
        missing = [i for i in range(w.array_count) if i not in made]
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT nextval(pg_get_serial_sequence(%s, 'id')) FROM generate_series(1, %s)",
                [Workload._meta.db_table, len(missing)],
            )
            new = iter(sorted(row[0] for row in cursor.fetchall()))
        w.array_task_ids = [made[i] if i in made else next(new) for i in range(w.array_count)]
        w.save(update_fields=["array_task_ids"])


def _tasks_attach(region: Region) -> None:
    """Each task row of a submitted array job is its Slurm array's task ``<job id>_<index>``,
    whatever its state (one stopped before the array was submitted is then scancelled alone)."""
    tasks = list(
        Workload.objects.filter(
            region=region,
            slurm_job__isnull=True,
            array_parent__slurm_job__isnull=False,
        )
        .select_related("array_parent__slurm_job")
        .order_by("pk")
    )
    for t in tasks:
        parent = t.array_parent.slurm_job
        SlurmJob.objects.get_or_create(
            workload=t,
            defaults={
                "region": region,
                "job_id": parent.job_id,
                "array_task_id": t.array_index,
                "account": parent.account,
                "partition": parent.partition,
                "gres": parent.gres,
                "output_path": parent.output_path.replace("%A", str(parent.job_id)).replace(
                    "%a", str(t.array_index)
                ),
                "state": "PENDING",
            },
        )


# --- stop ----------------------------------------------------------------------------------------


def _label(sj: SlurmJob) -> str:
    return f"{sj.job_id}_{sj.array_task_id}" if sj.array_task_id is not None else str(sj.job_id)


def _cancel(region: Region, cli: SlurmConnector, live: dict[JobKey, LiveJob], result: SyncResult) -> None:
    """scancel the jobs whose workload was stopped in gpupool and that Slurm has not ended: an
    array job's row cancels the whole Slurm array (one command), and its tasks with it."""
    rows = SlurmJob.objects.filter(
        region=region,
        accounted_at__isnull=True,
        cancel_sent_at__isnull=True,
        workload__stop_requested_at__isnull=False,
    ).select_related("workload")
    now = timezone.now()
    arrays = set()
    for sj in sorted(rows, key=lambda r: (r.array_task_id is not None, r.pk)):
        if sj.array_task_id is None and sj.workload.is_array:
            if any(k[0] == sj.job_id and k[1] is not None for k in live):
                cli.cancel(sj.job_id)
            arrays.add(sj.job_id)
            SlurmJob.objects.filter(region=region, job_id=sj.job_id).update(cancel_sent_at=now)
            result.cancelled.append(sj.workload_id)
            continue
        if sj.array_task_id is not None and sj.job_id in arrays:
            continue  # cancelled with its array
        job = live.get((sj.job_id, sj.array_task_id))
        if job is not None and job.state in ENDED:
            continue
        if job is None and sj.array_task_id is not None:
            continue  # Slurm has nothing of that task left to cancel
        cli.cancel(sj.job_id, sj.array_task_id)
        SlurmJob.objects.filter(pk=sj.pk).update(cancel_sent_at=now)
        result.cancelled.append(sj.workload_id)


# --- state, accounting, output -------------------------------------------------------------------


def _to_running(w: Workload, at: datetime, label: str) -> None:
    """QUEUED -> SCHEDULED -> RUNNING at Slurm's start time (billing starts at the RUNNING event).
    Slurm counts whole seconds, so a start before the workload's last change is taken as that
    change; but an array task whose row the cycle made after Slurm had started it takes Slurm's
    time for its whole history (its row, and events, move back to it), so it is billed from then."""
    if w.array_parent_id is not None and at < w.state_changed_at and w.started_at is None:
        WorkloadEvent.objects.filter(workload=w, at__gt=at).update(at=at)
        w.submitted_at = min(w.submitted_at, at)
        w.queued_at = min(w.queued_at or at, at)
        w.state_changed_at = at
        w.save(update_fields=["submitted_at", "queued_at", "state_changed_at"])
    at = max(at, w.state_changed_at)
    if w.state == WorkloadState.QUEUED:
        workload_transition(
            workload=w,
            to=WorkloadState.SCHEDULED,
            reason="slurm",
            message=f"Slurm job {label} started.",
            actor=SYSTEM,
            now=at,
        )
    if w.state == WorkloadState.SCHEDULED:
        workload_transition(workload=w, to=WorkloadState.RUNNING, reason="running", actor=SYSTEM, now=at)


def _hold(
    region: Region,
    w: Workload,
    placed: list[tuple[str, dict[str, int]]],
    config: SlurmConfig,
    *,
    label: str,
    start: datetime,
    end: datetime | None = None,
    end_reason: str = "",
    running: frozenset[JobKey] = frozenset(),
) -> int:
    """Allocation rows for the GPUs Slurm job ``label`` gave ``w``: ``placed`` is (Slurm node, GRES
    type -> count) per node; ``start`` is Slurm's start of it. Open (``end`` None) while it runs, so
    quotas and costs to date count it as agent-run work; the rows are bookkeeping (Slurm chose the
    devices): a node's GPU rows of that type that no other open allocation holds. Slurm's word
    wins: an open row another workload still holds there whose Slurm job squeue no longer runs
    (``running``: the keys it runs) is closed now, ``slurm_released`` (its end is set to sacct's
    when that comes, ``_finish``; billed only then). Ended rows (``end``) take any GPU row."""
    models = {m.name: m.pk for m in GpuModel.objects.filter(name__in=list(config.gres_types))}
    rows = []
    now = timezone.now()
    for slurm_node, gres in placed:
        node = Node.objects.filter(hostname=slurm_hostname(region, slurm_node)).first()
        if node is None:
            logger.error(
                "Slurm job of workload %s ran on %r, which the inventory does not have", w.pk, slurm_node
            )
            continue
        for gres_type, count in gres.items():
            model_id = models.get(config.model_of_type(gres_type) or "")
            if model_id is None:
                logger.error(
                    "Workload %s used gpu:%s, which maps to no catalog model: not billed", w.pk, gres_type
                )
                continue
            gpus = list(
                Gpu.objects.filter(
                    node=node, uuid__startswith=f"slurm:{region.code}:{slurm_node}:{gres_type}:"
                ).order_by("index")
            )
            if end is None:
                holders = Allocation.objects.filter(gpu__in=gpus, ended_at__isnull=True).exclude(workload=w)
                free = [g for g in gpus if g.pk not in {a.gpu_id for a in holders}]
                if len(free) < count:
                    stale = [
                        a
                        for a in holders.select_related("workload__slurm_job")
                        if not hasattr(a.workload, "slurm_job")
                        or (a.workload.slurm_job.job_id, a.workload.slurm_job.array_task_id) not in running
                    ]
                    Allocation.objects.filter(pk__in=[a.pk for a in stale]).update(
                        ended_at=Greatest(F("started_at"), Value(now)), end_reason=SLURM_RELEASED
                    )
                    released = {a.gpu_id for a in stale}
                    free += [g for g in gpus if g.pk in released and g not in free]
                gpus = free[:count]
                if len(gpus) < count:
                    logger.error("Workload %s: Slurm gave it GPUs gpupool sees held on %s", w.pk, slurm_node)
            else:
                gpus = gpus[:count]
            for g in gpus:
                rows.append(
                    Allocation(
                        tenant_id=w.tenant_id,
                        workload=w,
                        node=node,
                        gpu=g,
                        gpu_model_id=model_id,
                        plan=w.plan,
                        fraction_milli=MILLI,
                        started_at=start,
                        ended_at=end,
                        end_reason=end_reason,
                        slurm_job_label=label,
                    )
                )
    Allocation.objects.bulk_create(rows)
    return len(rows)


def _own(acct: SlurmAccounting | None, first: datetime) -> SlurmAccounting | None:
    return acct if acct is None or acct.submitted is None or acct.submitted >= first else None


def _model_id_of(config: SlurmConfig, gres_type: str) -> int | None:
    name = config.model_of_type(gres_type)
    return GpuModel.objects.filter(name=name).values_list("pk", flat=True).first() if name else None


def _requeued_by_slurm(w: Workload, job: LiveJob, label: str) -> None:
    """Slurm put a job it ran back to pending (it requeued it itself, after a node failure, where
    it could not be told not to: 22.05's REST API drops ``requeue=false``). As a node lost under
    an agent's job: its GPUs are released now (billed to now), and it waits queued, without using
    a retry, until Slurm runs it again (then it holds GPUs again from that start)."""
    now = timezone.now()
    Allocation.objects.filter(workload=w, ended_at__isnull=True).update(
        ended_at=Greatest(F("started_at"), Value(now)), end_reason=SLURM_REQUEUED
    )
    workload_transition(
        workload=w,
        to=WorkloadState.QUEUED,
        reason="node_down",
        message=f"Slurm requeued job {label} ({job.reason or 'requeued'}).",
        actor=SYSTEM,
        now=max(now, w.state_changed_at),
    )


def _arrays_end(region: Region, cli: SlurmConnector, live: dict[JobKey, LiveJob]) -> None:
    """An array job's own row is its Slurm array: its tasks' rows are followed; it ends with the
    array job. A stopped array makes no more task rows, but Slurm may have started tasks whose rows
    the cycle had not made yet: those sacct (or squeue) shows run get their rows now, stopped
    with the array, so that their own sacct records bill them (``_finish``). The array's row ends
    once none of them is still running in Slurm."""
    rows = list(
        SlurmJob.objects.filter(
            region=region,
            accounted_at__isnull=True,
            array_task_id__isnull=True,
            workload__array_count__isnull=False,
            workload__state__in=TERMINAL_STATES,
        ).select_related("workload")
    )
    unmade: dict[int, list[int]] = {}
    for sj in rows:
        made = set(
            Workload.objects.filter(array_parent_id=sj.workload_id).values_list("array_index", flat=True)
        )
        unmade[sj.pk] = [i for i in range(sj.workload.array_count or 0) if i not in made]
    asked = sorted({sj.job_id for sj in rows if unmade[sj.pk]})
    accounting = cli.accounting(asked) if asked else {}
    for sj in rows:
        first = sj.workload.submitted_at.replace(microsecond=0)
        ran: list[int] = []
        running = False
        for i in unmade[sj.pk]:
            acct = _own(accounting.get((sj.job_id, i)), first)
            job = live.get((sj.job_id, i))
            if (job is not None and job.state not in ENDED and job.state != "PENDING") or (
                acct is not None and acct.state not in ENDED
            ):
                running = True  # (the next sync, once Slurm has ended it)
            elif acct is not None and acct.nodes and acct.start is not None:
                ran.append(i)
        with transaction.atomic():
            parent = lock_workload(workload_id=sj.workload_id)
            made = set(Workload.objects.filter(array_parent=parent).values_list("array_index", flat=True))
            todo = [i for i in ran if i not in made]
            tasks = array_tasks_make(parent=parent, indices=todo, now=timezone.now()) if todo else []
            for t in tasks:
                t.stop_requested_at = parent.stop_requested_at
                t.save(update_fields=["stop_requested_at"])
                workload_transition(
                    workload=t,
                    to=WorkloadState.STOPPED,
                    reason="array_stopped" if parent.stop_requested_at else "slurm",
                    message=f"Ended with array job {parent.pk}; Slurm had started task {t.array_index}.",
                    actor=SYSTEM,
                )
            if not running:
                SlurmJob.objects.filter(pk=sj.pk).update(accounted_at=timezone.now())
    if any(unmade.values()):
        _tasks_attach(region)


def _follow(region: Region, cli: SlurmConnector, live: dict[JobKey, LiveJob], result: SyncResult) -> None:
    _arrays_end(region, cli, live)
    rows = list(
        SlurmJob.objects.filter(region=region, accounted_at__isnull=True)
        .exclude(array_task_id__isnull=True, workload__array_count__isnull=False)
        .select_related("workload__array_parent")
        .order_by("pk")
    )
    ended = []
    for sj in rows:
        job = live.get((sj.job_id, sj.array_task_id))
        if job is None or job.state in ENDED:
            ended.append(sj)
            continue
        with transaction.atomic():
            w = lock_workload(workload_id=sj.workload_id)
            if (sj.state, sj.reason) != (job.state, job.reason):
                SlurmJob.objects.filter(pk=sj.pk).update(state=job.state[:32], reason=job.reason[:64])
            if job.state == "PENDING" and w.state == WorkloadState.QUEUED:
                reason = pending_reason(job.reason)
                message = (
                    f"Slurm job {_label(sj)}: {job.reason}."
                    if job.reason not in ("", "None")
                    else f"Submitted to Slurm as job {_label(sj)}."
                )
                if (w.pending_reason, w.pending_message) != (reason, message):
                    w.pending_reason, w.pending_message = reason, message[:255]
                    w.save(update_fields=["pending_reason", "pending_message"])
            elif job.state == "PENDING" and w.state == WorkloadState.RUNNING and w.stop_requested_at is None:
                _requeued_by_slurm(w, job, _label(sj))
            elif (
                job.state in RUNNING
                and w.state in (WorkloadState.QUEUED, WorkloadState.SCHEDULED)
                # (not accounted meanwhile by another sync: a retry queued again is not this run)
                and SlurmJob.objects.filter(pk=sj.pk, job_id=sj.job_id, accounted_at__isnull=True).exists()
            ):
                _to_running(w, job.start or timezone.now(), _label(sj))
                if w.state == WorkloadState.RUNNING and job.node_gres:
                    running = frozenset(k for k, j in live.items() if j.state in RUNNING)
                    _hold(
                        region,
                        w,
                        list(job.node_gres),
                        cli.config,
                        label=_label(sj),
                        start=job.start or w.state_changed_at,
                        running=running,
                    )
                result.started.append(w.pk)
        _read_output(sj)
    if ended:
        accounting = cli.accounting(sorted({sj.job_id for sj in ended}))
        for sj in ended:
            # Records submitted before the workload (the array job, for a task) are another job's
            # that had the same id (Slurm's counter reset, or past MaxJobId): not this one's.
            first = (sj.workload.array_parent or sj.workload).submitted_at.replace(microsecond=0)
            acct = _own(accounting.get((sj.job_id, sj.array_task_id)), first)
            if acct is None and sj.array_task_id is not None:
                # A task Slurm never started ended with its array's own record, which lists it
                # (slurmdbd may list it there for a moment after it started: only a task gpupool
                # never saw run, of an array squeue no longer has, is taken as never run).
                rest = _own(accounting.get((sj.job_id, None)), first)
                gone = not any(k[0] == sj.job_id for k in live)
                never_ran = gone and Workload.objects.filter(pk=sj.workload_id, started_at=None).exists()
                if (
                    never_ran
                    and rest is not None
                    and rest.state in ENDED
                    and sj.array_task_id in rest.unstarted_tasks
                ):
                    acct = replace(rest, nodes="", gpus={}, start=None)
                elif never_ran and rest is None:
                    if Workload.objects.filter(pk=sj.workload_id, state__in=TERMINAL_STATES).exists():
                        # Stopped in gpupool before Slurm ran it, and Slurm keeps no record of it.
                        SlurmJob.objects.filter(pk=sj.pk).update(accounted_at=timezone.now())
                    continue
            if acct is None or acct.state not in ENDED:
                continue  # slurmdbd has not recorded its end yet: the next sync finishes it
            _read_output(sj)
            if _finish(region, cli, sj, acct):
                result.ended.append(sj.workload_id)


def _end_state(w: Workload, acct: SlurmAccounting, sj_reason: str, label: str) -> tuple[str, str, str]:
    if acct.state == "COMPLETED" and (acct.exit_code or 0) == 0:
        return WorkloadState.SUCCEEDED, "exited", f"Slurm job {label} completed."
    if acct.state == "CANCELLED" and w.stop_requested_at is not None:
        return WorkloadState.STOPPED, "stopped", f"Slurm job {label} was cancelled (scancel)."
    if acct.state == "CANCELLED" and "Dependency" in sj_reason:
        return (
            WorkloadState.FAILED,
            "dependency_never_satisfied",
            f"Slurm job {label}: its dependency failed.",
        )
    if acct.state == "TIMEOUT":
        return WorkloadState.FAILED, "max_runtime", f"Slurm job {label} reached its time limit."
    code = f" (exit code {acct.exit_code})" if acct.exit_code is not None else ""
    return (
        WorkloadState.FAILED,
        f"slurm_{acct.state.lower()}"[:32],
        f"Slurm job {label}: {acct.state}{code}.",
    )


# Slurm's ends that a job's retry policy (``max_retries``) applies to, as a failed exit does on an
# agent; NODE_FAIL is a node lost under it (an agent node DOWN), PREEMPTED a preemption (with
# ``requeue_on_preemption``): queued again without using a retry.
RETRIED = frozenset({"FAILED", "OUT_OF_MEMORY", "BOOT_FAIL", "COMPLETED"})
REQUEUED_FREE = frozenset({"NODE_FAIL"})


def _retry(w: Workload, acct: SlurmAccounting, to: str, reason: str, message: str, end: datetime) -> bool:
    """A failed job goes back to the queue while its retries last, as in agent regions
    (``lifecycle._requeue_or_fail``): the next sync submits it to Slurm again as a new Slurm job
    (``attempt`` counts them). Not an array's task (refused at submission), nor a stopped job,
    nor one Slurm ended at its time limit or for its dependency. True if it was queued again."""
    if to != WorkloadState.FAILED or w.stop_requested_at is not None or w.array_parent_id is not None:
        return False
    free = acct.state in REQUEUED_FREE or (acct.state == "PREEMPTED" and w.requeue_on_preemption)
    if not free and acct.state not in RETRIED:
        return False
    if not free and w.retries >= w.max_retries:
        if w.max_retries:
            workload_transition(
                workload=w,
                to=to,
                reason=reason,
                message=f"{message} No retries left ({w.max_retries}).",
                actor=SYSTEM,
                now=end,
            )
            return True
        return False
    if not free:
        w.retries += 1
        w.save(update_fields=["retries"])
    note = "" if free else f" Retry {w.retries} of {w.max_retries}."
    if w.state == WorkloadState.QUEUED:  # it never ran: it stays queued, to be submitted again
        w.pending_reason, w.pending_message = "slurm", f"{message}{note}"[:255]
        w.save(update_fields=["pending_reason", "pending_message"])
    else:
        workload_transition(
            workload=w,
            to=WorkloadState.QUEUED,
            reason=("preempted" if acct.state == "PREEMPTED" else "node_down") if free else "failed",
            message=f"{message}{note}",
            actor=SYSTEM,
            now=end,
        )
    return True


def _finish(region: Region, cli: SlurmConnector, sj: SlurmJob, acct: SlurmAccounting) -> bool:
    """The workload's end and its allocations' from sacct, in one transaction, once per Slurm job
    (``accounted_at``, under the row's lock and the workload's): see ``_account``."""
    label = _label(sj)
    with transaction.atomic():
        sj = SlurmJob.objects.select_for_update().get(pk=sj.pk)
        if sj.accounted_at is not None:
            return False
        w = lock_workload(workload_id=sj.workload_id)
        ran = bool(acct.nodes) and acct.start is not None and acct.end is not None and acct.end >= acct.start
        if ran and w.state not in TERMINAL_STATES:
            _to_running(w, acct.start, label)
        to, reason, message = _end_state(w, acct, sj.reason, label)
        end = acct.end or timezone.now()
        if w.state not in TERMINAL_STATES:
            end = max(end, w.state_changed_at)  # events stay in order (Slurm counts whole seconds)
            w.exit_code = acct.exit_code
            w.save(update_fields=["exit_code"])
            if not _retry(w, acct, to, reason, message, end):
                workload_transition(workload=w, to=to, reason=reason, message=message, actor=SYSTEM, now=end)
        if ran:
            _account(region, cli, w, label, acct)
        else:
            # sacct has no run of it to bill: what squeue showed running stays as gpupool closed it.
            Allocation.objects.filter(workload=w, slurm_job_label=label).exclude(
                end_reason=SLURM_REQUEUED
            ).update(
                ended_at=Greatest(F("started_at"), Coalesce(F("ended_at"), Value(end))),
                end_reason=f"slurm_{acct.state.lower()}"[:64],
            )
        SlurmJob.objects.filter(pk=sj.pk).update(state=acct.state[:32], accounted_at=timezone.now())
    return True


def _account(region: Region, cli: SlurmConnector, w: Workload, label: str, acct: SlurmAccounting) -> None:
    """Slurm job ``label``'s GPU time as sacct records it, exactly once: its allocations (the rows
    squeue's RUNNING made, labelled with it, from Slurm's start) end at sacct's end, whatever
    closed them before; GPUs sacct counts that they do not cover (a job that started and ended
    between two syncs, even in the same second; one stopped in gpupool while Slurm started it; a
    record squeue showed without its GRES) are made from sacct's start to its end, on its nodes
    (GPUs per node its count over them). Billed as they are (``metering.services.usage``): sacct's
    elapsed time, to the second. Rows of an earlier run of the same id (one Slurm requeued) were
    billed to its requeue and are not this record's."""
    start, end = acct.start, acct.end
    if start is None or end is None:
        return
    end_reason = f"slurm_{acct.state.lower()}"[:64]
    held = Allocation.objects.filter(workload=w, slurm_job_label=label).exclude(end_reason=SLURM_REQUEUED)
    held.update(ended_at=Greatest(F("started_at"), Value(end)), end_reason=end_reason)
    missing = sum(acct.gpus.values()) - held.count()
    if missing <= 0:
        return
    hosts = cli.hostnames(acct.nodes)
    placed = [(h, {t: n // max(1, len(hosts)) for t, n in acct.gpus.items()}) for h in hosts]
    if held.exists():  # (the rows are bookkeeping: the rest on its first node)
        have = dict(held.values("gpu_model_id").annotate(n=Count("id")).values_list("gpu_model_id", "n"))
        placed = [
            (
                hosts[0] if hosts else "",
                {t: max(0, n - have.get(_model_id_of(cli.config, t), 0)) for t, n in acct.gpus.items()},
            )
        ]
    _hold(region, w, placed, cli.config, label=label, start=start, end=end, end_reason=end_reason)


def _read_output(sj: SlurmJob) -> None:
    """Append what the job's output file gained since the last read to the workload's log lines
    (whole lines only; a missing file, not yet made or on another filesystem, is left for later)."""
    try:
        with open(sj.output_path, "rb") as fh:
            fh.seek(sj.output_offset)
            chunk = fh.read(MAX_LOG_BYTES_PER_SYNC)
    except OSError:
        return
    end = chunk.rfind(b"\n")
    if end < 0:
        return
    now = timezone.now()
    lines = chunk[: end + 1].decode("utf-8", "replace").splitlines()
    WorkloadLogLine.objects.bulk_create(
        [WorkloadLogLine(workload_id=sj.workload_id, at=now, stream=LogStream.STDOUT, text=t) for t in lines]
    )
    SlurmJob.objects.filter(pk=sj.pk).update(output_offset=sj.output_offset + end + 1)
    sj.output_offset += end + 1
