"""Plain data the engine works on: a snapshot of the fleet, the pending requests, and the decisions.

Everything here is a dataclass of built-in types so that the live scheduler (which builds them from
database rows), the trace simulator and the benchmarks hand the engine exactly the same things.
GPU capacity is counted in thousandths of one GPU ("milli"): a whole GPU is 1000.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .constraints import Constraints

MILLI = 1000


class Vendor(StrEnum):
    NVIDIA = "nvidia"
    AMD = "amd"
    INTEL = "intel"


class NodeState(StrEnum):
    READY = "READY"
    SUSPECT = "SUSPECT"
    DOWN = "DOWN"
    DRAINING = "DRAINING"


class Plan(StrEnum):
    ON_DEMAND = "on_demand"
    SPOT = "spot"
    RESERVED = "reserved"
    WARM_POOL = "warm_pool"


class PriorityClass(IntEnum):
    """Higher runs first and may preempt lower."""

    WARM_POOL = 0
    SPOT = 1
    ON_DEMAND = 2
    RESERVED = 3


PLAN_PRIORITY = {
    Plan.WARM_POOL: PriorityClass.WARM_POOL,
    Plan.SPOT: PriorityClass.SPOT,
    Plan.ON_DEMAND: PriorityClass.ON_DEMAND,
    Plan.RESERVED: PriorityClass.RESERVED,
}


VersionKey = tuple[int, ...]
"""A release version as numbers, trailing zeros dropped (``12.0`` and ``12`` are ``(12,)``)."""


@dataclass(frozen=True, slots=True)
class SoftwareVersions:
    """A node's driver stack (``None``: not reported), or a request's minimums (``None``: any)."""

    driver: VersionKey | None = None
    cuda: VersionKey | None = None
    rocm: VersionKey | None = None

    def meets(self, minimum: SoftwareVersions) -> bool:
        """Whether these versions are at least ``minimum``'s; an unknown version meets no minimum."""
        for have, need in (
            (self.driver, minimum.driver),
            (self.cuda, minimum.cuda),
            (self.rocm, minimum.rocm),
        ):
            if need is not None and (have is None or have < need):
                return False
        return True

    def __bool__(self) -> bool:
        return self.driver is not None or self.cuda is not None or self.rocm is not None


NO_VERSIONS = SoftwareVersions()


@dataclass(frozen=True, slots=True)
class GpuModelInfo:
    """One entry of the GPU catalog."""

    name: str
    vendor: Vendor = Vendor.NVIDIA
    memory_mib: int = 0
    compute_weight: float = 1.0
    cuda_capability: tuple[int, int] | None = None
    rocm_target: str | None = None
    mig_profiles: tuple[str, ...] = ()
    oversubscription: float = 1.0
    """Fractional (non-MIG) shares on one GPU of this model may add up to this many GPUs (>= 1.0).
    The engine charges a share of ``milli`` as ``ceil(milli / oversubscription)`` of the GPU's 1000
    capacity units; whole GPUs and MIG slices are never over-subscribed."""


@dataclass(slots=True)
class Gpu:
    index: int
    healthy: bool = True
    island: int = 0
    """NVLink island / NUMA node inside the server; multi-GPU work prefers one island."""
    free_milli: int = MILLI
    """Capacity units left (of 1000); an over-subscribed share takes fewer units than its milli."""
    mig: bool = False
    """In MIG mode (set by staff): only MIG instances go to it, and they go nowhere else."""
    mig_layout: tuple[tuple[str, int], ...] = ()
    """In MIG mode, the staff layout's instances ((profile, start)) that work takes; empty: an instance
    is made for each workload where the hardware can make it."""
    mig_used: tuple[tuple[str, int], ...] = ()
    """The MIG instances ((profile, start)) that work holds now."""


