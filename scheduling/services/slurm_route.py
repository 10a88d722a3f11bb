"""Which Slurm region runs a job that names no region.

Agent regions come first: the scheduling cycle's engine places a region-less job on agent nodes
where it can. A job it leaves waiting goes to a Slurm region when one can run it now
(``slurm_route``, at the end of the cycle): a Slurm region that maps one of the job's acceptable
models to a GRES type (within the tenant's per-model quota, as ``slurm_jobs.gres_type_for``
counts it), whose inventory has free GPUs of that model (GPU rows of its Slurm nodes of the plan's
partition in Slurm state idle or mixed that no open allocation holds) on a node that takes the job
(or, across nodes, a node shape that divides it), less the GPUs of the jobs already sent to it and
not yet running there. Of those, the region with the most free GPUs of the model wins (ties: the
oldest region). The job's ``region`` is then that region: the region's sync submits it to Slurm
(``scheduling.services.slurm``) and the cycle leaves it alone from then on.

An array job goes whole (one Slurm array), with the tasks the cycle made, when its waiting tasks
are left unplaced and none has run yet; not a work queue, nor one with ``max_retries``.

Only what a Slurm region runs is sent (``slurm_runs``, the rules ``submission._validate_slurm``
applies to a job naming the region): a job (not an instance, nor an array's task alone), of whole
GPUs, without volumes, checkpoints, a reservation, elasticity, secrets in its environment or
placement constraints (Slurm places). Quota and budget were checked when it was submitted and
admitted, as for every job; nothing here admits anything.

At submission, a region-less job that no agent node can hold is accepted when some Slurm region
could run it (``slurm_region_could_run``: the same rules, by node shape, not by what is free now).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from django.db.models import Exists, OuterRef, Sum

from nodes.models import Gpu, GpuModel, Node, NodeState, Region, RegionBackend
from nodes.slurm.config import SlurmConfig, slurm_config_parse
from portal.errors import ValidationFailed
from scheduling.models import MILLI, Allocation, Workload, WorkloadKind, WorkloadState, WorkloadVolume
from scheduling.services.slurm_jobs import gres_type_for, slurm_gang_shape

logger = logging.getLogger(__name__)
# Slurm node states whose free GPUs a job sent there can start on.
TAKING_STATES = ("idle", "mixed")


def slurm_runs(f: Mapping[str, Any]) -> bool:
    """Whether a Slurm region runs a job of these fields (a submission's validated fields, or a
    stored workload's, ``_fields_of``)."""
    return (
        f["kind"] == WorkloadKind.JOB
        # An array as one Slurm array: not a work queue, nor retried task by task.
        and (f["array_count"] is None or (f["work_lease_s"] is None and not f["max_retries"]))
        and not f.get("array_task")
        and f["gpu_fraction_milli"] >= MILLI
        and not f["mig_profile"]
        and not f["checkpoint_resume"]
        and f["elastic_min_gpus"] is None
        and not f["volumes"]
        and not f["reservation"]
        and not any(isinstance(v, dict) for v in (f["env"] or {}).values())
        and not any(f[k] for k in ("node_selector", "affinity", "anti_affinity", "spread"))
    )


def _fields_of(w: Workload) -> dict[str, Any]:
    return {
        "kind": w.kind,
        "array_count": w.array_count,
        "array_task": w.array_parent_id is not None,
        "work_lease_s": w.work_lease_s,
        "max_retries": w.max_retries,
        "gpu_fraction_milli": w.gpu_fraction_milli,
        "mig_profile": w.mig_profile,
        "checkpoint_resume": w.checkpoint_resume,
        "elastic_min_gpus": w.elastic_min_gpus,
        "volumes": WorkloadVolume.objects.filter(workload=w).exists(),
        "reservation": w.reservation_id is not None,
        "env": w.env,
        "node_selector": w.node_selector,
        "affinity": w.affinity,
        "anti_affinity": w.anti_affinity,
        "spread": w.spread,
    }


def _slurm_regions() -> list[tuple[Region, SlurmConfig]]:
    out = []
    for region in Region.objects.filter(backend=RegionBackend.SLURM).order_by("pk"):
        try:
            out.append((region, slurm_config_parse(region.slurm)))
        except ValidationFailed as exc:
            logger.error("Slurm region %s: configuration: %s", region.code, exc.message)
    return out


def _node_gpus(
    region: Region, model: GpuModel, partition: str, *, free: bool, gres_type: str = ""
) -> dict[int, int]:
    """GPUs of ``model`` per Slurm node of the region (of ``partition`` where named): all of them,
    or (``free``) those on nodes Slurm has idle or mixed that neither an open allocation of gpupool
    holds nor Slurm counts as used (``gres_type``'s count in the inventory's ``gres_used``: other
    users' jobs too)."""
    nodes = {
        n.pk: n
        for n in Node.objects.filter(region=region, state=NodeState.SLURM).only("pk", "labels")
        if not partition or partition in (n.labels or {}).get("partitions", [])
    }
    if free:
        nodes = {k: n for k, n in nodes.items() if (n.labels or {}).get("slurm_state") in TAKING_STATES}
    total: dict[int, int] = defaultdict(int)
    held: dict[int, int] = defaultdict(int)
    for node_id, busy in (
        Gpu.objects.filter(node_id__in=list(nodes), model=model, removed_at__isnull=True)
        .annotate(busy=Exists(Allocation.objects.filter(gpu_id=OuterRef("pk"), ended_at__isnull=True)))
        .values_list("node_id", "busy")
    ):
        total[node_id] += 1
        held[node_id] += int(busy)
    if not free:
        return dict(total)
    used = {k: int((n.labels or {}).get("slurm_gpus_used", {}).get(gres_type, 0)) for k, n in nodes.items()}
    return {k: max(0, n - max(held[k], used.get(k, 0))) for k, n in total.items()}


def _fits(f: Mapping[str, Any], per_node: dict[int, int], sizes: list[int]) -> bool:
    """Whether GPUs counted per node (``per_node``) take the job; ``sizes``: the region's node
    shapes of the model (a gang's or split job's per-node count must be one that divides it)."""
    if f["gang"] or f["gpus_per_node"]:
        shape = slurm_gang_shape(
            gpu_count=f["gpu_count"], gang=f["gang"], gpus_per_node=list(f["gpus_per_node"]), sizes=sizes
        )
        if shape is None:
            return False
        nodes, per = shape
        return sum(1 for n in per_node.values() if n >= per) >= nodes
    return any(n >= f["gpu_count"] for n in per_node.values())


def slurm_region_could_run(f: Mapping[str, Any], candidates: list[GpuModel]) -> Region | None:
    """A Slurm region that could run a region-less job of these fields (by its node shapes), for
    the submission check when no agent node can hold it; None if none."""
    if not slurm_runs(f):
        return None
    for region, config in _slurm_regions():
        for model in candidates:
            if not config.gres_types.get(model.name):
                continue
            total = _node_gpus(region, model, config.partition(f["plan"]), free=False)
            if _fits(f, total, sorted(total.values(), reverse=True)):
                return region
    return None


def _free_of_mapped(region: Region, config: SlurmConfig) -> int:
    """Free GPUs of the region's mapped models, on any of its nodes Slurm has idle or mixed."""
    return sum(
        sum(_node_gpus(region, m, "", free=True, gres_type=config.gres_types[m.name]).values())
        for m in GpuModel.objects.filter(name__in=list(config.gres_types))
    )


def _waiting_demand(region: Region) -> int:
    """GPUs of the region's jobs that wait to start in Slurm (queued in gpupool: sent, or
    submitted and pending there); they will take free GPUs first."""
    return (
        Workload.objects.filter(region=region, state=WorkloadState.QUEUED, array_parent__isnull=True)
        .aggregate(n=Sum("gpu_count"))
        .get("n")
        or 0
    )


def slurm_route(*, workloads: list[Workload]) -> list[int]:
    """Send each of these waiting region-less jobs (locked by the caller, in its transaction) to
    the Slurm region that can run it now with the most free GPUs of its model. Returns the ids
    sent; each gets its ``region`` and a pending reason ``slurm`` saying where it went."""
    waiting = [w for w in workloads if w.region_id is None and w.state == WorkloadState.QUEUED]
    if not waiting:
        return []
    # An array's waiting tasks stand for their array job: it is sent whole, if none has run yet.
    parents = sorted({w.array_parent_id for w in waiting if w.array_parent_id is not None})
    waiting = [w for w in waiting if w.array_parent_id is None]
    waiting += [
        p
        for p in Workload.objects.filter(pk__in=parents, region__isnull=True, stop_requested_at__isnull=True)
        if not Workload.objects.filter(array_parent=p)
        .exclude(state__in=[WorkloadState.PENDING, WorkloadState.QUEUED], attempt=0)
        .exists()
    ]
    regions = _slurm_regions()
    if not regions:
        return []
    demand = {region.pk: _waiting_demand(region) for region, _ in regions}
    # Free GPUs of any mapped model per region: once none is left anywhere, nothing more is sent
    # (the queue may be long; each job costs a few queries, so stop early).
    anywhere = {region.pk: _free_of_mapped(region, config) for region, config in regions}
    counted: dict[tuple[int, int, str, bool], dict[int, int]] = {}

    def gpus(
        region: Region, config: SlurmConfig, model: GpuModel, partition: str, free: bool
    ) -> dict[int, int]:
        key = (region.pk, model.pk, partition, free)
        if key not in counted:
            counted[key] = _node_gpus(
                region, model, partition, free=free, gres_type=config.gres_types[model.name]
            )
        return counted[key]

    sent = []
    for w in sorted(waiting, key=lambda w: (w.queued_at or w.submitted_at, w.pk)):
        if all(anywhere[pk] - demand[pk] <= 0 for pk in anywhere):
            break
        f = _fields_of(w)
        if not slurm_runs(f):
            continue
        f |= {"gang": w.gang, "gpus_per_node": w.gpus_per_node or [], "gpu_count": w.gpu_count}
        best: tuple[int, int, Region, GpuModel] | None = None
        for region, config in regions:
            model, _ = gres_type_for(w, config)
            if model is None:
                continue
            partition = config.partition(w.plan)
            free = gpus(region, config, model, partition, True)
            total = gpus(region, config, model, partition, False)
            room = sum(free.values()) - demand[region.pk]
            if room < w.gpu_count or not _fits(f, free, sorted(total.values(), reverse=True)):
                continue
            if best is None or room > best[0]:
                best = (room, region.pk, region, model)
        if best is None:
            continue
        room, _, region, model = best
        at_once = min(w.array_parallelism or w.array_count, w.array_count) if w.is_array else 1
        demand[region.pk] += w.gpu_count * at_once
        if w.is_array:
            # Its tasks made so far go with it (those made later copy its region).
            Workload.objects.filter(array_parent=w).update(
                region=region, other_regions_ok=False, pending_reason="slurm"
            )
        w.region = region
        w.other_regions_ok = False
        w.pending_reason = "slurm"
        w.pending_message = (f"Sent to Slurm region {region.code}: {room} free {model.name} GPU(s) there.")[
            :255
        ]
        w.save(update_fields=["region", "other_regions_ok", "pending_reason", "pending_message"])
        sent.append(w.pk)
    return sent
