"""Small builders for engine snapshots (plain data, no database)."""

from __future__ import annotations

from scheduling.engine.types import Gpu, GpuModelInfo, Node, NodeState, Snapshot, Vendor

CATALOG = {
    "H100": GpuModelInfo("H100", Vendor.NVIDIA, 81920, 4.0, (9, 0)),
    "A100": GpuModelInfo("A100", Vendor.NVIDIA, 40960, 2.5, (8, 0)),
    "T4": GpuModelInfo("T4", Vendor.NVIDIA, 16384, 0.5, (7, 5)),
    "MI250": GpuModelInfo("MI250", Vendor.AMD, 65536, 3.0, None, "gfx90a"),
    "MI300": GpuModelInfo("MI300", Vendor.AMD, 196608, 5.0, None, "gfx942"),
}


def node(
    id: str,
    model: str = "A100",
    gpus: int = 8,
    *,
    cpu: int = 128_000,
    mem: int = 1_048_576,
    region: str = "eu",
    islands: int = 1,
    state: NodeState = NodeState.READY,
    unhealthy: tuple[int, ...] = (),
    free: dict[int, int] | None = None,
    cpu_used: int = 0,
    mem_used: int = 0,
    reserved_for: str | None = None,
) -> Node:
    per = max(1, gpus // islands)
    return Node(
        id=id,
        model=model,
        gpus=[
            Gpu(index=g, healthy=g not in unhealthy, island=g // per, free_milli=(free or {}).get(g, 1000))
            for g in range(gpus)
        ],
        cpu_milli=cpu,
        memory_mib=mem,
        cpu_used=cpu_used,
        memory_used=mem_used,
        region=region,
        state=state,
        reserved_for=reserved_for,
    )


def snapshot(*nodes: Node, running=(), now: float = 0.0, weights=None) -> Snapshot:
    return Snapshot(list(nodes), dict(CATALOG), list(running), dict(weights or {}), now)