@dataclass(slots=True)
class Node:
    id: str
    model: str
    """The GPU model of this server (servers are homogeneous)."""
    gpus: list[Gpu]
    cpu_milli: int
    memory_mib: int
    cpu_used: int = 0
    memory_used: int = 0
    region: str = "default"
    domain: str = ""
    """Rack or interconnect domain (within its region); work split over nodes prefers one."""
    state: NodeState = NodeState.READY
    reserved_for: str | None = None
    """Tenant whose reservation holds this node; others may only borrow it for preemptible work."""
    software: SoftwareVersions = NO_VERSIONS
    """The node's driver, CUDA and ROCm versions, for requests with minimums."""
    reserved_gpus: int | None = None
    """With ``reserved_for``: None when the reservation holds the whole node; else the node is
    partly reserved, and this many whole GPUs (the owner's reserved share not yet in use by its
    reserved work) must stay free or lent: on-demand work may use the rest."""
    labels: dict[str, str] = field(default_factory=dict)
    """The labels its agent registered (rack, power domain, ...): for ``Constraints``."""


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Which GPUs a request accepts. Empty ``models`` means any model that meets the constraints."""

    models: tuple[str, ...] = ()
    min_memory_mib: int = 0
    min_compute_weight: float = 0.0
    vendor: Vendor | None = None
    cuda_capability: tuple[int, int] | None = None
    """Minimum CUDA compute capability (NVIDIA only)."""
    rocm_target: str | None = None
    """Exact ROCm gfx target, e.g. ``gfx90a`` (AMD only)."""
    mig_profile: str | None = None
    """A MIG instance such as ``1g.10gb``: only models offering it, and only on a GPU in MIG mode
    where the hardware can make it (``mig.py``)."""


@dataclass(slots=True)
class Request:
    """A workload waiting for GPUs.

    ``gpus`` GPUs on one node (1..8), or with ``gang`` a multiple of a node's GPU count across several
    whole nodes (all or nothing), or with ``milli`` < 1000 that share of one GPU (``gpus`` must be 1).
    With ``gpus_per_node`` the GPUs may also come as equal pieces of one of those sizes on several
    nodes of one model (all or nothing): on one node when it can, else in one domain, else in one
    region, and across regions only with ``split_regions_ok``.
    ``cpu_milli`` and ``memory_mib`` are per node.
    """

    id: str
    tenant: str
    gpu: GpuSpec = field(default_factory=GpuSpec)
    gpus: int = 1
    milli: int = MILLI
    gang: bool = False
    cpu_milli: int = 0
    memory_mib: int = 0
    region: str | None = None
    other_regions_ok: bool = True
    gpus_per_node: tuple[int, ...] = ()
    split_regions_ok: bool = False
    plan: Plan = Plan.ON_DEMAND
    priority: PriorityClass | None = None
    """Defaults to the plan's class."""
    submit_time: float = 0.0
    est_runtime: float | None = None
    avoid_nodes: tuple[str, ...] = ()
    """Nodes that failed to start it: placed elsewhere unless no other node could ever take it."""
    excluded: frozenset[tuple[str, str]] = frozenset()
    """(GPU model, region) pairs it may not use at all, e.g. where the spot price is above its maximum."""
    min_versions: SoftwareVersions = NO_VERSIONS
    """Minimum driver, CUDA and ROCm versions of the node it runs on."""
    queue_policy: str | None = None
    """Its region's queue policy (``queueing.QueuePolicy`` value); None: the cycle's ``QueueConfig``."""
    constraints: Constraints | None = None
    """Node selector, affinity, spread and model preference (``constraints``); None: none."""

    @property
    def priority_class(self) -> PriorityClass:
        return self.priority if self.priority is not None else PLAN_PRIORITY[self.plan]

    @property
    def gpu_milli_total(self) -> int:
        return self.gpus * self.milli

    @property
    def mig(self) -> bool:
        return self.gpu.mig_profile is not None


@dataclass(slots=True)
class Running:
    """A workload holding GPUs now (used for fair share, backfill and preemption)."""

    id: str
    tenant: str
    node_id: str
    gpu_indices: tuple[int, ...]
    milli: int = MILLI
    """Capacity units held per GPU (the share itself unless the GPU is over-subscribed)."""
    cpu_milli: int = 0
    memory_mib: int = 0
    plan: Plan = Plan.ON_DEMAND
    priority: PriorityClass | None = None
    start_time: float = 0.0
    est_end: float | None = None
    checkpointable: bool = False
    gang_id: str | None = None
    """Gang members are preempted together."""
    mig_profile: str | None = None
    mig_start: int | None = None
    """A MIG instance's profile and start (memory slice) on its GPU."""
    group: str = ""
    """The array it is a task of (spread counts its members), or empty."""
    elastic_min: int = 0
    """An elastic job (on one node): it may shrink to this many GPUs (0: not elastic)."""
    elastic_max: int = 0
    """...and grow to this many (its tenant's current wish within its bounds)."""

    @property
    def priority_class(self) -> PriorityClass:
        return self.priority if self.priority is not None else PLAN_PRIORITY[self.plan]


@dataclass(slots=True)
class Snapshot:
    nodes: list[Node]
    models: dict[str, GpuModelInfo]
    running: list[Running] = field(default_factory=list)
    tenant_weights: dict[str, float] = field(default_factory=dict)
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class Assignment:
    node_id: str
    gpu_indices: tuple[int, ...]
    milli: int
    """Capacity units taken per GPU (less than the request's share on an over-subscribed GPU)."""
    cpu_milli: int
    memory_mib: int
    mig_start: int | None = None
    """A MIG instance: the memory slice it starts at (the agent makes it there)."""
    mig_use: int = 0
    """A MIG instance: what it takes of its GPU's MIG state (``mig.py``)."""


@dataclass(frozen=True, slots=True)
class Place:
    request_id: str
    assignments: tuple[Assignment, ...]
    preempt: tuple[str, ...] = ()
    """Running workloads to stop first (ids); empty for a plain placement."""
    backfill: bool = False


class Reason(StrEnum):
    NO_MATCHING_MODEL = "no_matching_model"
    REGION = "region"
    CAPACITY = "capacity"
    GANG = "gang"
    RESERVATION = "reservation"
    BLOCKED_BY_HEAD = "blocked_by_head"
    INVALID = "invalid"
    PRICE = "price"
    NODE_SELECTOR = "node_selector"
    AFFINITY = "affinity"
    ANTI_AFFINITY = "anti_affinity"
    SPREAD = "spread"
    VERSIONS = "versions"


@dataclass(frozen=True, slots=True)
class Pending:
    request_id: str
    reason: Reason
    message: str
    expected_start: float | None = None


@dataclass(frozen=True, slots=True)
class Resize:
    """A running elastic job's new GPUs on its node (``gpu_indices``: the whole new set).
    ``for_request``: the placement it shrinks for (it comes just before that ``Place``); None for
    growth into idle GPUs."""

    request_id: str
    node_id: str
    gpu_indices: tuple[int, ...]
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    for_request: str | None = None


Decision = Place | Pending | Resize
