"""Jobs of Slurm regions: gpupool admits them (quota, budget, dependencies, at submission and in the
cycle as everywhere), Slurm places and runs them. The rules, in the order one sync applies them:

1. Inventory: the region's nodes and GRES GPUs are read into the fleet (``nodes.services.slurm``).
2. Submission: a QUEUED job of the region becomes one ``sbatch`` (``--gres=gpu:<type>:<n>`` of the
   first acceptable model the region maps to a GRES type, CPUs, memory, time limit, the tenant's
   account, the plan's partition and the priority class's QOS). Its Slurm name is
   ``gpupool-<workload id>``: a job sbatch made but whose row was not saved (a crash in between)
   is found by that name in ``squeue`` and adopted, never submitted twice. Slurm refusing it (an
   account, partition or GRES it does not have) fails the job with Slurm's words.
3. State: squeue's state and pending reason become the workload's (``PENDING_REASONS``); a job
   Slurm runs goes SCHEDULED then RUNNING at Slurm's start time.
4. Stop: a stop asked in gpupool (the job STOPPED while queued, or STOPPING while running) is an
   ``scancel``; the job ends when Slurm says so.
5. Accounting: once a job has ended, sacct (slurmdbd) gives its start, end and GPUs by GRES type;
   they become Allocation rows (ended, one per GPU, on the Slurm node's GPU rows of that type) and
   the RUNNING event at Slurm's start, so metering prices and invoices them as every allocation.
   The workload's terminal state comes with them, in the same transaction.
6. Output: the job's output file (``output_dir``, stdout and stderr together) is read into the
   workload's log lines from where the last sync stopped.
"""

from __future__ import annotations

import getpass
import logging
import math
import shlex
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from django.db import transaction
from django.utils import timezone

from nodes.models import Gpu, GpuModel, Node, Region, RegionBackend
from nodes.services.slurm import slurm_config, slurm_hostname, slurm_inventory_store
from nodes.slurm.cli import JOB_NAME_PREFIX, SlurmAccounting, SlurmCli, SlurmError
from nodes.slurm.cli import SlurmJob as LiveJob
from nodes.slurm.config import SlurmConfig
from portal.actors import Actor
from portal.errors import ValidationFailed
from scheduling.locks import lock_workload
from scheduling.models import (
    MILLI,
    TERMINAL_STATES,
    Allocation,
    DependencyCondition,
    LogStream,
    SlurmJob,
    Workload,
    WorkloadDependency,
    WorkloadLogLine,
    WorkloadState,
)
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
    cli = SlurmCli(config)
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
    return result


# --- submission ------------------------------------------------------------------------------------


def _gres(w: Workload, config: SlurmConfig) -> str:
    """``gpu:<type>:<n>`` for the first acceptable model the region maps, else ``gpu:<n>``."""
    from scheduling.services.submission import candidate_models

    names = [m.name for m in candidate_models(workload=w)]
    for name in names:
        t = config.gres_types.get(name)
        if t:
            return f"gpu:{t}:{w.gpu_count}"
    return f"gpu:{w.gpu_count}"


def _platform_env(w: Workload) -> dict[str, str]:
    env = {"GPUPOOL_WORKLOAD_ID": str(w.pk)}
    if w.image:
        env["GPUPOOL_IMAGE"] = w.image
    if w.array_parent_id is not None:
        count = Workload.objects.filter(pk=w.array_parent_id).values_list("array_count", flat=True).first()
        env["GPUPOOL_ARRAY_INDEX"] = str(w.array_index)
        env["GPUPOOL_ARRAY_COUNT"] = str(count)
    return env


def _dependency(w: Workload) -> str:
    """Slurm's ``afterok:<id>,afterany:<id>`` for the dependencies not yet met (the gate admitted the
    job only when those are jobs of this region submitted to Slurm)."""
    parts = []
    for condition, job_id in (
        WorkloadDependency.objects.filter(workload=w, on__slurm_job__region_id=w.region_id)
        .exclude(on__state__in=TERMINAL_STATES)
        .order_by("on_id")
        .values_list("condition", "on__slurm_job__job_id")
    ):
        parts.append(
            f"{'afterok' if condition == DependencyCondition.SUCCEEDED else 'afterany'}:{int(job_id)}"
        )
    return ",".join(parts)


