"""gpupool's scheduling engine: placement and queueing on an in-memory snapshot, in plain Python.

It never imports Django or another gpupool app: the live scheduler, the trace simulator and the
benchmarks hand it the same dataclasses and get the same decisions back.

    decisions = schedule(snapshot, pending, CycleConfig(policy="gpupool"))

Each decision is a ``Place`` (node, GPU indices, share per GPU, CPU and RAM per node; with the ids of
running workloads to preempt first, if any) or a ``Pending`` (reason, message, expected start).
"""

from .cycle import CycleConfig, Engine, schedule
from .fragmentation import Distribution
from .policies import DEFAULT_POLICY, POLICIES, get_policy
from .queueing import QueueConfig, QueuePolicy
from .spec import Demand, allowed_models, model_matches, validate, version_key
from .state import ClusterState
from .types import (
    MILLI,
    Assignment,
    Decision,
    Gpu,
    GpuModelInfo,
    GpuSpec,
    Node,
    NodeState,
    Pending,
    Place,
    Plan,
    PriorityClass,
    Reason,
    Request,
    Resize,
    Running,
    Snapshot,
    SoftwareVersions,
    Vendor,
)

__all__ = [
    "DEFAULT_POLICY",
    "MILLI",
    "POLICIES",
    "Assignment",
    "ClusterState",
    "CycleConfig",
    "Decision",
    "Demand",
    "Distribution",
    "Engine",
    "Gpu",
    "GpuModelInfo",
    "GpuSpec",
    "Node",
    "NodeState",
    "Pending",
    "Place",
    "Plan",
    "PriorityClass",
    "QueueConfig",
    "QueuePolicy",
    "Reason",
    "Request",
    "Resize",
    "Running",
    "Snapshot",
    "SoftwareVersions",
    "Vendor",
    "allowed_models",
    "get_policy",
    "model_matches",
    "schedule",
    "validate",
    "version_key",
]
