"""GPU fragmentation of a node relative to a workload distribution (Weng et al., USENIX ATC 2023).

The fragmentation of a node for one task type is the free GPU capacity that the task type cannot use:
all of it when the task cannot run on the node at all (wrong model, too little CPU or RAM, not enough
free GPUs), otherwise the free capacity of the GPUs whose free share is below what the task needs per
GPU. The fragmentation of a node for a workload is the expectation over the workload's task types.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .spec import Demand
from .types import MILLI

TaskType = tuple[frozenset[str], int, int, int, int, float]
"""(allowed models, milli per GPU, GPUs, CPU milli, RAM MiB, weight)."""


@dataclass(frozen=True, slots=True)
class Distribution:
    """Task types with their weights (summing to 1). CPU-only types are left out: every placement
    changes their term by the same amount, so they never change a decision."""

    types: tuple[TaskType, ...]
    cpu_per_milli: float = 0.0
    """CPU milli the whole workload (CPU-only tasks included) asks for per GPU milli."""
    mem_per_milli: float = 0.0
    """RAM MiB the whole workload asks for per GPU milli."""

    @classmethod
    def from_demands(cls, demands: Iterable[Demand], *, gpu_weighted: bool = False) -> Distribution:
        counts: Counter[tuple[frozenset[str], int, int, int, int]] = Counter()
        cpu = mem = gpu = 0
        for d in demands:
            cpu += d.cpu
            mem += d.mem
            gpu += d.gpus * d.milli
            if d.gpus == 0 or d.gang:
                continue
            w = d.gpus * d.milli if gpu_weighted else 1
            counts[(d.models, d.milli, d.gpus, d.cpu, d.mem)] += w
        total = sum(counts.values())
        if not total:
            return cls(())
        types = tuple((*k, n / total) for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        return cls(types, cpu / gpu if gpu else 0.0, mem / gpu if gpu else 0.0)

    def __len__(self) -> int:
        return len(self.types)


def node_fragmentation(
    dist: Distribution,
    model: str,
    cpu_free: int,
    mem_free: int,
    gkey: tuple[tuple[int, ...], ...],
    use_mem: bool,
    balance: float = 0.0,
) -> float:
    frees = [f for island in gkey for f in island]
    total = sum(frees)
    if not total:
        return 0.0
    nfull = frees.count(MILLI)
    top = max(frees)
    below: dict[int, int] = {}
    out = 0.0
    for models, d, k, c, m, w in dist.types:
        if c > cpu_free or (use_mem and m > mem_free) or model not in models:
            out += w * total
        elif d < MILLI:
            if top < d:
                out += w * total
            else:
                s = below.get(d)
                if s is None:
                    s = below[d] = sum(f for f in frees if f < d)
                out += w * s
        elif nfull < k:
            out += w * total
        else:
            out += w * (total - MILLI * nfull)
    if balance and dist.cpu_per_milli > 0:
        # Look-ahead: GPU capacity the node's CPU (and RAM) cannot feed at the workload's own
        # CPU-per-GPU ratio will be stranded once the node fills, whatever arrives next.
        stranded = total - cpu_free / dist.cpu_per_milli
        if use_mem and dist.mem_per_milli > 0:
            stranded = max(stranded, total - mem_free / dist.mem_per_milli)
        if stranded > 0:
            out += balance * stranded
    return out
