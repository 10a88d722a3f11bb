"""A small fleet on the seeded catalog, and helpers to submit, schedule and report."""

from __future__ import annotations

import itertools
import uuid

import pytest
from django.utils import timezone

from nodes.models import Gpu, GpuModel, Node, NodeState, Region
from portal.actors import Actor
from scheduling.models import Volume, Workload
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.submission import workload_submit
from tests.slurm_cluster import slurm_cluster, slurm_rest  # noqa: F401  (the real Slurm, for the Slurm region)

H100 = "NVIDIA H100 SXM 80GB"
A100 = "NVIDIA A100 SXM 80GB"

_seq = itertools.count(1)


@pytest.fixture(autouse=True)
def _no_cycle_tasks(settings):
    """Services ask for cycles on commit; here tests run the cycle themselves (the Celery tests
    turn this back on)."""
    settings.SCHEDULING_TRIGGER_CYCLES = False


@pytest.fixture
def regions(db):
    us, _ = Region.objects.get_or_create(code="us-east-1", defaults={"name": "US East"})
    eu, _ = Region.objects.get_or_create(code="eu-west-1", defaults={"name": "EU West"})
    return {"us": us, "eu": eu}


@pytest.fixture
def make_node(regions):
    def make(
        model: str = H100,
        gpus: int = 8,
        region: str = "us",
        cpu_cores: int = 96,
        ram_mib: int = 1024 * 1024,
        state: str = NodeState.READY,
        islands: int = 1,
    ) -> Node:
        n = next(_seq)
        node = Node.objects.create(
            hostname=f"gpu-{n:04d}",
            region=regions[region],
            cpu_cores=cpu_cores,
            ram_mib=ram_mib,
            state=state,
            last_heartbeat_at=timezone.now(),
        )
        gm = GpuModel.objects.get(name=model)
        per_island = max(gpus // islands, 1)
        Gpu.objects.bulk_create(
            Gpu(
                node=node,
                index=i,
                uuid=f"GPU-{uuid.uuid4()}",
                model=gm,
                reported_name=gm.name,
                memory_mib=gm.memory_gib * 1024,
                nvlink_island=i // per_island,
            )
            for i in range(gpus)
        )
        return node

    return make


@pytest.fixture
def submit(regions):
    def do(tenant, kind: str = "job", **spec) -> Workload:
        if spec.get("checkpoint_resume") and "volumes" not in spec:
            # Checkpoints need a volume: one of the tenant's own in the default region.
            volume = Volume.objects.create(
                tenant=tenant, name=f"ckpt-{next(_seq)}", region=regions["us"], size_gib=10
            )
            spec["volumes"] = [{"volume": volume.pk, "mount_path": "/ckpt"}]
        if kind == "job":
            spec.setdefault("image", "ghcr.io/acme/train:1")
            spec.setdefault("command", ["python", "train.py"])
        else:
            spec.setdefault("image", "ghcr.io/acme/notebook:1")
        spec.setdefault("gpu_models", [H100])
        return workload_submit(tenant=tenant, kind=kind, spec=spec, actor=Actor.system())

    return do


@pytest.fixture
def cycle():
    def run(**kwargs):
        result = scheduling_cycle_run(**kwargs)
        assert result.ran
        return result

    return run


def reload(w: Workload) -> Workload:
    return Workload.objects.get(pk=w.pk)


def start_command(w: Workload, node: Node):
    """The start command the node was sent for the workload's current attempt."""
    from nodes.models import CommandKind, NodeCommand

    return NodeCommand.objects.get(
        node=node,
        kind=CommandKind.START_WORKLOAD,
        payload__workload_id=str(w.pk),
        payload__attempt=reload(w).attempt,
    )


def report_start(w: Workload, node: Node, state: str = "succeeded", result: dict | None = None):
    """The agent's answer to that start command (by default: it runs), through the real signal."""
    from nodes.models import NodeCommand
    from nodes.signals import command_finished

    cmd = start_command(w, node)
    command_finished.send(sender=NodeCommand, command=cmd, state=state, result=result or {"state": "running"})
    return cmd