def sbatch_request(w: Workload, config: SlurmConfig, account: str) -> tuple[list[str], str, str]:
    """(sbatch options, batch script, output path pattern) of a workload. Every value is one argv
    element or shell-quoted in the script: names were checked by the workload rules and the
    region's configuration, text values are quoted whatever they hold."""
    gres = _gres(w, config)
    output = str(Path(config.output_dir) / f"{JOB_NAME_PREFIX}{w.pk}-%j.out")
    options = [
        f"--job-name={JOB_NAME_PREFIX}{w.pk}",
        f"--comment=gpupool workload {w.pk}",
        f"--account={account}",
        f"--gres={gres}",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={max(1, math.ceil(w.cpu_millicores / 1000))}",
        f"--output={output}",
        f"--chdir={config.output_dir}",
        "--export=NONE",
    ]
    if w.ram_mib:
        options.append(f"--mem={w.ram_mib}M")
    if w.max_runtime_s:
        options.append(f"--time={max(1, math.ceil(w.max_runtime_s / 60))}")
    dependency = _dependency(w)
    if dependency:
        options += [f"--dependency={dependency}", "--kill-on-invalid-dep=yes"]
    partition = config.partition(w.plan)
    if partition:
        options.append(f"--partition={partition}")
    qos = config.qos.get(w.priority_class or w.plan)
    if qos:
        options.append(f"--qos={qos}")
    lines = ["#!/bin/bash", "# gpupool workload " + str(int(w.pk))]
    env = {k: v for k, v in w.env.items() if isinstance(v, str)} | _platform_env(w)
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    lines.append("exec " + shlex.join(str(a) for a in w.command))
    return options, "\n".join(lines) + "\n", output


def _submit(region: Region, cli: SlurmCli, live: dict[int, LiveJob], result: SyncResult) -> None:
    config = cli.config
    adoptable: dict[int, LiveJob] = {}
    for job in live.values():
        wid = job.name.removeprefix(JOB_NAME_PREFIX)
        if wid.isdigit():
            adoptable[int(wid)] = job
    known = set(
        SlurmJob.objects.filter(region=region, job_id__in=list(live)).values_list("job_id", flat=True)
    )
    ids = list(
        Workload.objects.filter(region=region, state=WorkloadState.QUEUED, slurm_job__isnull=True)
        .order_by("pk")
        .values_list("pk", flat=True)[:MAX_SUBMIT_PER_SYNC]
    )
    user = getpass.getuser()
    accounts: set[str] = set()
    for wid in ids:
        with transaction.atomic():
            w = lock_workload(workload_id=wid)
            if w.state != WorkloadState.QUEUED or SlurmJob.objects.filter(workload=w).exists():
                continue
            account = slurm_account_name(config, w.tenant)
            if account not in accounts:
                cli.account_ensure(account=account, description=f"gpupool tenant {w.tenant_id}", user=user)
                accounts.add(account)
            options, script, output = sbatch_request(w, config, account)
            # Adopted only if made for this workload: same name, not another row's, and submitted
            # since it was (a name alone may be an older installation's job, kept by MinJobAge).
            found = adoptable.get(w.pk)
            job_id = None
            if (
                found is not None
                and found.job_id not in known
                and found.submitted
                and found.submitted >= w.submitted_at.replace(microsecond=0)
            ):
                job_id = found.job_id
            if job_id is None:
                try:
                    job_id = cli.submit(options=options, script=script)
                except SlurmError as exc:
                    if exc.transient:
                        raise
                    workload_transition(
                        workload=w,
                        to=WorkloadState.FAILED,
                        reason="slurm_refused",
                        message=f"Slurm refused the job: {exc}"[:255],
                        actor=SYSTEM,
                    )
                    result.refused.append(w.pk)
                    continue
            SlurmJob.objects.create(
                workload=w,
                region=region,
                job_id=job_id,
                account=account,
                partition=config.partition(w.plan),
                gres=next((o.split("=", 1)[1] for o in options if o.startswith("--gres=")), ""),
                output_path=output.replace("%j", str(job_id)),
                state="PENDING",
            )
            w.pending_reason, w.pending_message = "slurm", f"Submitted to Slurm as job {job_id}."
            w.save(update_fields=["pending_reason", "pending_message"])
            result.submitted.append(w.pk)


# --- stop ----------------------------------------------------------------------------------------


def _cancel(region: Region, cli: SlurmCli, live: dict[int, LiveJob], result: SyncResult) -> None:
    """scancel the jobs whose workload was stopped in gpupool and that Slurm has not ended."""
    rows = SlurmJob.objects.filter(
        region=region,
        accounted_at__isnull=True,
        cancel_sent_at__isnull=True,
        workload__stop_requested_at__isnull=False,
    )
    for sj in rows:
        job = live.get(sj.job_id)
        if job is not None and job.state in ENDED:
            continue
        cli.cancel(sj.job_id)
        SlurmJob.objects.filter(pk=sj.pk).update(cancel_sent_at=timezone.now())
        result.cancelled.append(sj.workload_id)


# --- state, accounting, output -------------------------------------------------------------------


def _to_running(w: Workload, at: datetime, job_id: int) -> None:
    """QUEUED -> SCHEDULED -> RUNNING at Slurm's start time (billing starts at the RUNNING event),
    or at the workload's last change where that is later (Slurm counts whole seconds; events stay
    in order)."""
    at = max(at, w.state_changed_at)
    if w.state == WorkloadState.QUEUED:
        workload_transition(
            workload=w,
            to=WorkloadState.SCHEDULED,
            reason="slurm",
            message=f"Slurm job {job_id} started.",
            actor=SYSTEM,
            now=at,
        )
    if w.state == WorkloadState.SCHEDULED:
        workload_transition(workload=w, to=WorkloadState.RUNNING, reason="running", actor=SYSTEM, now=at)


