"""The ATC'23 inflation protocol: pods arrive one at a time, never leave, and are placed or fail.

The arrival sequence is the trace shuffled by the seed, extended by drawing pods at random (with
replacement) until the GPU requested reaches ``tune`` times the cluster's GPU capacity, or cut where
the trace already asks for more. After each arrival, requested % is the cumulative GPU requested by
all arrivals so far (failed ones too) over capacity and allocated % the GPU held by placed pods over
capacity; the allocation ratio at x % is the mean of allocated % over the arrivals whose requested %
rounds to x (half up: x - 0.5 <= requested % < x + 0.5).
"""

from __future__ import annotations

import csv
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduling.engine.fragmentation import Distribution
from scheduling.engine.policies import get_policy
from scheduling.engine.state import ClusterState
from scheduling.engine.types import GpuModelInfo, Node

from .trace import TraceError, TracePod

REPORT_POINTS = (50, 100, 130)


def arrival_sequence(pods: Sequence[TracePod], capacity_milli: int, tune: float, seed: int) -> list[TracePod]:
    rng = random.Random(seed)
    order = list(pods)
    rng.shuffle(order)
    target = tune * capacity_milli
    out: list[TracePod] = []
    requested = 0
    for pod in order:
        if requested >= target:
            break
        out.append(pod)
        requested += pod.gpu_request_milli
    if requested < target and any(p.gpu_request_milli for p in pods):
        while requested < target:
            pod = rng.choice(pods)
            out.append(pod)
            requested += pod.gpu_request_milli
    return out


def arrivals_from_file(path: str, pods: Sequence[TracePod]) -> list[TracePod]:
    by_name = {p.name: p for p in pods}
    out = []
    with open(path) as fh:
        for n, line in enumerate(fh, start=1):
            name = line.strip()
            if not name:
                continue
            if name not in by_name:
                raise TraceError(f"{path}:{n}: unknown pod {name!r}")
            out.append(by_name[name])
    return out


def rounds_to(requested_milli: int, capacity_milli: int, x: int) -> bool:
    """Whether 100 * requested / capacity rounds (half up) to ``x``, in exact integer arithmetic."""
    v = 200 * requested_milli
    return (2 * x - 1) * capacity_milli <= v < (2 * x + 1) * capacity_milli


@dataclass
class InflationResult:
    policy: str
    capacity_gpu_milli: int
    allocation_ratio: dict[str, float | None]
    failed: int
    arrivals: int
    decisions_per_s: float
    rows: list[tuple[int, str, str, int, int, int]] = field(default_factory=list, repr=False)

    def as_json(self) -> dict:
        return {
            "policy": self.policy,
            "capacity_gpu_milli": self.capacity_gpu_milli,
            "allocation_ratio": self.allocation_ratio,
            "failed": self.failed,
            "arrivals": self.arrivals,
            "decisions_per_s": round(self.decisions_per_s, 1),
        }


def run_inflation(
    nodes: Sequence[Node],
    catalog: dict[str, GpuModelInfo],
    pods: Sequence[TracePod],
    *,
    policy: str = "gpupool",
    seed: int = 42,
    tune: float = 1.3,
    arrivals: Sequence[TracePod] | None = None,
    keep_rows: bool = False,
) -> InflationResult:
    pol = get_policy(policy)
    state = ClusterState(nodes, catalog, pol, seed=seed)
    capacity = state.capacity_milli
    if capacity <= 0:
        raise TraceError("the node list has no GPU capacity")
    models = frozenset(catalog)
    demands: dict[str, object] = {}

    def demand_of(pod: TracePod):
        d = demands.get(pod.name)
        if d is None:
            d = demands[pod.name] = pod.demand(models)
        return d

    # The workload the fragmentation measure is taken against: the trace's task mix.
    pol.set_distribution(Distribution.from_demands(demand_of(p) for p in pods))
    seq = list(arrivals) if arrivals is not None else arrival_sequence(pods, capacity, tune, seed)

    sums = dict.fromkeys(REPORT_POINTS, 0.0)
    counts = dict.fromkeys(REPORT_POINTS, 0)
    lows = {x: (2 * x - 1) * capacity for x in REPORT_POINTS}
    highs = {x: (2 * x + 1) * capacity for x in REPORT_POINTS}
    requested = allocated = failed = 0
    rows = []
    ids = state.ids
    engine_s = 0.0
    clock = time.perf_counter
    for n, pod in enumerate(seq, start=1):
        d = demand_of(pod)
        t0 = clock()
        slots = state.place(d)
        if slots is None and d.per_node:
            slots = state.place_split(d)
        engine_s += clock() - t0
        req = pod.gpu_request_milli
        requested += req
        if slots is None:
            failed += 1
        else:
            allocated += req
        v = 200 * requested
        for x in REPORT_POINTS:
            if lows[x] <= v < highs[x]:
                sums[x] += 100.0 * allocated / capacity
                counts[x] += 1
        if keep_rows:
            if slots is None:
                rows.append((n, pod.name, "", 0, requested, allocated))
            else:
                s = slots[0]
                rows.append((n, pod.name, ids[s.node], len(s.positions), requested, allocated))
    ratio = {str(x): (sums[x] / counts[x] if counts[x] else None) for x in REPORT_POINTS}
    return InflationResult(
        policy=pol.name,
        capacity_gpu_milli=capacity,
        allocation_ratio=ratio,
        failed=failed,
        arrivals=len(seq),
        decisions_per_s=len(seq) / engine_s if engine_s > 0 else 0.0,
        rows=rows,
    )


def write_log(path: str, result: InflationResult) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["seq", "pod", "node", "gpus", "requested_gpu_milli", "allocated_gpu_milli"])
        w.writerows(result.rows)
