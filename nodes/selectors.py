"""Reads of the fleet that other apps (scheduling, metering, the UI) share."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Prefetch, QuerySet

from nodes.models import (
    Gpu,
    GpuHealth,
    GpuMinuteRollup,
    GpuModel,
    Node,
    NodeCommand,
    NodeState,
    SoftwareStack,
)


def gpus_schedulable(*, region: str | None = None, model: GpuModel | None = None) -> QuerySet[Gpu]:
    """GPUs that may take new work: healthy, not isolated, present, on a READY node."""
    qs = Gpu.objects.filter(
        health=GpuHealth.HEALTHY, isolated=False, removed_at__isnull=True, node__state=NodeState.READY
    ).select_related("node", "model")
    if region:
        qs = qs.filter(node__region__code=region)
    if model is not None:
        qs = qs.filter(model=model)
    return qs


def nodes_schedulable(*, region: str | None = None) -> QuerySet[Node]:
    """READY nodes with their schedulable GPUs prefetched as ``node.schedulable_gpus``."""
    qs = Node.objects.filter(state=NodeState.READY).select_related("region")
    if region:
        qs = qs.filter(region__code=region)
    return qs.prefetch_related(
        Prefetch(
            "gpus",
            queryset=Gpu.objects.filter(
                health=GpuHealth.HEALTHY, isolated=False, removed_at__isnull=True
            ).select_related("model"),
            to_attr="schedulable_gpus",
        )
    )


@dataclass(frozen=True)
class GpuRow:
    id: int
    uuid: str
    index: int
    model_id: int | None
    model_name: str
    memory_mib: int
    nvlink_island: int | None
    numa_node: int | None
    mig_mode: bool
    schedulable: bool


@dataclass(frozen=True)
class NodeRow:
    id: int
    hostname: str
    region: str
    state: str
    interconnect: str
    labels: dict
    cpu_cores: int
    ram_mib: int
    last_heartbeat_at: datetime | None
    gpus: tuple[GpuRow, ...]


def fleet_inventory(*, include_unschedulable: bool = True) -> list[NodeRow]:
    """The whole fleet as plain data (three queries), for a scheduler snapshot."""
    nodes = Node.objects.select_related("region").order_by("id")
    if not include_unschedulable:
        nodes = nodes.filter(state=NodeState.READY)
    gpus: dict[int, list[GpuRow]] = {}
    for g in (
        Gpu.objects.filter(removed_at__isnull=True, node__in=nodes)
        .select_related("model")
        .order_by("node_id", "index")
    ):
        gpus.setdefault(g.node_id, []).append(
            GpuRow(
                id=g.id,
                uuid=g.uuid,
                index=g.index,
                model_id=g.model_id,
                model_name=g.model.name if g.model else g.reported_name,
                memory_mib=g.memory_mib,
                nvlink_island=g.nvlink_island,
                numa_node=g.numa_node,
                mig_mode=g.mig_mode,
                schedulable=g.schedulable,
            )
        )
    return [
        NodeRow(
            id=n.id,
            hostname=n.hostname,
            region=n.region.code,
            state=n.state,
            interconnect=n.interconnect,
            labels=n.labels,
            cpu_cores=n.cpu_cores,
            ram_mib=n.ram_mib,
            last_heartbeat_at=n.last_heartbeat_at,
            gpus=tuple(gpus.get(n.id, ())),
        )
        for n in nodes
    ]


def gpu_models_supporting(
    *, stack: str | None = None, min_cuda_cc: tuple[int, int] | None = None, gfx_target: str | None = None
) -> list[GpuModel]:
    """Catalog models that can run a request: e.g. ``stack="cuda", min_cuda_cc=(8, 0)`` for
    Ampere or newer, ``stack="rocm"``, or one ROCm ``gfx_target``."""
    models = list(GpuModel.objects.all())
    if stack:
        models = [m for m in models if m.software_stack == stack]
    if min_cuda_cc is not None:
        models = [
            m
            for m in models
            if m.software_stack == SoftwareStack.CUDA and m.cuda_cc_tuple and m.cuda_cc_tuple >= min_cuda_cc
        ]
    if gfx_target:
        models = [m for m in models if m.gfx_target == gfx_target]
    return models


def gpu_rollups_between(*, gpu_ids: list[int], start: datetime, end: datetime) -> QuerySet[GpuMinuteRollup]:
    """Minute rollups of these GPUs in ``[start, end)``: what metering joins allocation intervals with."""
    return GpuMinuteRollup.objects.filter(gpu_id__in=gpu_ids, minute__gte=start, minute__lt=end).order_by(
        "gpu_id", "minute"
    )


def node_commands_history(*, node: Node, limit: int = 100) -> QuerySet[NodeCommand]:
    return NodeCommand.objects.filter(node=node).prefetch_related("events").order_by("-created_at")[:limit]
