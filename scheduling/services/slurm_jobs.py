"""What a workload of a Slurm region becomes in Slurm: its ``sbatch`` options and batch script
(``sbatch_request``), the GRES type of the model it gets (``gres_type_for``: the first acceptable
model the region maps that is within the tenant's per-model quota), and the node shape of work
across nodes (``job_shape``: a gang's whole nodes, or ``gpus_per_node``). The sync that submits
and follows them is ``scheduling.services.slurm``.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from django.db.models import Sum

from nodes.models import Gpu, GpuModel, Node, NodeState, Region
from nodes.slurm.cli import JOB_NAME_PREFIX
from nodes.slurm.config import SlurmConfig
from scheduling.models import (
    MILLI,
    TERMINAL_STATES,
    Allocation,
    DependencyCondition,
    QuotaModelLimit,
    Workload,
    WorkloadDependency,
)


def gres_type_for(w: Workload, config: SlurmConfig) -> tuple[GpuModel | None, str]:
    """The first acceptable model the region maps to a GRES type and that is within the tenant's
    per-model quota, and that type ('' if none). The quota is counted as the cycle counts it for
    agent regions (the tenant's open allocations of the model plus this request)."""
    mapped = mapped_candidates(w, config)
    room = _models_with_room(w, mapped)
    for m in mapped:
        if m.pk in room:
            return m, config.gres_types[m.name]
    return None, ""


def mapped_candidates(w: Workload, config: SlurmConfig) -> list[GpuModel]:
    from scheduling.services.submission import candidate_models

    return [m for m in candidate_models(workload=w) if config.gres_types.get(m.name)]


def _models_with_room(w: Workload, models: list[GpuModel]) -> set[int]:
    limits = dict(
        QuotaModelLimit.objects.filter(quota__tenant_id=w.tenant_id, gpu_model__in=models).values_list(
            "gpu_model_id", "max_gpus"
        )
    )
    if not limits:
        return {m.pk for m in models}
    used = dict(
        Allocation.objects.filter(tenant_id=w.tenant_id, ended_at__isnull=True, gpu_model_id__in=list(limits))
        .values("gpu_model_id")
        .annotate(milli=Sum("fraction_milli"))
        .values_list("gpu_model_id", "milli")
    )
    need = w.gpu_count * w.gpu_fraction_milli
    return {m.pk for m in models if m.pk not in limits or used.get(m.pk, 0) + need <= limits[m.pk] * MILLI}


def slurm_node_sizes(*, region: Region, model: GpuModel | None, partition: str) -> list[int]:
    """GPUs of ``model`` per node of the region's inventory (nodes of ``partition`` where it is
    named), one size per node, largest first: the shapes a gang's nodes can take."""
    if model is None:
        return []
    sizes: dict[int, int] = {}
    nodes = {
        n.pk: n
        for n in Node.objects.filter(region=region, state=NodeState.SLURM).only("pk", "labels")
        if not partition or partition in (n.labels or {}).get("partitions", [])
    }
    for node_id in Gpu.objects.filter(
        node_id__in=list(nodes), model=model, removed_at__isnull=True
    ).values_list("node_id", flat=True):
        sizes[node_id] = sizes.get(node_id, 0) + 1
    return sorted(sizes.values(), reverse=True)


def slurm_gang_shape(
    *, gpu_count: int, gang: bool, gpus_per_node: list[int], sizes: list[int]
) -> tuple[int, int] | None:
    """(nodes, GPUs per node) of work across nodes in a Slurm region, or None when no node shape
    of ``sizes`` fits: a gang takes whole nodes (the largest node size dividing its count), split
    work the largest of its ``gpus_per_node`` that divides its count and fits a node. A count that
    fits one node with the same per-node size is one node."""
    if gang:
        per = next((k for k in sizes if gpu_count % k == 0), None)
    else:
        biggest = max(sizes, default=0)
        per = next(
            (k for k in sorted(gpus_per_node, reverse=True) if gpu_count % k == 0 and k <= biggest), None
        )
    if per is None:
        return None
    return gpu_count // per, per


def _platform_env(w: Workload) -> dict[str, str]:
    # An array task's own id is chosen in the script, from the ids reserved for its tasks.
    env = {} if w.is_array else {"GPUPOOL_WORKLOAD_ID": str(w.pk)}
    if w.image:
        env["GPUPOOL_IMAGE"] = w.image
    if w.is_array:
        env["GPUPOOL_ARRAY_COUNT"] = str(w.array_count)
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


# The rendezvous of a gang's members as every member reads it (``scheduling.services.gangs``):
# the nodes by Slurm's node list, rank 0's first, and each member's rank from srun (one task per
# node, so SLURM_NODEID is the node's rank).
GANG_SCRIPT = """\
GPUPOOL_PEERS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)
export GPUPOOL_PEERS
export MASTER_ADDR="${GPUPOOL_PEERS%%,*}"
export NNODES="$SLURM_JOB_NUM_NODES"
exec srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL \\
  /bin/sh -c 'export NODE_RANK="$SLURM_NODEID"; exec "$@"' gpupool-member """


def sbatch_request(
    w: Workload, config: SlurmConfig, account: str, *, shape: tuple[int, int] | None = None, port: int = 0
) -> tuple[list[str], str, str]:
    """(sbatch options, batch script, output path pattern) of a workload: a job, an array job (a
    Slurm array), or work across nodes (``shape``: nodes and GPUs per node; ``port``: its
    rendezvous port). Every value is one argv element or shell-quoted in the script: names were
    checked by the workload rules and the region's configuration, text values are quoted whatever
    they hold."""
    _model, gres_type = gres_type_for(w, config)
    nodes, per_node = shape or (1, w.gpu_count)
    gres = f"gpu:{gres_type}:{per_node}" if gres_type else f"gpu:{per_node}"
    name = f"{JOB_NAME_PREFIX}{w.pk}"
    output = str(Path(config.output_dir) / (f"{name}-%A_%a.out" if w.is_array else f"{name}-%j.out"))
    options = [
        f"--job-name={name}",
        f"--comment=gpupool workload {w.pk}",
        f"--account={account}",
        f"--gres={gres}",
        f"--nodes={nodes}",
        f"--cpus-per-task={max(1, math.ceil(w.cpu_millicores / 1000))}",
        f"--output={output}",
        f"--chdir={config.output_dir}",
        "--export=NONE",
        # Slurm does not requeue it itself (on a node failure): gpupool does, by the job's policy.
        "--no-requeue",
    ]
    options.append("--ntasks-per-node=1" if shape else "--ntasks=1")
    if w.is_array:
        options.append(f"--array=0-{int(w.array_count) - 1}%{int(w.array_parallelism or w.array_count)}")
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
    if shape:
        env |= {
            "WORLD_SIZE": str(nodes * per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "MASTER_PORT": str(port),
        }
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    if w.is_array:
        # Each task's own workload id (``Workload.array_task_ids``, reserved before submission).
        ids = [int(i) for i in w.array_task_ids or []]
        if len(ids) != w.array_count:
            raise ValueError(f"array job {w.pk} has no task ids reserved")
        lines.append(f"GPUPOOL_TASK_IDS=({' '.join(map(str, ids))})")
        lines.append('export GPUPOOL_WORKLOAD_ID="${GPUPOOL_TASK_IDS[$SLURM_ARRAY_TASK_ID]}"')
        lines.append('export GPUPOOL_ARRAY_INDEX="$SLURM_ARRAY_TASK_ID"')
    command = shlex.join(str(a) for a in w.command)
    lines.append(GANG_SCRIPT + command if shape else "exec " + command)
    return options, "\n".join(lines) + "\n", output


def job_shape(region: Region, w: Workload, config: SlurmConfig) -> tuple[int, int] | None:
    """Nodes and GPUs per node of work across nodes (None: one node)."""
    if not (w.gang or w.gpus_per_node):
        return None
    model, _ = gres_type_for(w, config)
    sizes = slurm_node_sizes(region=region, model=model, partition=config.partition(w.plan))
    return slurm_gang_shape(
        gpu_count=w.gpu_count, gang=w.gang, gpus_per_node=list(w.gpus_per_node), sizes=sizes
    )
