"""Reads shared by the API, the web UI and the services."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from django.db import connection
from django.db.models import QuerySet

from nodes.models import SCHEDULABLE_NODE_STATES, Gpu, GpuHealth, GpuModel, Node, Region
from scheduling.models import (
    ACTIVE_STATES,
    HOLDING_STATES,
    MILLI,
    WAITING_STATES,
    Allocation,
    Plan,
    Quota,
    Reservation,
    Volume,
    VolumeState,
    Workload,
    WorkloadEvent,
    WorkloadLogLine,
    WorkloadVolume,
)


@dataclass
class QuotaUsage:
    workloads: int = 0
    gpu_milli: int = 0
    spot_gpu_milli: int = 0
    model_milli: dict[int, int] = field(default_factory=dict)
    largest_request_milli: int = 0
    """The largest request counted now (what ``max_gpus_per_request`` limits)."""

    @property
    def gpus(self) -> Decimal:
        return Decimal(self.gpu_milli) / MILLI

    @property
    def spot_gpus(self) -> Decimal:
        return Decimal(self.spot_gpu_milli) / MILLI

    @property
    def largest_request_gpus(self) -> Decimal:
        return Decimal(self.largest_request_milli) / MILLI


def _col(model, name: str, alias: str = "") -> str:
    """A field's column for hand-written SQL, quoted, after ``alias`` (``"w."``) if given."""
    return f"{alias}{connection.ops.quote_name(model._meta.get_field(name).column)}"


def _table(model) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def _quota_usage_sql(tenants: int | None) -> str:
    """One statement: a row per tenant for its workloads (kind 0), and a row per tenant and GPU
    model (kind 1) for its allocations and for its waiting requests that accept that model only."""
    choice = Workload.gpu_models.through

    def only(column: str) -> str:
        return "" if tenants is None else f"AND {column} IN ({', '.join(['%s'] * tenants)})"

    active = ", ".join(["%s"] * len(ACTIVE_STATES))
    waiting = ", ".join(["%s"] * len(WAITING_STATES))
    tenant, state, plan = _col(Workload, "tenant"), _col(Workload, "state"), _col(Workload, "plan")
    # An array job is counted by its tasks, never itself.
    tasks, w_tasks = _col(Workload, "array_count"), _col(Workload, "array_count", "w.")
    milli = f"{_col(Workload, 'gpu_count')} * {_col(Workload, 'gpu_fraction_milli')}"
    a_tenant, a_model = _col(Allocation, "tenant"), _col(Allocation, "gpu_model")
    w_id, w_tenant, w_state = (
        _col(Workload, "id", "w."),
        _col(Workload, "tenant", "w."),
        _col(Workload, "state", "w."),
    )
    w_milli = f"{_col(Workload, 'gpu_count', 'w.')} * {_col(Workload, 'gpu_fraction_milli', 'w.')}"
    m_workload, m_model = _col(choice, "workload", "m."), _col(choice, "gpumodel", "m.")
    return f"""
        SELECT 0, {tenant}, NULL, COUNT(*), SUM({milli}),
               SUM(CASE WHEN {plan} = %s THEN {milli} ELSE 0 END), MAX({milli})
          FROM {_table(Workload)} WHERE {state} IN ({active}) AND {tasks} IS NULL {only(tenant)}
         GROUP BY {tenant}
        UNION ALL
        SELECT 1, {a_tenant}, {a_model}, NULL, SUM({_col(Allocation, "fraction_milli")}), NULL, NULL
          FROM {_table(Allocation)} WHERE {_col(Allocation, "ended_at")} IS NULL {only(a_tenant)}
         GROUP BY {a_tenant}, {a_model}
        UNION ALL
        SELECT 1, tenant_id, model_id, NULL, SUM(milli), NULL, NULL FROM (
            SELECT {w_tenant} AS tenant_id, MIN({m_model}) AS model_id, MIN({w_milli}) AS milli
              FROM {_table(Workload)} w INNER JOIN {_table(choice)} m ON {m_workload} = {w_id}
             WHERE {w_state} IN ({waiting}) AND {w_tasks} IS NULL {only(w_tenant)}
             GROUP BY {w_tenant}, {w_id} HAVING COUNT(*) = 1
        ) single GROUP BY tenant_id, model_id"""