def _follow(region: Region, cli: SlurmCli, live: dict[int, LiveJob], result: SyncResult) -> None:
    rows = list(SlurmJob.objects.filter(region=region, accounted_at__isnull=True).order_by("pk"))
    ended = []
    for sj in rows:
        job = live.get(sj.job_id)
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
                    f"Slurm job {sj.job_id}: {job.reason}."
                    if job.reason not in ("", "None")
                    else f"Submitted to Slurm as job {sj.job_id}."
                )
                if (w.pending_reason, w.pending_message) != (reason, message):
                    w.pending_reason, w.pending_message = reason, message[:255]
                    w.save(update_fields=["pending_reason", "pending_message"])
            elif job.state in RUNNING and w.state in (WorkloadState.QUEUED, WorkloadState.SCHEDULED):
                _to_running(w, job.start or timezone.now(), sj.job_id)
                result.started.append(w.pk)
        _read_output(sj)
    if ended:
        accounting = cli.accounting([sj.job_id for sj in ended])
        for sj in ended:
            acct = accounting.get(sj.job_id)
            if acct is None or acct.state not in ENDED:
                continue  # slurmdbd has not recorded its end yet: the next sync finishes it
            _read_output(sj)
            if _finish(region, sj, acct, cli.config):
                result.ended.append(sj.workload_id)


def _end_state(w: Workload, acct: SlurmAccounting, sj_reason: str) -> tuple[str, str, str]:
    if acct.state == "COMPLETED" and (acct.exit_code or 0) == 0:
        return WorkloadState.SUCCEEDED, "exited", f"Slurm job {acct.job_id} completed."
    if acct.state == "CANCELLED" and w.stop_requested_at is not None:
        return WorkloadState.STOPPED, "stopped", f"Slurm job {acct.job_id} was cancelled (scancel)."
    if acct.state == "CANCELLED" and "Dependency" in sj_reason:
        return (
            WorkloadState.FAILED,
            "dependency_never_satisfied",
            f"Slurm job {acct.job_id}: its dependency failed.",
        )
    if acct.state == "TIMEOUT":
        return WorkloadState.FAILED, "max_runtime", f"Slurm job {acct.job_id} reached its time limit."
    code = f" (exit code {acct.exit_code})" if acct.exit_code is not None else ""
    return (
        WorkloadState.FAILED,
        f"slurm_{acct.state.lower()}"[:32],
        f"Slurm job {acct.job_id}: {acct.state}{code}.",
    )


def _finish(region: Region, sj: SlurmJob, acct: SlurmAccounting, config: SlurmConfig) -> bool:
    with transaction.atomic():
        sj = SlurmJob.objects.select_for_update().get(pk=sj.pk)
        if sj.accounted_at is not None:
            return False
        w = lock_workload(workload_id=sj.workload_id)
        ran = bool(acct.nodes) and acct.start is not None and acct.end is not None and acct.end >= acct.start
        if ran and w.state not in TERMINAL_STATES:
            _to_running(w, acct.start, sj.job_id)
        to, reason, message = _end_state(w, acct, sj.reason)
        if w.state not in TERMINAL_STATES:
            w.exit_code = acct.exit_code
            w.save(update_fields=["exit_code"])
            workload_transition(
                workload=w,
                to=to,
                reason=reason,
                message=message,
                actor=SYSTEM,
                now=acct.end or timezone.now(),
            )
        if ran and w.started_at is not None:
            _allocations(region, w, acct, config)
        SlurmJob.objects.filter(pk=sj.pk).update(state=acct.state[:32], accounted_at=timezone.now())
    return True


def _allocations(region: Region, w: Workload, acct: SlurmAccounting, config: SlurmConfig) -> None:
    """One ended Allocation per GPU sacct counts, on the node's GPU rows of that GRES type (the
    rows are bookkeeping: Slurm chose the devices; ended rows never clash with open ones)."""
    node = Node.objects.filter(hostname=slurm_hostname(region, acct.nodes.split(",")[0])).first()
    if node is None:
        logger.error("Slurm job %s ran on %r, which the inventory does not have", acct.job_id, acct.nodes)
        return
    models = {m.name: m.pk for m in GpuModel.objects.filter(name__in=list(config.gres_types))}
    rows = []
    for gres_type, count in acct.gpus.items():
        model_id = models.get(config.model_of_type(gres_type) or "")
        if model_id is None:
            logger.error(
                "Slurm job %s used gpu:%s, which maps to no catalog model: not billed", acct.job_id, gres_type
            )
            continue
        gpus = list(
            Gpu.objects.filter(
                node=node,
                uuid__startswith=f"slurm:{region.code}:{node.labels.get('slurm_node')}:{gres_type}:",
            ).order_by("index")[:count]
        )
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
                    started_at=acct.start,
                    ended_at=acct.end,
                    end_reason=f"slurm_{acct.state.lower()}"[:64],
                )
            )
    Allocation.objects.bulk_create(rows)


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
