"""Submitting a workload: validate the spec against the catalog and the fleet, enforce the tenant's
quotas atomically, run the admission checks, store it PENDING and ask for a scheduling cycle.

One transaction: a refusal (400 naming the field, a quota error naming the quota, an admission
check's error) stores nothing.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from nodes.agent.workload_rules import (
    WorkloadRuleError,
    check_command,
    check_image,
    check_mig_profile,
    check_ports,
    check_ssh_public_key,
    check_template,
)
from nodes.mig_profiles import table_for
from nodes.models import Gpu, GpuModel, NodeState, Region, RegionBackend
from nodes.slurm.config import slurm_config_parse
from portal.actors import Actor
from portal.errors import DomainError, ValidationFailed
from portal.events import publish
from portal.logging import log_context
from portal.services.audit import audit_record
from scheduling.admission import run_admission_checks
from scheduling.locks import lock_quota
from scheduling.models import (
    MAX_GPUS_PER_NODE,
    MILLI,
    GpuVendor,
    Plan,
    PriorityClass,
    Quota,
    Reservation,
    ReservationStatus,
    Workload,
    WorkloadEvent,
    WorkloadKind,
    WorkloadState,
)
from scheduling.pricing import spot_price_floor
from scheduling.selectors.shared import QuotaUsage, quota_usage
from scheduling.services.arrays import MAX_ARRAY_COUNT
from scheduling.services.dependencies import dependencies_attach, dependencies_validate
from scheduling.services.env import GANG_ENV_NAMES, env_validate
from scheduling.services.placement import placement_validate
from scheduling.services.templates import template_apply, template_for_launch
from scheduling.services.versions import min_driver_check, min_versions_validate, min_versions_vendor_ok
from scheduling.services.volumes import VolumeRequest, volumes_attach, volumes_validate
from scheduling.services.work import WorkSpec, work_items_create, work_validate

logger = logging.getLogger(__name__)
PLAN_PRIORITY_RANK = {
    PriorityClass.WARM_POOL: 0,
    PriorityClass.SPOT: 1,
    PriorityClass.ON_DEMAND: 2,
    PriorityClass.RESERVED: 3,
}
# Vendors the placement engine can represent (scheduling.engine.types.Vendor).
SCHEDULABLE_VENDORS = frozenset({GpuVendor.NVIDIA, GpuVendor.AMD, GpuVendor.INTEL})
MIG_PROFILE_RE = re.compile(r"^(\d)g\.(\d+)gb$")
CUDA_CC_RE = re.compile(r"^\d{1,2}\.\d$")


class QuotaExceeded(DomainError):
    status_code = 403
    code = "quota_exceeded"


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


# --- reading the spec ------------------------------------------------------------------------------


def _int(spec: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = spec.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(key, "Must be an integer.")
    if not lo <= value <= hi:
        raise _fail(key, f"Must be between {lo} and {hi}.")
    return value


def _bool(spec: dict, key: str, default: bool) -> bool:
    value = spec.get(key, default)
    if not isinstance(value, bool):
        raise _fail(key, "Must be true or false.")
    return value


def _str(spec: dict, key: str, max_length: int, default: str = "") -> str:
    value = spec.get(key, default)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _fail(key, "Must be a string.")
    value = value.strip()
    if len(value) > max_length:
        raise _fail(key, f"At most {max_length} characters.")
    return value


def _gpus_per_node(spec: dict) -> list[int]:
    """``gpus_per_node``: the piece sizes (1-8) its GPUs may be split into over several nodes, or
    ``"any"`` (every size); absent or empty: one node (or a gang's whole nodes)."""
    value = spec.get("gpus_per_node")
    if value is None or value == []:
        return []
    if value == "any":
        return list(range(1, MAX_GPUS_PER_NODE + 1))
    if (
        not isinstance(value, list)
        or len(value) > MAX_GPUS_PER_NODE
        or not all(isinstance(k, int) and not isinstance(k, bool) for k in value)
    ):
        raise _fail("gpus_per_node", f'A list of sizes 1-{MAX_GPUS_PER_NODE}, or "any".')
    if not all(1 <= k <= MAX_GPUS_PER_NODE for k in value):
        raise _fail("gpus_per_node", f"Each size is 1-{MAX_GPUS_PER_NODE} GPUs.")
    return sorted(set(value))


def _decimal(spec: dict, key: str) -> Decimal | None:
    value = spec.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, float | bool):
        raise _fail(key, "Give a decimal as a string or an integer (no floats for money).")
    try:
        d = Decimal(str(value))
    except InvalidOperation:
        raise _fail(key, "Not a decimal number.") from None
    if not d.is_finite():
        raise _fail(key, "Not a decimal number.")
    return d


@dataclass
class _Resolved:
    models: list[GpuModel]  # explicit choices (empty: any model meeting the constraints)
    model_names: list[str]  # their names in the catalog's order, as the workload's detail lists them
    candidates: list[GpuModel]  # every catalog model this request accepts
    region: Region | None
    reservation: Reservation | None
    volumes: list[VolumeRequest] = field(default_factory=list)
    depends_on: list[tuple[Workload, str]] = field(default_factory=list)
    work: WorkSpec | None = None


