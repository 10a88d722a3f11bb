"""Admission checks metering plugs into scheduling (registered in ``MeteringConfig.ready``)."""

from __future__ import annotations

from decimal import Decimal

from metering.models import Budget
from metering.money import quantize_money
from metering.selectors.shared import hourly_estimate, month_cost_to_date
from scheduling.admission import AdmissionRefused


def suspended_tenant_check(*, tenant, workload, actor) -> None:
    if not tenant.is_active:
        reason = f": {tenant.suspended_reason}" if tenant.suspended_reason else ""
        raise AdmissionRefused(
            f"Tenant {tenant.slug} is suspended{reason}; new workloads are refused.", code="tenant_suspended"
        )


def workload_estimate(*, tenant, workload) -> Decimal:
    """What the workload may cost: its hourly price for its plan times its maximum runtime (or its
    estimated runtime, or one hour)."""
    models = list(getattr(workload, "_spec_models", None) or [])
    if not models:
        return Decimal(0)
    per_hour = hourly_estimate(
        tenant=tenant,
        gpu_models=models,
        gpu_count=workload.gpu_count,
        fraction_milli=workload.gpu_fraction_milli,
        cpu_millicores=workload.cpu_millicores,
        ram_mib=workload.ram_mib,
    ).get(workload.plan)
    if per_hour is None:
        return Decimal(0)
    if workload.plan == "spot" and workload.spot_max_price is not None:
        per_hour = min(
            per_hour, workload.spot_max_price * workload.gpu_count * workload.gpu_fraction_milli / 1000
        )
    seconds = workload.max_runtime_s or workload.estimated_runtime_s or 3600
    return per_hour * Decimal(seconds) / Decimal(3600)


def budget_hard_limit_check(*, tenant, workload, actor) -> None:
    budget = Budget.objects.filter(tenant=tenant, hard_limit=True).first()
    if budget is None:
        return
    spent = month_cost_to_date(tenant=tenant)
    estimate = workload_estimate(tenant=tenant, workload=workload)
    if spent + estimate > budget.monthly_limit:
        cur = tenant.currency
        raise AdmissionRefused(
            f"Monthly budget {quantize_money(budget.monthly_limit, cur)} {cur} would be exceeded: "
            f"{quantize_money(spent, cur)} spent this month and this workload is estimated at "
            f"{quantize_money(estimate, cur)}.",
            fields={"budget": [f"Hard limit {quantize_money(budget.monthly_limit, cur)} {cur}."]},
            code="budget_exceeded",
        )