def quota_usage_by_tenant(*, tenant_ids: Iterable[int] | None = None) -> dict[int, QuotaUsage]:
    """What counts against each tenant's quotas now (only tenants with something counted): every
    workload that is waiting or holds GPUs. Per model: GPUs allocated on that model, plus waiting
    requests that accept that model only.

    One statement, summed by the database, whatever the number of tenants (a union of three
    aggregates, which the ORM cannot say as one query)."""
    ids = None if tenant_ids is None else list(tenant_ids)
    if ids == []:
        return {}
    only = [] if ids is None else ids
    params = [
        Plan.SPOT,
        *sorted(ACTIVE_STATES),
        *only,
        *only,
        *sorted(WAITING_STATES),
        *only,
    ]
    out: dict[int, QuotaUsage] = {}
    per_model: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    with connection.cursor() as cursor:
        cursor.execute(_quota_usage_sql(None if ids is None else len(ids)), params)
        rows = cursor.fetchall()
    for kind, tenant_id, model_id, n, milli, spot, big in rows:
        if kind == 0:
            out[tenant_id] = QuotaUsage(
                workloads=n,
                gpu_milli=int(milli or 0),
                spot_gpu_milli=int(spot or 0),
                largest_request_milli=big or 0,
            )
        else:
            per_model[tenant_id][model_id] += int(milli)
    for tenant_id, models in per_model.items():
        out.setdefault(tenant_id, QuotaUsage()).model_milli = dict(models)
    return out


def quota_usage(*, tenant) -> QuotaUsage:
    """What counts against ``tenant``'s quotas now (``quota_usage_by_tenant`` for one tenant)."""
    return quota_usage_by_tenant(tenant_ids=[tenant.pk]).get(tenant.pk) or QuotaUsage()


def quota_for_tenant(*, tenant) -> Quota | None:
    return Quota.objects.for_tenant(tenant).prefetch_related("model_limits__gpu_model").first()


def workloads_for_tenant(*, tenant, kind: str | None = None) -> QuerySet[Workload]:
    qs = Workload.objects.for_tenant(tenant).select_related("region").prefetch_related("gpu_models")
    return qs.filter(kind=kind) if kind else qs


def workload_events(*, workload: Workload) -> QuerySet[WorkloadEvent]:
    return WorkloadEvent.objects.filter(workload=workload).order_by("at", "id")


def workload_gpu_model_names(*, workload_ids: Iterable[int]) -> dict[int, list[str]]:
    """The GPU models each workload may run on, by name in the catalog's order: one statement over
    the many-to-many table, for a page of workloads at once. Raw SQL (names from ``_meta``): every
    workload read makes it, and the ORM's ``values_list`` over the join cost more to compile than to
    run."""
    names: dict[int, list[str]] = defaultdict(list)
    ids = list(workload_ids)
    if not ids:
        return names
    with connection.cursor() as cursor:
        cursor.execute(_model_names_statement(len(ids)), ids)
        for workload_id, name in cursor.fetchall():
            names[workload_id].append(name)
    return names


@functools.lru_cache(maxsize=64)
def _model_names_statement(count: int) -> str:
    q = connection.ops.quote_name
    through = Workload.gpu_models.through._meta
    model = GpuModel._meta
    workload, gpu_model = (q(through.get_field(n).column) for n in ("workload", "gpumodel"))
    return (
        f"SELECT t.{workload}, m.{q(model.get_field('name').column)} FROM {q(through.db_table)} t"
        f" JOIN {q(model.db_table)} m ON m.{q(model.pk.column)} = t.{gpu_model}"
        f" WHERE t.{workload} IN ({', '.join(['%s'] * count)})"
        f" ORDER BY m.{q(model.get_field('vendor').column)}, m.{q(model.get_field('name').column)}"
    )


def workload_placement(*, workload: Workload) -> list[dict]:
    """Where a workload holds GPUs now: node, GPU index, share. Only a workload in a holding state
    has any (its allocations are released when it leaves them, ``services.states``): for the others
    (just submitted, waiting, finished) no query."""
    if workload.state not in HOLDING_STATES:
        return []
    return list(
        Allocation.objects.filter(workload=workload, ended_at__isnull=True)
        .order_by("node_id", "gpu__index")
        .values(
            "node__hostname",
            "node__region__code",
            "gpu__index",
            "gpu_model__name",
            "fraction_milli",
            # how to get into it (scheduling.selectors.access), in the same query
            "node__address",
            "node__simulated",
            "node__ssh_port",
            "node__ssh_host_key",
        )
    )


def live_volumes(*, tenant):
    """The tenant's volumes that are not deleted, with their regions, newest first."""
    return Volume.objects.for_tenant(tenant).exclude(state=VolumeState.DELETED).select_related("region")


@functools.cache
def _volume_rows() -> QuerySet:
    """Attached volumes as ``workload_volumes`` reads them, built once per process (its names
    resolved once; each call narrows a clone): every workload detail makes this read."""
    return WorkloadVolume.objects.order_by("position").values_list(
        "volume_id", "volume__name", "mount_path", "shared"
    )


def workload_volumes(*, workload: Workload) -> list[dict]:
    """The volumes attached to a workload: id, name, mount path, shared, first (checkpoints) first."""
    return [
        {"volume": vid, "name": name, "mount_path": path, "shared": shared}
        for vid, name, path, shared in _volume_rows().filter(workload=workload)
    ]


