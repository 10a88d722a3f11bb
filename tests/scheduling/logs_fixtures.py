"""A registered node (a real credential) running a job placed by a real scheduling cycle, for the
workload log tests."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from django.test import Client
from django.utils import timezone

from nodes.models import Node, NodeState, Region
from nodes.services.registration import GpuInfo, NodeInfo, bootstrap_token_create, node_register
from portal.actors import Actor
from scheduling.models import Allocation, Workload

H100 = "NVIDIA H100 SXM 80GB"
_hosts = itertools.count(1)


@dataclass
class PlacedNode:
    node: Node
    credential: str
    client: Client

    def url(self, node_id: int | None = None) -> str:
        return f"/agent/v1/nodes/{node_id or self.node.pk}/logs"

    def send(
        self, body, *, raw: bytes | None = None, node_id: int | None = None, client: Client | None = None
    ):
        return (client or self.client).post(
            self.url(node_id),
            data=raw if raw is not None else json.dumps(body),
            content_type="application/json",
        )


def register_node(gpus: int = 1) -> PlacedNode:
    region, _ = Region.objects.get_or_create(code="us-east-1", defaults={"name": "US East"})
    token = bootstrap_token_create(region=region, actor=Actor.system())[1]
    host = f"logs-{next(_hosts):03d}"
    node, credential = node_register(
        bootstrap_token=token,
        info=NodeInfo(
            hostname=host,
            cpu_cores=64,
            ram_mib=512 * 1024,
            gpus=tuple(
                GpuInfo(index=i, uuid=f"GPU-{host}-{i}", name=H100, memory_mib=81920) for i in range(gpus)
            ),
        ),
    )
    Node.objects.filter(pk=node.pk).update(state=NodeState.READY, last_heartbeat_at=timezone.now())
    node.refresh_from_db()
    return PlacedNode(node, credential, Client(HTTP_AUTHORIZATION=f"Node {credential}"))


def batch(seq: int, workload: Workload | str, lines, **extra) -> dict:
    wid = workload if isinstance(workload, str) else str(workload.pk)
    return {"seq": seq, "workloads": [{"workload_id": wid, "lines": lines}], **extra}


def place_job(tenant, submit, cycle) -> tuple[PlacedNode, Workload]:
    """``(node, job)``: the job holds an allocation on the node."""
    node = register_node()
    job = submit(tenant, gpu_models=[H100])
    cycle()
    assert Allocation.objects.filter(workload=job, node=node.node).exists()
    return node, job
