"""Where a request's minimum driver, CUDA and ROCm versions can be met (the cost estimate's regions)."""

from __future__ import annotations

from nodes.models import Node, NodeState, Region
from scheduling.engine import SoftwareVersions, version_key
from scheduling.services.snapshot import node_versions


def minimums(values: dict[str, str]) -> SoftwareVersions:
    """The engine's form of ``min_driver``, ``min_cuda`` and ``min_rocm`` (normalised strings)."""
    return SoftwareVersions(
        driver=version_key(values.get("min_driver") or "") if values.get("min_driver") else None,
        cuda=version_key(values.get("min_cuda") or "") if values.get("min_cuda") else None,
        rocm=version_key(values.get("min_rocm") or "") if values.get("min_rocm") else None,
    )


def regions_meeting_versions(*, gpu_model, values: dict[str, str]) -> list[Region]:
    """The regions with a node (not down or in maintenance) that has ``gpu_model`` and software
    meeting the minimums, as its last heartbeat reported it."""
    need = minimums(values)
    rows = (
        Node.objects.filter(gpus__model=gpu_model, gpus__removed_at__isnull=True)
        .exclude(state__in=[NodeState.DOWN, NodeState.MAINTENANCE])
        .values_list("region_id", "driver_version", "cuda_version", "rocm_version")
        .distinct()
    )
    ids = {region for region, *versions in rows if node_versions(*versions).meets(need)}
    return list(Region.objects.filter(pk__in=ids).order_by("code"))