@dataclass(frozen=True)
class Submitted:
    """What ``workload_submit`` attached to a new workload, as its detail shows it."""

    gpu_model_names: list[str]  # in the catalog's order (the detail's gpu_models)
    no_volumes: bool
    no_dependencies: bool


def _explicit_models(spec: dict, catalog: list[GpuModel]) -> list[GpuModel]:
    raw = spec.get("gpu_models")
    if raw is None and spec.get("gpu_model") is not None:
        raw = [spec["gpu_model"]]
        key = "gpu_model"
    else:
        key = "gpu_models"
    if raw in (None, []):
        return []
    if not isinstance(raw, list):
        raise _fail(key, "Must be a list of GPU model names or ids.")
    by_id = {m.pk: m for m in catalog}
    by_name: dict[str, GpuModel] = {}
    for m in catalog:
        for name in (m.name, m.short_name, *(m.aliases or [])):
            if name:
                by_name.setdefault(str(name).lower(), m)
    out: list[GpuModel] = []
    for item in raw:
        m = by_id.get(item) if isinstance(item, int) and not isinstance(item, bool) else None
        if m is None and isinstance(item, str):
            m = by_name.get(item.strip().lower())
        if m is None:
            raise _fail(key, f"Unknown GPU model {item!r}; see /api/v1/gpu-types/.")
        if m not in out:
            out.append(m)
    return out


