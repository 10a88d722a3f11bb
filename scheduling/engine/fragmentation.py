"""GPU fragmentation of a node relative to a workload distribution (Weng et al., USENIX ATC 2023).

The fragmentation of a node for one task type is the free GPU capacity that the task type cannot use:
all of it when the task cannot run on the node at all (wrong model, too little CPU or RAM, not enough
free GPUs), otherwise the free capacity of the GPUs whose free share is below what the task needs per
GPU. The fragmentation of a node for a workload is the expectation over the workload's task types.

gpupool's policy measures it differently in one respect (see ``policies.GpupoolPolicy``): only over the
task types that could ever run on the node's hardware, each weighted by how scarce that hardware is
for it (``host_weights``).
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
            # Work split over nodes that no node can take whole: what it needs is a node with its
            # smallest piece free, once per piece.
            gpus = d.per_node[-1] if d.per_node and d.gpus > 8 else d.gpus
            if gpus != d.gpus and not gpu_weighted:
                w = d.gpus // gpus
            counts[(d.models, d.milli, gpus, d.cpu, d.mem)] += w
        total = sum(counts.values())
        if not total:
            return cls(())
        types = tuple((*k, n / total) for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        return cls(types, cpu / gpu if gpu else 0.0, mem / gpu if gpu else 0.0)

    def __len__(self) -> int:
        return len(self.types)


def unusable(
    types: Iterable[TaskType], cpu_free: int, mem_free: int, frees: list[int], use_mem: bool
) -> float:
    """Sum over ``types`` of weight x the free GPU milli (of ``frees``, non-empty) the type cannot
    use on a node with this much free CPU and RAM. The model is not checked here."""
    total = sum(frees)
    nfull = frees.count(MILLI)
    top = max(frees)
    below: dict[int, int] = {}
    out = 0.0
    for _models, d, k, c, m, w in types:
        if c > cpu_free or (use_mem and m > mem_free):
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
    return out


def stranded(dist: Distribution, cpu_free: int, mem_free: int, total: int, use_mem: bool) -> float:
    """Look-ahead: of ``total`` free GPU milli, what the node's free CPU (and RAM) cannot feed at the
    workload's own CPU-per-GPU ratio, which will be stranded once the node fills whatever arrives."""
    if dist.cpu_per_milli <= 0 or total <= 0:
        return 0.0
    s = total - cpu_free / dist.cpu_per_milli
    if use_mem and dist.mem_per_milli > 0:
        s = max(s, total - mem_free / dist.mem_per_milli)
    return s if s > 0 else 0.0


def node_fragmentation(
    dist: Distribution,
    model: str,
    cpu_free: int,
    mem_free: int,
    gkey: tuple[tuple[int, ...], ...],
    use_mem: bool,
    balance: float = 0.0,
) -> float:
    """FGD's measure: a task type that does not accept the node's model finds all of its free GPU
    unusable; for the others, what ``unusable`` says. ``balance`` adds that much of ``stranded``."""
    frees = [f for island in gkey for f in island]
    total = sum(frees)
    if not total:
        return 0.0
    out = unusable((t for t in dist.types if model in t[0]), cpu_free, mem_free, frees, use_mem)
    out += total * sum(t[5] for t in dist.types if model not in t[0])
    if balance:
        out += balance * stranded(dist, cpu_free, mem_free, total, use_mem)
    return out


def can_host(t: TaskType, model: str, gpus: int, cpu: int, mem: int, use_mem: bool = True) -> bool:
    """Whether a task of type ``t`` fits an empty server of this model and size at all."""
    return model in t[0] and t[2] <= gpus and t[3] <= cpu and (not use_mem or t[4] <= mem)


def host_weights(
    dist: Distribution, servers: Iterable[tuple[str, int, int, int, int]], use_mem: bool = True
) -> tuple[TaskType, ...]:
    """The task types re-weighted by scarcity: each weight times (all GPUs / GPUs on the servers
    that could ever host the type), so that work only few servers can run counts for more where it
    can run. ``servers``: (model, GPUs, CPU milli, RAM MiB, how many such servers). Types no server
    can host are dropped."""
    servers = list(servers)
    everything = sum(g * n for _m, g, _c, _r, n in servers)
    out = []
    for t in dist.types:
        hosts = sum(g * n for model, g, c, r, n in servers if can_host(t, model, g, c, r, use_mem))
        if hosts:
            out.append((*t[:5], t[5] * everything / hosts))
    return tuple(out)
