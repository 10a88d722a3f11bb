"""Quotas for many tenants at once: each tenant's limits beside what counts against them now.

The counting is the one submissions enforce (``scheduling.selectors.shared.quota_usage_by_tenant``), for a
page of tenants at one query per aggregate, not one per tenant.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.conf import settings

from nodes.models import GpuModel
from portal.models import AuditEvent, Tenant
from scheduling.models import (
    MILLI,
    Quota,
    QuotaModelLimit,
)
from scheduling.selectors.shared import QuotaUsage, quota_usage_by_tenant

# The per-tenant limits staff edit, in display order (per-model limits come on their own).
LIMIT_FIELDS = ("max_gpus_total", "max_concurrent_workloads", "max_spot_gpus", "max_gpus_per_request")
LIMIT_LABELS = {
    "max_gpus_total": "GPUs in total",
    "max_concurrent_workloads": "Concurrent workloads",
    "max_spot_gpus": "Spot GPUs",
    "max_gpus_per_request": "GPUs per request",
    "fair_share_weight": "Fair-share weight",
}
QUOTA_AUDIT_ACTION = "quota.update"


def use_of(name: str, usage: QuotaUsage) -> Decimal | int:
    """What counts against limit ``name`` now (GPUs as Decimals, workloads as an int)."""
    if name == "max_gpus_total":
        return usage.gpus
    if name == "max_concurrent_workloads":
        return usage.workloads
    if name == "max_spot_gpus":
        return usage.spot_gpus
    if name == "max_gpus_per_request":
        return usage.largest_request_gpus
    raise KeyError(name)


def model_use_of(model_id: int, usage: QuotaUsage) -> Decimal:
    return Decimal(usage.model_milli.get(model_id, 0)) / MILLI


@dataclass
class Limit:
    name: str
    label: str
    limit: Any  # None: no limit
    use: Decimal | int

    @property
    def status(self) -> str:
        """'' (room left), 'full' (at the limit) or 'over' (the limit is below what counts now)."""
        if self.limit is None:
            return ""
        if self.use > self.limit:
            return "over"
        return "full" if self.use == self.limit else ""

    @property
    def percent(self) -> int | None:
        if not self.limit:
            return None
        return min(100, int(Decimal(self.use) * 100 / self.limit))


@dataclass
class QuotaRow:
    tenant: Tenant
    quota: Quota | None  # None: the tenant has no row yet; the defaults apply
    usage: QuotaUsage
    limits: list[Limit]
    model_limits: list[Limit] = field(default_factory=list)
    fair_share_weight: Decimal = Decimal("1.00")

    @property
    def status(self) -> str:
        states = {lim.status for lim in (*self.limits, *self.model_limits)}
        return "over" if "over" in states else "full" if "full" in states else ""


def quota_limits(quota: Quota | None) -> dict[str, Any]:
    """The limits in force: the quota row's, or the defaults a tenant without a row gets."""
    if quota is None:
        return {name: settings.SCHEDULING_DEFAULT_QUOTA.get(name) for name in LIMIT_FIELDS}
    return {name: getattr(quota, name) for name in LIMIT_FIELDS}


def quota_rows(*, tenants: Iterable[Tenant], usage: dict[int, QuotaUsage] | None = None) -> list[QuotaRow]:
    """Each tenant's limits beside its use: three queries for the usage (unless given), one for the
    quota rows, one for the per-model limits and one for the catalog names."""
    tenants = list(tenants)
    ids = [t.pk for t in tenants]
    if usage is None:
        usage = quota_usage_by_tenant(tenant_ids=ids)
    quotas = {q.tenant_id: q for q in Quota.objects.filter(tenant_id__in=ids)}
    per_model: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for tenant_id, model_id, limit in (
        QuotaModelLimit.objects.filter(quota__tenant_id__in=ids)
        .order_by("gpu_model_id")
        .values_list("quota__tenant_id", "gpu_model_id", "max_gpus")
    ):
        per_model[tenant_id].append((model_id, limit))
    names = dict(GpuModel.objects.values_list("pk", "name")) if per_model else {}
    rows = []
    for t in tenants:
        u = usage.get(t.pk) or QuotaUsage()
        quota = quotas.get(t.pk)
        limits = quota_limits(quota)
        rows.append(
            QuotaRow(
                tenant=t,
                quota=quota,
                usage=u,
                limits=[Limit(n, LIMIT_LABELS[n], limits[n], use_of(n, u)) for n in LIMIT_FIELDS],
                model_limits=[
                    Limit(f"max_gpus[{names.get(m, m)}]", names.get(m, str(m)), lim, model_use_of(m, u))
                    for m, lim in per_model.get(t.pk, [])
                ],
                fair_share_weight=quota.fair_share_weight if quota is not None else Decimal("1.00"),
            )
        )
    return rows


def quota_audit_trail(*, tenant: Tenant | None = None, limit: int = 50) -> list[AuditEvent]:
    """The latest quota changes (every tenant's, or one tenant's), newest first."""
    qs = AuditEvent.objects.filter(action=QUOTA_AUDIT_ACTION)
    if tenant is not None:
        qs = qs.for_tenant(tenant)
    return list(qs.select_related("tenant").order_by("-created", "-id")[:limit])