def _cc_tuple(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def _meets_constraints(m: GpuModel, c: dict[str, Any]) -> bool:
    if m.memory_gib < c["min_gpu_memory_gib"] or m.compute_weight < c["min_compute_weight"]:
        return False
    if c["gpu_vendor"] and m.vendor != c["gpu_vendor"]:
        return False
    if c["cuda_capability"]:
        cc = m.cuda_cc_tuple
        if m.vendor != GpuVendor.NVIDIA or cc is None or cc < _cc_tuple(c["cuda_capability"]):
            return False
    if not min_versions_vendor_ok(m.vendor, c):
        return False
    return not c["rocm_target"] or (m.vendor == GpuVendor.AMD and m.gfx_target == c["rocm_target"])


def candidate_models(*, workload: Workload, catalog: list[GpuModel] | None = None) -> list[GpuModel]:
    """The schedulable catalog models a stored workload could land on: its named models, or every
    model that meets its constraints (what ``_validate`` computed when it was submitted)."""
    c = {
        "min_gpu_memory_gib": workload.min_gpu_memory_gib,
        "min_compute_weight": workload.min_compute_weight,
        "gpu_vendor": workload.gpu_vendor,
        "cuda_capability": workload.cuda_capability,
        "rocm_target": workload.rocm_target,
        "min_cuda": workload.min_cuda,
        "min_rocm": workload.min_rocm,
    }
    pool = list(workload.gpu_models.all()) if workload.pk else []
    if not pool:
        pool = catalog if catalog is not None else list(GpuModel.objects.all())
    return [m for m in pool if m.vendor in SCHEDULABLE_VENDORS and _meets_constraints(m, c)]


# The fleet's node shapes by set of candidate models, as read at (monotonic time); see _fleet_nodes.
_shapes: dict[frozenset[int], tuple[float, list[dict[str, Any]]]] = {}


def _fleet_nodes(candidates: Iterable[GpuModel], *, fresh: bool = False) -> list[dict[str, Any]]:
    """The shapes of the nodes carrying a candidate model (and not DOWN or in maintenance): region,
    candidate GPUs per node, CPU and RAM, each shape once. One query, counted per node by the
    database (a row per node, not per GPU).

    Kept ``SCHEDULING_FLEET_SHAPES_CACHE_S`` seconds in the process unless ``fresh``: the query
    reads every GPU of these models (2 ms of Python and 4-5 ms of PostgreSQL at 500 nodes, a fifth
    of a submission), and the fleet's shapes change when nodes come, go or change state, not from
    one submission to the next. ``_validate`` refuses a request only on a fresh read."""
    key = frozenset(m.pk for m in candidates)
    ttl = settings.SCHEDULING_FLEET_SHAPES_CACHE_S
    now = time.monotonic()
    if ttl and not fresh and (kept := _shapes.get(key)) is not None and now - kept[0] < ttl:
        return kept[1]
    rows = (
        Gpu.objects.filter(model_id__in=key, removed_at__isnull=True)
        # Slurm's nodes take work only through their region's Slurm (``_validate_slurm``).
        .exclude(node__state__in=[NodeState.DOWN, NodeState.MAINTENANCE, NodeState.SLURM])
        .values("node_id")
        .annotate(gpus=Count("id"))
        .values_list("node__region_id", "gpus", "node__cpu_cores", "node__ram_mib")
        .order_by()
    )
    shapes = [
        {"region_id": region_id, "gpus": gpus, "cpu_milli": cpu_cores * 1000, "ram_mib": ram_mib}
        for region_id, gpus, cpu_cores, ram_mib in set(rows)
    ]
    if ttl:
        _shapes[key] = (now, shapes)
    return shapes


def _check_fleet(f: dict[str, Any], region: Region | None, nodes: list[dict[str, Any]]) -> None:
    """Some node (of these shapes) must be able to hold the request."""
    if region is not None and not f["other_regions_ok"]:
        nodes = [n for n in nodes if n["region_id"] == region.pk]
    if not nodes:
        where = f" in {region.code}" if region is not None and not f["other_regions_ok"] else ""
        raise _fail("gpu_models", f"No node{where} has these GPUs.")
    if f["gang"]:
        sizes = sorted({n["gpus"] for n in nodes})
        if not any(f["gpu_count"] % s == 0 for s in sizes):
            raise _fail(
                "gpu_count", f"A gang must be a multiple of a node's GPUs ({', '.join(map(str, sizes))})."
            )
    elif f["gpus_per_node"]:
        biggest = max(n["gpus"] for n in nodes)
        pieces = [k for k in f["gpus_per_node"] if f["gpu_count"] % k == 0 and k <= biggest]
        if f["gpu_count"] > biggest and not pieces:
            raise _fail("gpus_per_node", f"No size of these divides {f['gpu_count']} and fits a node.")
    else:
        biggest = max(n["gpus"] for n in nodes)
        if f["gpu_count"] > biggest:
            raise _fail("gpu_count", f"No node has {f['gpu_count']} of these GPUs (at most {biggest}).")
    if f["cpu_millicores"] > max(n["cpu_milli"] for n in nodes):
        raise _fail("cpu_millicores", "More CPU than any node with these GPUs has.")
    if f["ram_mib"] > max(n["ram_mib"] for n in nodes):
        raise _fail("ram_mib", "More RAM than any node with these GPUs has.")


def _rule(check: Callable[[Any], Any], value: Any) -> Any:
    """One of the workload rules the agent applies again (nodes.agent.workload_rules), as a 400."""
    try:
        return check(value)
    except WorkloadRuleError as exc:
        raise _fail(exc.field, exc.message) from None


def _validate_what_runs(spec: dict, tenant) -> dict[str, Any]:
    """Image, template, command, env, ports and SSH key: every string here reaches a node's argv, env
    or files, so each obeys the workload rules. Values are kept exactly as given (no trimming), but
    for the SSH key, kept as the key encodes itself."""
    f: dict[str, Any] = {}
    f["image"] = _str(spec, "image", 255)
    if f["image"]:
        _rule(check_image, f["image"])
    f["template"] = _rule(check_template, _str(spec, "template", 100))
    f["command"] = _rule(check_command, spec.get("command", []))
    f["env"] = env_validate(spec.get("env", {}), tenant=tenant)
    f["ports"] = _rule(check_ports, spec.get("ports", []))
    # Stored normalised ("type base64 comment"): the key the agent's SSH endpoint is told.
    f["ssh_public_key"] = _rule(check_ssh_public_key, _str(spec, "ssh_public_key", 16_000))
    return f


def _validate_array(spec: dict, kind: str, f: dict[str, Any], volumes: list) -> WorkSpec | None:
    """``array``: N tasks, at most P at a time; with ``work``, P workers of a work queue
    (``scheduling.services.arrays`` and ``.work``). Jobs only; a task takes one node's GPUs."""
    raw = spec.get("array")
    f["array_count"] = f["array_parallelism"] = f["work_lease_s"] = None
    if raw is None:
        return None
    if kind != WorkloadKind.JOB:
        raise _fail("array", "Jobs only.")
    if not isinstance(raw, dict) or set(raw) - {"count", "parallelism", "work"}:
        raise _fail(
            "array", 'An object: {"count": N, "parallelism": P} or {"parallelism": P, "work": {...}}.'
        )
    if f["gang"]:
        raise _fail("array", "An array's tasks are not gangs.")
    if f["gpus_per_node"]:
        raise _fail("array", "An array's tasks take one node's GPUs each (no gpus_per_node).")
    if volumes:
        raise _fail("array", "An array's tasks cannot share the request's volumes yet.")
    work = None if raw.get("work") is None else work_validate(raw["work"])
    try:
        count = _int(raw, "count", None, 1, MAX_ARRAY_COUNT)
        parallelism = _int(raw, "parallelism", None, 1, MAX_ARRAY_COUNT)
    except ValidationFailed as exc:
        raise _fail("array", exc.message) from None
    if work is not None:
        # Work-queue mode: the tasks are the workers; count, if given, is the same number.
        parallelism = parallelism or count or 1
        if count is not None and count != parallelism:
            raise _fail("array", "With work, count is the number of workers: give parallelism only.")
        count = parallelism
    if count is None:
        raise _fail("array", "count: required (the number of tasks).")
    parallelism = min(parallelism or count, count)
    f["array_count"], f["array_parallelism"] = count, parallelism
    f["work_lease_s"] = None if work is None else work.lease_s
    return work


def _validate_elastic(spec: dict, kind: str, f: dict[str, Any]) -> None:
    """``elastic``: {"min_gpus": m, "max_gpus": M, "on_resize": "signal" | "restart"}; a job of whole
    GPUs on one node, starting with ``gpu_count`` (default m) GPUs, m <= gpu_count <= M
    (``scheduling.services.elastic``). Not for instances, arrays, gangs, pooled GPUs or fractions:
    their sizes are fixed by what they are."""
    raw = spec.get("elastic")
    f["elastic_min_gpus"] = f["elastic_max_gpus"] = f["elastic_target_gpus"] = None
    f["elastic_on_resize"] = ""
    if raw is None:
        return
    if kind != WorkloadKind.JOB:
        raise _fail("elastic", "Jobs only.")
    if not isinstance(raw, dict) or set(raw) - {"min_gpus", "max_gpus", "on_resize"}:
        raise _fail("elastic", 'An object: {"min_gpus": 2, "max_gpus": 8, "on_resize": "signal"}.')
    try:
        lo = _int(raw, "min_gpus", None, 1, MAX_GPUS_PER_NODE)
        hi = _int(raw, "max_gpus", None, 1, MAX_GPUS_PER_NODE)
    except ValidationFailed as exc:
        raise _fail("elastic", f"{exc.message} (an elastic job runs on one node)") from None
    if lo is None or hi is None:
        raise _fail("elastic", "min_gpus and max_gpus: both required.")
    if hi < lo:
        raise _fail("elastic", "max_gpus must be at least min_gpus.")
    mode = raw.get("on_resize", "signal")
    if mode not in ("signal", "restart"):
        raise _fail("elastic", 'on_resize: "signal" (a file and SIGUSR1) or "restart" (from its checkpoint).')
    if f["gang"] or f["gpus_per_node"]:
        raise _fail("elastic", "An elastic job runs on one node: no gang, no gpus_per_node.")
    if f["gpu_fraction_milli"] < MILLI or f["mig_profile"]:
        raise _fail("elastic", "An elastic job takes whole GPUs (no fraction, no MIG profile).")
    if spec.get("array") is not None:
        raise _fail("elastic", "An array's tasks have a fixed size: not elastic.")
    if spec.get("gpu_count") is None:
        f["gpu_count"] = lo
    elif not lo <= f["gpu_count"] <= hi:
        raise _fail("gpu_count", f"The starting size is between the elastic bounds, {lo} and {hi}.")
    f["elastic_min_gpus"], f["elastic_max_gpus"], f["elastic_target_gpus"] = lo, hi, hi
    f["elastic_on_resize"] = mode


def _validate(*, tenant, kind: str, spec: dict) -> tuple[dict[str, Any], _Resolved]:
    if not isinstance(spec, dict):
        raise ValidationFailed("The spec must be an object.")
    if kind not in WorkloadKind.values:
        raise _fail("kind", f"One of {', '.join(WorkloadKind.values)}.")
    f: dict[str, Any] = {"kind": kind, "name": _str(spec, "name", 100)}
    template_name = _rule(check_template, _str(spec, "template", 100))
    if template_name:
        template = template_for_launch(tenant=tenant, name=template_name)
        spec = template_apply(template=template, spec=spec, kind=kind)

    # GPUs: models and constraints.
    catalog = list(GpuModel.objects.all())
    explicit = _explicit_models(spec, catalog)
    f["min_gpu_memory_gib"] = _int(spec, "min_gpu_memory_gib", 0, 0, 4096)
    weight = _decimal(spec, "min_compute_weight") or Decimal(0)
    if weight < 0 or weight > Decimal("999.99"):
        raise _fail("min_compute_weight", "Must be between 0 and 999.99.")
    f["min_compute_weight"] = weight
    f["gpu_vendor"] = _str(spec, "gpu_vendor", 16)
    if f["gpu_vendor"] and f["gpu_vendor"] not in GpuVendor.values:
        raise _fail("gpu_vendor", f"One of {', '.join(GpuVendor.values)}.")
    f["cuda_capability"] = _str(spec, "cuda_capability", 8)
    if f["cuda_capability"] and not CUDA_CC_RE.match(f["cuda_capability"]):
        raise _fail("cuda_capability", "Like 8.0 or 9.0.")
    f["rocm_target"] = _str(spec, "rocm_target", 16)
    if f["cuda_capability"] and f["rocm_target"]:
        raise _fail("rocm_target", "A request needs CUDA or ROCm, not both.")
    f.update(min_versions_validate(spec))
    pool = explicit or catalog
    for key in ("min_cuda", "min_rocm"):
        if f[key] and not any(min_versions_vendor_ok(m.vendor, {key: f[key]}) for m in pool):
            raise _fail(
                key,
                f"No GPU model {'of the request ' if explicit else ''}has {'CUDA' if key == 'min_cuda' else 'ROCm'}.",
            )
    candidates = [m for m in pool if _meets_constraints(m, f)]
    if not candidates:
        raise _fail(
            "gpu_models" if explicit else "gpu_vendor" if f["gpu_vendor"] else "min_gpu_memory_gib",
            "No GPU model in the catalog meets these requirements.",
        )
    unschedulable = [m for m in candidates if m.vendor not in SCHEDULABLE_VENDORS]
    candidates = [m for m in candidates if m.vendor in SCHEDULABLE_VENDORS]
    if not candidates:
        names = ", ".join(m.name for m in unschedulable)
        raise _fail("gpu_models", f"{names}: this vendor's GPUs cannot be scheduled yet.")
    min_driver_check(f, {m.vendor for m in candidates})

    # Plan, reservation and priority.
    f["plan"] = _str(spec, "plan", 16, Plan.ON_DEMAND) or Plan.ON_DEMAND
    if f["plan"] not in Plan.values:
        raise _fail("plan", f"One of {', '.join(Plan.values)}.")
    reservation = None
    if f["plan"] == Plan.RESERVED:
        rid = spec.get("reservation")
        if rid is None:
            raise _fail("reservation", "The reserved plan needs a reservation.")
        if isinstance(rid, bool) or not isinstance(rid, int):
            raise _fail("reservation", "Must be a reservation id.")
        now = timezone.now()
        reservation = (
            Reservation.objects.for_tenant(tenant)
            .select_related("gpu_model", "region")
            .filter(pk=rid, status=ReservationStatus.ACTIVE, ends_at__gt=now)
            .first()
        )
        if reservation is None:
            raise _fail("reservation", "No active reservation of yours with this id.")
        if reservation.gpu_model not in candidates:
            raise _fail("gpu_models", f"Reservation {rid} is for {reservation.gpu_model.name}.")
        candidates = [reservation.gpu_model]
        explicit = [reservation.gpu_model]
    elif spec.get("reservation") is not None:
        raise _fail("reservation", "Only the reserved plan draws from a reservation.")
    f["priority_class"] = _str(spec, "priority_class", 16)
    if f["priority_class"]:
        if f["priority_class"] not in PriorityClass.values:
            raise _fail("priority_class", f"One of {', '.join(PriorityClass.values)}.")
        if (
            PLAN_PRIORITY_RANK[PriorityClass(f["priority_class"])]
            > PLAN_PRIORITY_RANK[PriorityClass(f["plan"])]
        ):
            raise _fail("priority_class", f"The {f['plan']} plan runs at most at its own priority.")

    # Region.
    region = None
    code = _str(spec, "region", 32)
    if reservation is not None:
        if code and code != reservation.region.code:
            raise _fail("region", f"Reservation {reservation.pk} is in {reservation.region.code}.")
        region = reservation.region
    elif code:
        region = Region.objects.filter(code=code).first()
        if region is None:
            raise _fail("region", f"Unknown region {code!r}.")
    f["other_regions_ok"] = _bool(spec, "other_regions_ok", True) and reservation is None
    volumes = volumes_validate(tenant=tenant, spec=spec)
    if volumes:
        # The workload goes where its volumes are, and nowhere else.
        home = volumes[0].volume.region
        if region is not None and region.pk != home.pk:
            raise _fail("region", f"Its volumes are in {home.code}; it runs only there.")
        region, f["other_regions_ok"] = home, False

    # Count, gang, fraction, MIG.
    f["gang"] = _bool(spec, "gang", False)
    f["gpu_count"] = _int(spec, "gpu_count", 1, 1, 4096)
    f["mig_profile"] = _rule(check_mig_profile, _str(spec, "mig_profile", 32))
    fraction = _int(spec, "gpu_fraction_milli", None, 1, MILLI)
    if f["mig_profile"]:
        match = MIG_PROFILE_RE.match(f["mig_profile"])
        tables = {m.name: table_for(m.name) for m in candidates}
        lacking = [
            m.name
            for m in candidates
            if f["mig_profile"] not in (m.mig_profiles or [])
            or tables[m.name] is None
            or tables[m.name].profile(f["mig_profile"]) is None  # type: ignore[union-attr]
        ]
        if match is None or lacking:
            raise _fail("mig_profile", f"Not a MIG profile of {', '.join(lacking) or 'these GPUs'}.")
        # The instance's share of its GPU: its compute slices of the GPU's (7; 4 on an A30).
        table = next((t for t in tables.values() if t is not None), None)
        mig_fraction = (
            table.fraction_milli(f["mig_profile"]) if table is not None else int(match.group(1)) * MILLI // 7
        )
        if fraction is not None and fraction != mig_fraction:
            raise _fail("gpu_fraction_milli", f"The MIG profile {f['mig_profile']} is {mig_fraction}/1000.")
        fraction = mig_fraction
    f["gpu_fraction_milli"] = MILLI if fraction is None else fraction
    if f["gpu_fraction_milli"] < MILLI and f["gpu_count"] != 1:
        raise _fail("gpu_fraction_milli", "A fraction applies to exactly one GPU.")
    if f["gang"] and f["gpu_fraction_milli"] < MILLI:
        raise _fail("gang", "A gang takes whole nodes, not fractions.")
    f["gpus_per_node"] = _gpus_per_node(spec)
    f["split_regions_ok"] = _bool(spec, "split_regions_ok", False)
    if f["gpus_per_node"]:
        if f["gang"]:
            raise _fail(
                "gpus_per_node", "A gang takes whole nodes; gpus_per_node is for splitting otherwise."
            )
        if f["gpu_fraction_milli"] < MILLI:
            raise _fail("gpus_per_node", "Only whole GPUs are split over nodes.")
        if not any(f["gpu_count"] % k == 0 for k in f["gpus_per_node"]):
            raise _fail("gpus_per_node", f"No size of these divides gpu_count ({f['gpu_count']}).")
    elif f["split_regions_ok"]:
        raise _fail("split_regions_ok", "Only for work split over nodes (gpus_per_node).")
    if not f["gang"] and not f["gpus_per_node"] and f["gpu_count"] > MAX_GPUS_PER_NODE:
        raise _fail("gpu_count", f"At most {MAX_GPUS_PER_NODE} on one node; more needs a gang across nodes.")
    _validate_elastic(spec, kind, f)

    # CPU and RAM.
    f["cpu_millicores"] = _int(spec, "cpu_millicores", 0, 0, 10_000_000)
    f["ram_mib"] = _int(spec, "ram_mib", 0, 0, 1 << 40)

    # Against the fleet: some node must be able to hold it. The shapes may be a few seconds old
    # (_fleet_nodes): a request is refused only on what the fleet is now. A Slurm region's
    # cluster decides for itself (its own checks are in _validate_slurm).
    no_agent_node: ValidationFailed | None = None
    if region is not None and region.backend == RegionBackend.SLURM:
        f["other_regions_ok"] = False
    else:
        try:
            try:
                _check_fleet(f, region, _fleet_nodes(candidates))
            except ValidationFailed:
                _check_fleet(f, region, _fleet_nodes(candidates, fresh=True))
        except ValidationFailed as exc:
            if region is not None:
                raise
            # A job naming no region may still go to a Slurm region (checked once all is known).
            no_agent_node = exc
        if f["elastic_max_gpus"] is not None:
            # Its maximum must fit one node of an acceptable model (what it may grow to).
            try:
                _check_fleet(
                    {**f, "gpu_count": f["elastic_max_gpus"]}, region, _fleet_nodes(candidates, fresh=True)
                )
            except ValidationFailed as exc:
                raise _fail("elastic", f"max_gpus: {exc.message}") from None

    # Spot price.
    f["spot_max_price"] = _decimal(spec, "spot_max_price")
    if f["spot_max_price"] is not None:
        if f["plan"] != Plan.SPOT:
            raise _fail("spot_max_price", "Only spot requests name a maximum price.")
        floor = min(spot_price_floor(gpu_model=m, region=region) for m in candidates)
        if f["spot_max_price"] < floor:
            raise _fail("spot_max_price", f"Below the spot price floor of {floor}.")
        if f["spot_max_price"].as_tuple().exponent < -10:
            raise _fail("spot_max_price", "At most 10 decimal places.")

    f.update(_validate_what_runs(spec, tenant))
    if f["gang"] or f["gpus_per_node"] or f["elastic_min_gpus"] is not None:
        clash = [k for k in GANG_ENV_NAMES if k in f["env"]]
        if clash:
            raise _fail("env", f"{clash[0]} is set by the platform for a gang or an elastic job.")
    f["max_runtime_s"] = _int(spec, "max_runtime_s", None, 60, 366 * 86400)
    f["estimated_runtime_s"] = _int(spec, "estimated_runtime_s", None, 1, 366 * 86400)
    f["requeue_on_preemption"] = _bool(spec, "requeue_on_preemption", True)
    f["checkpoint_resume"] = _bool(spec, "checkpoint_resume", False)
    f["max_retries"] = _int(spec, "max_retries", 0, 0, 100)
    if f["checkpoint_resume"] and not volumes:
        raise _fail("checkpoint_resume", "Checkpoints need a volume: attach one (volumes).")
    work = _validate_array(spec, kind, f, volumes)
    f.update(placement_validate(tenant=tenant, spec=spec, f=f, candidates=candidates))
    depends_on = dependencies_validate(tenant=tenant, raw=spec.get("depends_on"))
    if depends_on and kind != WorkloadKind.JOB:
        raise _fail("depends_on", "Jobs only.")
    if kind == WorkloadKind.INSTANCE:
        if not f["image"] and not f["template"]:
            raise _fail("image", "An instance needs an image or a template.")
        if f["estimated_runtime_s"] is not None:
            raise _fail("estimated_runtime_s", "Jobs only.")
    else:
        if not f["image"]:
            raise _fail("image", "A job needs an image.")
        if not f["command"]:
            raise _fail("command", "A job needs a command.")
        if f["ssh_public_key"] or f["ports"]:
            raise _fail("ssh_public_key" if f["ssh_public_key"] else "ports", "Instances only.")
    if no_agent_node is not None:
        from scheduling.services.slurm_route import slurm_region_could_run

        fields = {**f, "kind": kind, "volumes": bool(volumes), "reservation": reservation is not None}
        if slurm_region_could_run(fields, candidates) is None:
            raise no_agent_node
    if region is not None and region.backend == RegionBackend.SLURM:
        _validate_slurm(f, kind=kind, region=region, candidates=candidates, explicit=explicit, work=work)
        if reservation is not None:
            raise _fail("reservation", "Reservations are not made in Slurm regions.")
        if volumes:
            raise _fail(
                "volumes", "Volumes are not mounted in Slurm regions (use the cluster's filesystems)."
            )
    return f, _Resolved(
        models=explicit,
        model_names=[m.name for m in catalog if m in explicit],
        candidates=candidates,
        region=region,
        reservation=reservation,
        volumes=volumes,
        depends_on=depends_on,
        work=work,
    )


def _validate_slurm(
    f: dict[str, Any], *, kind: str, region: Region, candidates: list[GpuModel], explicit: list, work
) -> None:
    """What a Slurm region runs: batch jobs of whole GPUs, on one node or across nodes, which Slurm
    places (``scheduling.services.slurm``). What Slurm cannot be told is refused here, naming the
    field."""
    if kind != WorkloadKind.JOB:
        raise _fail("region", f"{region.code} is a Slurm region: it runs jobs, not instances.")
    if f["gpu_fraction_milli"] < MILLI or f["mig_profile"]:
        raise _fail("gpu_fraction_milli", "Slurm allocates whole GPUs (GRES), not fractions or MIG slices.")
    if work is not None:
        raise _fail("work", "Work queues are not served to Slurm jobs.")
    if f["checkpoint_resume"]:
        raise _fail("checkpoint_resume", "Checkpoints need a volume, and Slurm regions have none.")
    if f["elastic_min_gpus"] is not None:
        raise _fail("elastic", "Slurm jobs keep the GPUs they start with: no elastic jobs in Slurm regions.")
    if any(isinstance(v, dict) for v in f["env"].values()):
        raise _fail("env", "Secrets are not handed to Slurm (its job records keep the environment).")
    if f["max_retries"] and f["array_count"] is not None:
        # A Slurm array's task is not resubmitted alone (a job's retries are: new Slurm jobs).
        raise _fail("max_retries", "An array's tasks are not retried in Slurm regions.")
    config = slurm_config_parse(region.slurm)
    if explicit and not any(m.name in config.gres_types for m in candidates):
        raise _fail("gpu_models", f"No GRES type of {region.code} is one of these models.")
    if f["gang"] or f["gpus_per_node"]:
        # One multi-node Slurm job (--nodes, GRES per node): a node shape of the region's
        # inventory, of the model its GRES will be, must divide the count.
        from scheduling.services.slurm_jobs import slurm_gang_shape, slurm_node_sizes

        model = next((m for m in candidates if m.name in config.gres_types), None)
        sizes = slurm_node_sizes(region=region, model=model, partition=config.partition(f["plan"]))
        shape = slurm_gang_shape(
            gpu_count=f["gpu_count"], gang=f["gang"], gpus_per_node=f["gpus_per_node"], sizes=sizes
        )
        if shape is None:
            name = "gang" if f["gang"] else "gpus_per_node"
            have = ", ".join(map(str, sorted(set(sizes)))) or "none"
            raise _fail(
                name,
                f"No node shape of {region.code} divides {f['gpu_count']} GPUs"
                f" ({model.name if model else 'no mapped model'} per node: {have}).",
            )


# --- quotas ----------------------------------------------------------------------------------------


def _check_quota(quota: Quota, usage: QuotaUsage, f: dict[str, Any], candidates: list[GpuModel]) -> None:
    """An array counts as the tasks it may run at once (its parallelism)."""

    def refuse(name: str, limit: int, in_use: Any, requested: Any, unit: str) -> QuotaExceeded:
        return QuotaExceeded(
            f"Quota {name} exceeded: limit {limit} {unit}, in use {in_use}, this request {requested}.",
            fields={"quota": name, "limit": limit, "in_use": in_use, "requested": requested},
        )

    task_milli = f["gpu_count"] * f["gpu_fraction_milli"]
    if quota.max_gpus_per_request is not None and Decimal(task_milli) / MILLI > quota.max_gpus_per_request:
        raise refuse(
            "max_gpus_per_request", quota.max_gpus_per_request, 0, Decimal(task_milli) / MILLI, "GPUs"
        )
    if (
        quota.max_gpus_per_request is not None
        and f.get("elastic_max_gpus") is not None
        and f["elastic_max_gpus"] > quota.max_gpus_per_request
    ):
        # An elastic job may grow to its maximum: that is the size it asks for.
        raise refuse("max_gpus_per_request", quota.max_gpus_per_request, 0, f["elastic_max_gpus"], "GPUs")
    copies = f.get("array_parallelism") or 1
    milli = task_milli * copies
    gpus = Decimal(milli) / MILLI
    if (
        quota.max_concurrent_workloads is not None
        and usage.workloads + copies > quota.max_concurrent_workloads
    ):
        raise refuse(
            "max_concurrent_workloads", quota.max_concurrent_workloads, usage.workloads, copies, "workloads"
        )
    if quota.max_gpus_total is not None and usage.gpu_milli + milli > quota.max_gpus_total * MILLI:
        raise refuse("max_gpus_total", quota.max_gpus_total, usage.gpus, gpus, "GPUs")
    if (
        f["plan"] == Plan.SPOT
        and quota.max_spot_gpus is not None
        and usage.spot_gpu_milli + milli > quota.max_spot_gpus * MILLI
    ):
        raise refuse("max_spot_gpus", quota.max_spot_gpus, usage.spot_gpus, gpus, "GPUs")
    limits = {lim.gpu_model_id: lim.max_gpus for lim in quota.model_limits.all()}
    if limits:
        # Admitted when at least one acceptable model has room; the cycle then places it only on
        # models with room (scheduling.services.cycle).
        blocked = []
        for m in candidates:
            limit = limits.get(m.pk)
            if limit is None or usage.model_milli.get(m.pk, 0) + milli <= limit * MILLI:
                return
            blocked.append((m, limit))
        m, limit = blocked[0]
        in_use = Decimal(usage.model_milli.get(m.pk, 0)) / MILLI
        raise refuse(f"max_gpus[{m.name}]", limit, in_use, gpus, "GPUs")


# --- the service -----------------------------------------------------------------------------------


def workload_submit(*, tenant, kind: str, spec: dict[str, Any], actor: Actor) -> Workload:
    """Validate ``spec`` (see the API's InstanceCreate/JobCreate), check quotas and admission, and
    store a PENDING workload; a scheduling cycle is requested when the transaction commits."""
    f, resolved = _validate(tenant=tenant, kind=kind, spec=spec)
    now = timezone.now()
    with transaction.atomic():
        quota = lock_quota(tenant=tenant)
        _check_quota(quota, quota_usage(tenant=tenant), f, resolved.candidates)
        workload = Workload(
            tenant=tenant,
            region=resolved.region,
            reservation=resolved.reservation,
            state=WorkloadState.PENDING,
            submitted_at=now,
            state_changed_at=now,
            pending_reason="submitted",
            pending_message="Waiting for the next scheduling cycle.",
            **f,
        )
        workload._spec_models = resolved.models
        workload._spec_candidates = resolved.candidates
        # What its detail shows beyond its columns, known here: the API answers the submission from
        # this instance (scheduling.api.submitted_detail) without reading these again.
        workload.submitted = Submitted(
            gpu_model_names=resolved.model_names,
            no_volumes=not resolved.volumes,
            no_dependencies=not resolved.depends_on,
        )
        run_admission_checks(tenant=tenant, workload=workload, actor=actor)
        workload.save()
        with log_context(workload_id=workload.pk):  # what is logged about it from here on
            volumes_attach(tenant=tenant, workload=workload, requests=resolved.volumes)
            dependencies_attach(tenant=tenant, workload=workload, deps=resolved.depends_on)
            if resolved.work is not None:
                work_items_create(job=workload, spec=resolved.work)
            if resolved.models:
                workload.gpu_models.add(*resolved.models)  # a new row: nothing to read first
            WorkloadEvent.objects.create(
                tenant=tenant,
                workload=workload,
                at=now,
                from_state="",
                to_state=WorkloadState.PENDING,
                reason="submitted",
                actor_repr=str(actor)[:200],
            )
            if actor.kind != "system":
                audit_record(
                    tenant=tenant,
                    actor=actor,
                    action=f"{kind}.submit",
                    target=workload,
                    data={"plan": workload.plan, "gpu_count": workload.gpu_count}
                    | ({"array_count": workload.array_count} if workload.is_array else {}),
                )
            publish(
                tenant_id=tenant.pk,
                event={
                    "type": "workload.state",
                    "workload_id": workload.pk,
                    "kind": kind,
                    "from": "",
                    "to": WorkloadState.PENDING,
                    "reason": "submitted",
                    "at": now.isoformat(),
                },
            )
            from scheduling.services.triggers import cycle_request

            cycle_request(reason="submit")
            logger.info(
                "%s %s submitted (%s, %s GPU(s))", kind, workload.pk, workload.plan, workload.gpu_count
            )
    return workload