def workload_unconfirmed_stops(*, workload: Workload) -> list[str]:
    """Hostnames of the nodes where the workload was released without their word (stop timeout,
    forced preemption, node down) and that have not yet reported it gone."""
    return list(
        Allocation.objects.filter(
            workload=workload, stop_forced_at__isnull=False, stop_confirmed_at__isnull=True
        )
        .order_by("node__hostname")
        .values_list("node__hostname", flat=True)
        .distinct()
    )


def reservations_for_tenant(*, tenant) -> QuerySet[Reservation]:
    return Reservation.objects.for_tenant(tenant).select_related("gpu_model", "region")


@dataclass
class RegionAvailability:
    region: str
    total_gpus: int = 0
    schedulable_gpus: int = 0
    free_gpus: int = 0
    free_milli: int = 0


def gpu_availability() -> dict[int, dict[str, RegionAvailability]]:
    """Per GPU model, per region: GPUs in the fleet, schedulable now (READY node, healthy, not
    isolated), wholly free and free capacity in thousandths. One statement, aggregated in the
    database: the active allocations summed per GPU once, joined to the GPUs (a fleet's GPUs are
    thousands of rows; the answer is a row per model and region)."""
    states = sorted(SCHEDULABLE_NODE_STATES)
    g, n, r, a = "g.", "n.", "r.", Allocation
    sql = f"""
        WITH used AS (
            SELECT {_col(a, "gpu")} AS gpu_id, SUM({_col(a, "fraction_milli")}) AS m FROM {_table(a)}
            WHERE {_col(a, "ended_at")} IS NULL GROUP BY {_col(a, "gpu")}
        ), gpus AS (
            SELECT {_col(Gpu, "model", g)} AS model_id, {_col(Region, "code", r)} AS code,
                   CASE WHEN {_col(Node, "state", n)} IN ({", ".join(["%s"] * len(states))})
                             AND {_col(Gpu, "health", g)} = %s AND {_col(Gpu, "isolated", g)} = %s
                        THEN 1 ELSE 0 END AS ok,
                   COALESCE(u.m, 0) AS m
            FROM {_table(Gpu)} g
            JOIN {_table(Node)} n ON {_col(Node, "id", n)} = {_col(Gpu, "node", g)}
            JOIN {_table(Region)} r ON {_col(Region, "id", r)} = {_col(Node, "region", n)}
            LEFT JOIN used u ON u.gpu_id = {_col(Gpu, "id", g)}
            WHERE {_col(Gpu, "removed_at", g)} IS NULL AND {_col(Gpu, "model", g)} IS NOT NULL
        )
        SELECT model_id, code, COUNT(*), SUM(ok),
               SUM(CASE WHEN ok = 1 AND m <= 0 THEN 1 ELSE 0 END),
               SUM(CASE WHEN ok = 0 OR m >= {MILLI} THEN 0 WHEN m <= 0 THEN {MILLI} ELSE {MILLI} - m END)
        FROM gpus GROUP BY model_id, code
    """
    out: dict[int, dict[str, RegionAvailability]] = defaultdict(dict)
    with connection.cursor() as cur:
        cur.execute(sql, [*states, GpuHealth.HEALTHY, False])
        for model_id, code, total, schedulable, free, free_milli in cur.fetchall():
            out[model_id][code] = RegionAvailability(
                region=code,
                total_gpus=total,
                schedulable_gpus=schedulable or 0,
                free_gpus=free or 0,
                free_milli=free_milli or 0,
            )
    return out


def gpu_catalog() -> QuerySet[GpuModel]:
    return GpuModel.objects.all()


def workload_log_lines(
    *, workload: Workload, since: int | None = None, tail: int = 100
) -> tuple[list[tuple[int, datetime, str, str]], int]:
    """``(lines, next)``: with ``since``, the first ``tail`` lines after that cursor, oldest first
    (page forward until none come back); without it, the last ``tail`` lines. Each line is
    ``(cursor, at, stream, text)``; ``next`` is the cursor to ask ``since`` next."""
    qs = WorkloadLogLine.objects.filter(workload=workload).values_list("id", "at", "stream", "text")
    if since is not None:
        rows = list(qs.filter(id__gt=since).order_by("id")[:tail])
    else:
        rows = list(qs.order_by("-id")[:tail])
        rows.reverse()
    return rows, rows[-1][0] if rows else (since or 0)


def workloads_holding_gpu(*, gpu_id: int) -> list[str]:
    """Ids of the workloads with an open allocation on a GPU, or one released without its node's word
    that the GPU may still run (a staff MIG change waits for none)."""
    held = set(Allocation.objects.active().filter(gpu_id=gpu_id).values_list("workload_id", flat=True))
    held.update(
        Allocation.objects.filter(
            gpu_id=gpu_id, stop_forced_at__isnull=False, stop_confirmed_at__isnull=True
        ).values_list("workload_id", flat=True)
    )
    return [str(w) for w in sorted(held)]
