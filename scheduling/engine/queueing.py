"""The order in which pending requests are tried.

Priority classes first (reserved > on-demand > spot > warm pool). Inside a class, weighted
dominant-resource fairness between tenants: the tenant whose dominant share (of compute-weighted GPU,
CPU and RAM, divided by its weight) is smallest goes next, and its share grows with what it is given
in this cycle. Inside a tenant, first come first served, or shortest job first among jobs with an
estimate. Aging: the wait of a tenant's next request lowers its share key, and a request that waited
``promote_after_s`` is ordered one class higher (its rights to preempt do not change), so nothing
starves.

Staff may choose a queue policy per region (``QueuePolicy``; a request carries its region's choice in
``Request.queue_policy``, None keeping the order above). The policy replaces the class bands and the
order inside a tenant; fair share between tenants stays:

* ``fcfs``: one band, arrival order.
* ``sjf``: one band, shortest ``est_runtime`` first; a request without an estimate sorts after every
  request with one (as if its runtime were infinite), in arrival order.
* ``priority_aging``: score = priority class (spot 1, on-demand 2, reserved 3; warm pool 0) plus
  ``priority_aging_per_hour`` (default 1.0: one class per hour waited); bands are the whole part of
  the score (at most reserved), highest score first inside a tenant.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from .types import MILLI, GpuModelInfo, Node, PriorityClass, Request, Running


class QueuePolicy(StrEnum):
    FCFS = "fcfs"
    SJF = "sjf"
    PRIORITY_AGING = "priority_aging"


@dataclass(frozen=True, slots=True)
class QueueConfig:
    shortest_job_first: bool = False
    policy: QueuePolicy | None = None
    """The policy of requests without their own ``queue_policy`` (None: class bands, fair share, FCFS)."""
    priority_aging_per_hour: float = 1.0
    """Under ``priority_aging``: priority classes added to a request's score per hour it has waited."""
    aging_per_hour: float = 0.05
    """Dominant share taken off a tenant's key per hour its next request has waited."""
    promote_after_s: float | None = 3600.0
    """A request waiting this long is ordered one class higher (None: never)."""


class FairShare:
    """Per-tenant use of the cluster, in shares of compute-weighted GPU, CPU and RAM."""

    def __init__(
        self,
        nodes: list[Node],
        models: dict[str, GpuModelInfo],
        running: list[Running],
        weights: dict[str, float],
        base: tuple[dict[str, float], float, int, int] | None = None,
    ) -> None:
        self.weights = weights
        if base is None:
            base = self.base(nodes, models)
        self._gpu_weight, self.total_gpu, self.total_cpu, self.total_mem = base
        self.use: dict[str, list[float]] = {}
        for r in running:
            self.add(r.tenant, r.node_id, len(r.gpu_indices) * r.milli, r.cpu_milli, r.memory_mib)

    @staticmethod
    def base(nodes: list[Node], models: dict[str, GpuModelInfo]) -> tuple[dict[str, float], float, int, int]:
        """Per-node compute weight of its GPUs and the cluster totals (reusable across cycles)."""
        w = {n.id: (models[n.model].compute_weight if n.model in models else 1.0) for n in nodes}
        return (
            w,
            sum(len(n.gpus) * MILLI * w[n.id] for n in nodes) or 1.0,
            sum(n.cpu_milli for n in nodes) or 1,
            sum(n.memory_mib for n in nodes) or 1,
        )

    def add(self, tenant: str, node_id: str, gpu_milli: int, cpu: int, mem: int) -> None:
        u = self.use.get(tenant)
        if u is None:
            u = self.use[tenant] = [0.0, 0.0, 0.0]
        u[0] += gpu_milli * self._gpu_weight.get(node_id, 1.0)
        u[1] += cpu
        u[2] += mem

    def share(self, tenant: str) -> float:
        u = self.use.get(tenant)
        if u is None:
            return 0.0
        dominant = max(u[0] / self.total_gpu, u[1] / self.total_cpu, u[2] / self.total_mem)
        return dominant / max(self.weights.get(tenant, 1.0), 1e-9)


def _policy(request: Request, config: QueueConfig) -> QueuePolicy | None:
    return QueuePolicy(request.queue_policy) if request.queue_policy else config.policy


def _aged_score(request: Request, now: float, config: QueueConfig) -> float:
    return (
        int(request.priority_class)
        + config.priority_aging_per_hour * max(0.0, now - request.submit_time) / 3600.0
    )


def effective_class(request: Request, now: float, config: QueueConfig) -> int:
    policy = _policy(request, config)
    if policy in (QueuePolicy.FCFS, QueuePolicy.SJF):
        return 0
    if policy == QueuePolicy.PRIORITY_AGING:
        return min(int(_aged_score(request, now, config)), int(PriorityClass.RESERVED))
    cls = int(request.priority_class)
    if config.promote_after_s is not None and now - request.submit_time >= config.promote_after_s:
        cls = min(cls + 1, int(PriorityClass.RESERVED))
    return cls


def _tenant_queue_key(request: Request, now: float, config: QueueConfig) -> tuple:
    policy = _policy(request, config)
    if policy == QueuePolicy.FCFS:
        return (0, 0.0, request.submit_time, request.id)
    if policy == QueuePolicy.SJF:
        if request.est_runtime is not None:
            return (0, request.est_runtime, request.submit_time, request.id)
        return (1, 0.0, request.submit_time, request.id)
    if policy == QueuePolicy.PRIORITY_AGING:
        return (0, -_aged_score(request, now, config), request.submit_time, request.id)
    if config.shortest_job_first and request.est_runtime is not None:
        return (0, request.est_runtime, request.submit_time, request.id)
    return (1 if config.shortest_job_first else 0, 0.0, request.submit_time, request.id)


class FairQueue:
    """Yields requests in scheduling order; ``granted`` feeds placements back into the shares."""

    def __init__(self, requests: list[Request], fair: FairShare, now: float, config: QueueConfig) -> None:
        self.fair = fair
        self.now = now
        self.config = config
        by_class: dict[int, dict[str, list[tuple]]] = {}
        for r in requests:
            tq = by_class.setdefault(effective_class(r, now, config), {}).setdefault(r.tenant, [])
            tq.append((*_tenant_queue_key(r, now, config), r))
        self._classes = []
        for cls in sorted(by_class, reverse=True):
            tenants = by_class[cls]
            for q in tenants.values():
                q.sort(key=lambda e: e[:4])
                q.reverse()  # pop() from the end gives the next request
            self._classes.append((cls, tenants))
        self._seq = 0

    def _key(self, tenant: str, request: Request) -> float:
        wait_h = max(0.0, self.now - request.submit_time) / 3600.0
        return self.fair.share(tenant) - self.config.aging_per_hour * wait_h

    def __iter__(self) -> Iterator[tuple[int, Request]]:
        for cls, tenants in self._classes:
            heap = []
            for tenant, q in tenants.items():
                heap.append((self._key(tenant, q[-1][-1]), self._seq, tenant))
                self._seq += 1
            heapq.heapify(heap)
            while heap:
                _, _, tenant = heapq.heappop(heap)
                q = tenants[tenant]
                request = q.pop()[-1]
                yield cls, request
                if q:
                    self._seq += 1
                    heapq.heappush(heap, (self._key(tenant, q[-1][-1]), self._seq, tenant))
