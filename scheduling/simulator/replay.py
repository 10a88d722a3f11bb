"""Time-ordered replay of a trace through the live engine.

Pods arrive at ``creation_time`` and run for ``deletion_time - creation_time`` from the moment they
start (pods without a deletion time never leave). A pod that cannot start waits in the queue and is
retried in every scheduling cycle under the live queueing policy (fair share, FCFS, backfill with the
trace duration as the runtime estimate). ``BE`` pods are spot work, the rest on-demand; each QoS
class is a tenant for fair share. Reports queueing delay, GPU utilisation and fragmentation over time.

Elastic pods (``elastic``: pod name -> (min GPUs, max GPUs)) run as the live cycle runs elastic jobs:
the engine grows them into idle GPUs of their node and shrinks them toward their minimum before
preempting (``Resize`` decisions); their duration stays the trace's. ``groups`` (pod name -> label,
e.g. "array", "split", "elastic") adds per-label placement and queueing delay to the result.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scheduling.engine.cycle import CycleConfig, Engine
from scheduling.engine.fragmentation import Distribution
from scheduling.engine.queueing import QueueConfig, QueuePolicy
from scheduling.engine.types import (
    MILLI,
    Assignment,
    GpuModelInfo,
    GpuSpec,
    Node,
    Place,
    Plan,
    Request,
    Resize,
    Running,
)

from .trace import TracePod


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an ascending sequence."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, int(-(-q * len(sorted_values) // 100)) - 1))
    return float(sorted_values[k])


@dataclass
class ReplayResult:
    policy: str
    capacity_gpu_milli: int
    pods: int
    placed: int
    never_placed: int
    delay: dict[str, float]
    utilisation_mean: float
    utilisation_peak: float
    fragmentation_mean: float
    cycles: int
    decisions_per_s: float
    series: list[tuple[float, float, float, int]] = field(default_factory=list, repr=False)
    """(time, GPU utilisation %, fragmentation % of capacity, queue length)."""
    groups: dict[str, dict] = field(default_factory=dict)
    """Per label of ``groups``: pods, placed, allocation rate % and queueing delay (mean, p50, p95)."""
    resizes: int = 0
    """Resize decisions applied (elastic pods grown or shrunk)."""

    def as_json(self) -> dict:
        return {
            "policy": self.policy,
            "capacity_gpu_milli": self.capacity_gpu_milli,
            "pods": self.pods,
            "placed": self.placed,
            "never_placed": self.never_placed,
            "queueing_delay_s": self.delay,
            "utilisation_mean": round(self.utilisation_mean, 3),
            "utilisation_peak": round(self.utilisation_peak, 3),
            "fragmentation_mean": round(self.fragmentation_mean, 3),
            "groups": self.groups,
            "resizes": self.resizes,
            "cycles": self.cycles,
            "decisions_per_s": round(self.decisions_per_s, 1),
        }


def _request(pod: TracePod, models: tuple[str, ...]) -> Request:
    duration = None if pod.deletion_time is None else max(0, pod.deletion_time - pod.creation_time)
    return Request(
        id=pod.name,
        tenant=pod.qos or "default",
        gpu=GpuSpec(models=tuple(m for m in pod.gpu_spec if m in models) if pod.gpu_spec else ()),
        gpus=pod.num_gpu,
        milli=pod.gpu_milli if pod.num_gpu == 1 else MILLI,
        cpu_milli=pod.cpu_milli,
        memory_mib=pod.memory_mib,
        gpus_per_node=pod.gpus_per_node,
        plan=Plan.SPOT if pod.qos == "BE" else Plan.ON_DEMAND,
        submit_time=float(pod.creation_time),
        est_runtime=None if duration is None else float(duration),
    )


def run_replay(
    nodes: Sequence[Node],
    catalog: dict[str, GpuModelInfo],
    pods: Sequence[TracePod],
    *,
    policy: str = "gpupool",
    seed: int = 42,
    samples: int = 400,
    queue_policy: str | None = None,
    elastic: Mapping[str, tuple[int, int]] | None = None,
    groups: Mapping[str, str] | None = None,
    elastic_moves: bool = True,
) -> ReplayResult:
    """``queue_policy``: a ``QueuePolicy`` value, ordering the queue as a region with that policy
    does in the live cycle (None: the default order)."""
    import time

    engine = Engine(
        nodes,
        catalog,
        CycleConfig(
            policy=policy,
            preemption=False,
            seed=seed,
            queue=QueueConfig(policy=QueuePolicy(queue_policy) if queue_policy else None),
            elastic=elastic_moves,
        ),
    )
    elastic = elastic or {}
    groups = groups or {}
    group_delays: dict[str, list[float]] = {}
    resizes = 0
    models = tuple(catalog)
    reqs = {p.name: _request(p, models) for p in pods}
    dist = Distribution.from_demands(engine.demand(r) for r in reqs.values())
    engine.set_workload(dist)
    capacity = engine.state.capacity_milli
    by_name = {p.name: p for p in pods}

    arrivals = sorted(pods, key=lambda p: (p.creation_time, p.name))
    ends: list[tuple[float, str]] = []
    running: dict[str, Running] = {}
    assignments: dict[str, tuple] = {}
    queue: dict[str, Request] = {}
    delays: list[float] = []
    series: list[tuple[float, float, float, int]] = []
    allocated = 0
    cycles = 0
    decisions = 0
    engine_s = 0.0
    t_first = float(arrivals[0].creation_time) if arrivals else 0.0
    t_last = float(max((p.deletion_time or p.creation_time) for p in pods)) if pods else 0.0
    sample_every = max(1.0, (t_last - t_first) / max(1, samples))
    next_sample = t_first
    util_area = frag_area = 0.0
    util_peak = 0.0
    last_t = t_first
    last_util = last_frag = 0.0
    ai = 0
    inf = float("inf")
    while ai < len(arrivals) or ends or queue:
        t_arr = float(arrivals[ai].creation_time) if ai < len(arrivals) else inf
        t_end = ends[0][0] if ends else inf
        now = min(t_arr, t_end)
        if now == inf:
            break  # only pods that can never start are left
        util_area += last_util * (now - last_t)
        frag_area += last_frag * (now - last_t)
        last_t = now
        while ends and ends[0][0] <= now:
            _, name = heapq.heappop(ends)
            running.pop(name)
            done = assignments.pop(name)
            engine.release(done)
            allocated -= sum(len(x.gpu_indices) * x.milli for x in done)
        while ai < len(arrivals) and arrivals[ai].creation_time <= now:
            p = arrivals[ai]
            queue[p.name] = reqs[p.name]
            ai += 1
        if queue:
            t0 = time.perf_counter()
            out = engine.cycle(list(queue.values()), list(running.values()), now)
            engine_s += time.perf_counter() - t0
            cycles += 1
            decisions += len(out)
            for dec in out:
                if isinstance(dec, Resize):
                    # The engine changed the elastic pod's GPUs (its Running, shared, already says so).
                    r = running[dec.request_id]
                    allocated += (len(dec.added) - len(dec.removed)) * MILLI
                    assignments[dec.request_id] = (
                        Assignment(r.node_id, r.gpu_indices, MILLI, r.cpu_milli, r.memory_mib),
                    )
                    resizes += 1
                    continue
                if not isinstance(dec, Place):
                    continue
                req = queue.pop(dec.request_id)
                a = dec.assignments[0]
                pod = by_name[req.id]
                est_end = None if req.est_runtime is None else now + req.est_runtime
                running[req.id] = Running(
                    req.id,
                    req.tenant,
                    a.node_id,
                    a.gpu_indices,
                    a.milli,
                    a.cpu_milli,
                    a.memory_mib,
                    req.plan,
                    start_time=now,
                    est_end=est_end,
                    elastic_min=elastic[req.id][0] if req.id in elastic else 0,
                    elastic_max=elastic[req.id][1] if req.id in elastic else 0,
                )
                assignments[req.id] = dec.assignments
                allocated += sum(len(x.gpu_indices) * x.milli for x in dec.assignments)
                delays.append(now - pod.creation_time)
                if req.id in groups:
                    group_delays.setdefault(groups[req.id], []).append(now - pod.creation_time)
                if est_end is not None:
                    heapq.heappush(ends, (est_end, req.id))
        last_util = 100.0 * allocated / capacity
        util_peak = max(util_peak, last_util)
        if now >= next_sample:
            last_frag = 100.0 * engine.state.fragmentation(dist) / capacity
            series.append((now, last_util, last_frag, len(queue)))
            next_sample = now + sample_every
        if ai >= len(arrivals) and not ends:
            break
    span = max(1e-9, last_t - t_first)
    delays.sort()
    delay = {
        "mean": round(sum(delays) / len(delays), 3) if delays else 0.0,
        "p50": percentile(delays, 50),
        "p95": percentile(delays, 95),
        "p99": percentile(delays, 99),
    }
    counts: dict[str, int] = {}
    for label in groups.values():
        counts[label] = counts.get(label, 0) + 1
    per_group = {}
    for label, n in sorted(counts.items()):
        ds = sorted(group_delays.get(label, []))
        per_group[label] = {
            "pods": n,
            "placed": len(ds),
            "allocation_rate_pct": round(100.0 * len(ds) / n, 2),
            "delay_s": {
                "mean": round(sum(ds) / len(ds), 1) if ds else 0.0,
                "p50": percentile(ds, 50),
                "p95": percentile(ds, 95),
            },
        }
    return ReplayResult(
        groups=per_group,
        resizes=resizes,
        policy=engine.policy.name,
        capacity_gpu_milli=capacity,
        pods=len(pods),
        placed=len(delays),
        never_placed=len(pods) - len(delays),
        delay=delay,
        utilisation_mean=util_area / span,
        utilisation_peak=util_peak,
        fragmentation_mean=frag_area / span,
        cycles=cycles,
        decisions_per_s=decisions / engine_s if engine_s > 0 else 0.0,
        series=series,
    )


def plot(result: ReplayResult, path: str) -> None:
    """Write a PNG: GPU utilisation and fragmentation (% of capacity) and queue length over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] / 3600.0 for s in result.series]
    fig, ax = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ax[0].plot(t, [s[1] for s in result.series], label="GPU allocated %")
    ax[0].plot(t, [s[2] for s in result.series], label="fragmentation %")
    ax[0].set_ylabel("% of GPU capacity")
    ax[0].legend(loc="upper left")
    ax[0].set_title(f"replay, policy {result.policy}")
    ax[1].plot(t, [s[3] for s in result.series], color="tab:red")
    ax[1].set_ylabel("pods queued")
    ax[1].set_xlabel("hours since first arrival")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
