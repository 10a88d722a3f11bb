"""Which GPU models a request accepts, and the normalized demand the placement index works with."""

from __future__ import annotations

from dataclasses import dataclass

from .types import MILLI, NO_VERSIONS, GpuModelInfo, GpuSpec, Plan, Request, SoftwareVersions, Vendor


def _rocm_matches(info: GpuModelInfo, target: str) -> bool:
    return info.vendor == Vendor.AMD and info.rocm_target is not None and info.rocm_target == target


def model_matches(info: GpuModelInfo, spec: GpuSpec) -> bool:
    """True when the catalog entry ``info`` satisfies every constraint of ``spec``."""
    if spec.models and info.name not in spec.models:
        return False
    if info.memory_mib < spec.min_memory_mib:
        return False
    if info.compute_weight < spec.min_compute_weight:
        return False
    if spec.vendor is not None and info.vendor != spec.vendor:
        return False
    if spec.cuda_capability is not None and (
        info.vendor != Vendor.NVIDIA
        or info.cuda_capability is None
        or info.cuda_capability < spec.cuda_capability
    ):
        return False
    if spec.mig_profile is not None and spec.mig_profile not in info.mig_profiles:
        return False
    return spec.rocm_target is None or _rocm_matches(info, spec.rocm_target)


def allowed_models(spec: GpuSpec, catalog: dict[str, GpuModelInfo]) -> frozenset[str]:
    return frozenset(name for name, info in catalog.items() if model_matches(info, spec))


# Access modes to reserved capacity, part of a Demand.
ACCESS_NONE = ""
"""May use only unreserved nodes (on-demand)."""
ACCESS_LEND = "*"
"""May also borrow other tenants' idle reserved nodes (spot, warm pool): preemptible."""


@dataclass(frozen=True, slots=True)
class Demand:
    """A request reduced to what decides where it fits; identical demands share one index entry."""

    models: frozenset[str]
    milli: int
    gpus: int
    cpu: int
    mem: int
    gang: bool = False
    region: str | None = None
    other_regions_ok: bool = True
    access: str = ACCESS_NONE
    """ACCESS_NONE, ACCESS_LEND, or the tenant id for work on that tenant's own reservation."""
    mig: str = ""
    """A MIG instance's profile (empty for other work): only on a GPU in MIG mode, where the hardware
    can make it; never over-subscribed."""
    excluded: frozenset[tuple[str, str]] = frozenset()
    """(model, region) pairs it may not use (``Request.excluded``)."""
    per_node: tuple[int, ...] = ()
    """Piece sizes it may be split into over several nodes (``Request.gpus_per_node``), largest first."""
    split_regions: bool = False
    prefer: tuple[str, ...] = ()
    """Models best first (``Constraints.prefer``): a worse rank adds to the class penalty."""
    min_versions: SoftwareVersions = NO_VERSIONS
    """Only nodes whose software meets these (``Request.min_versions``)."""

    @property
    def shared(self) -> bool:
        return self.milli < MILLI


def access_for(request: Request) -> str:
    if request.plan == Plan.RESERVED:
        return request.tenant
    if request.plan in (Plan.SPOT, Plan.WARM_POOL):
        return ACCESS_LEND
    return ACCESS_NONE


def validate(request: Request) -> str | None:
    """Return why the request is malformed, or None."""
    if request.milli <= 0 or request.milli > MILLI:
        return "milli must be in 1..1000"
    if request.milli < MILLI and request.gpus != 1:
        return "a fraction applies to exactly one GPU"
    if request.mig and request.gpus != 1:
        return "a MIG slice applies to exactly one GPU"
    if request.gpus < 0:
        return "gpus must not be negative"
    if request.gpus_per_node:
        if request.gang or request.milli < MILLI:
            return "gpus_per_node is for whole GPUs without a gang"
        if not all(1 <= k <= 8 for k in request.gpus_per_node):
            return "gpus_per_node sizes are 1..8"
        if request.gpus > 8 and not any(request.gpus % k == 0 for k in request.gpus_per_node):
            return "no size of gpus_per_node divides gpus"
    elif not request.gang and request.gpus > 8:
        return "more than 8 GPUs needs a gang across nodes"
    if request.gang and request.gpus < 1:
        return "a gang needs GPUs"
    if request.cpu_milli < 0 or request.memory_mib < 0:
        return "cpu and memory must not be negative"
    return None


def demand_for(request: Request, catalog: dict[str, GpuModelInfo]) -> Demand:
    return Demand(
        models=allowed_models(request.gpu, catalog),
        milli=request.milli,
        gpus=request.gpus,
        cpu=request.cpu_milli,
        mem=request.memory_mib,
        gang=request.gang,
        region=request.region,
        other_regions_ok=request.other_regions_ok,
        access=access_for(request),
        mig=request.gpu.mig_profile or "",
        excluded=request.excluded,
        per_node=split_sizes(request),
        split_regions=request.split_regions_ok,
        min_versions=request.min_versions,
    )


def version_key(text: str) -> tuple[int, ...] | None:
    """The leading release number of a version as reported (``550.54.15``, ``6.2.0-1``, ``12.4``),
    trailing zeros dropped; None when it does not start with one."""
    digits = []
    for part in text.strip().split("."):
        number = ""
        for ch in part:
            if not ch.isdigit():
                break
            number += ch
        if not number:
            break
        digits.append(int(number))
        if len(number) != len(part):
            break
    while len(digits) > 1 and digits[-1] == 0:
        digits.pop()
    return tuple(digits) or None


def split_sizes(request: Request) -> tuple[int, ...]:
    """The piece sizes a request may be split into (each divides its GPUs, smaller than the
    whole), largest first."""
    if not request.gpus_per_node:
        return ()
    return tuple(
        sorted(
            {k for k in request.gpus_per_node if 0 < k < request.gpus and request.gpus % k == 0}, reverse=True
        )
    )
