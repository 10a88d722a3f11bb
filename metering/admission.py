"""Admission checks metering plugs into scheduling (registered in ``MeteringConfig.ready``)."""

from __future__ import annotations

from decimal import Decimal

from metering.models import Budget, BudgetLimitAction
from metering.money import quantize_money
from metering.selectors.shared import hourly_estimate, month_cost_to_date
from nodes.models import GpuModel
from scheduling.admission import AdmissionRefused
from scheduling.models import Plan, Workload, WorkloadState


def suspended_tenant_check(*, tenant, workload, actor) -> None:
    if not tenant.is_active:
        reason = f": {tenant.suspended_reason}" if tenant.suspended_reason else ""
        raise AdmissionRefused(
            f"Tenant {tenant.slug} is suspended{reason}; new workloads are refused.", code="tenant_suspended"
        )


def workload_estimate(*, tenant, workload, candidates=None, seconds: int | None = None) -> Decimal:
    """What the workload may cost: its hourly price for its plan on the dearest model it could land
    on (its named models, or every catalog model that meets its constraints) in the dearest region,
    times its maximum runtime (or its estimated runtime, or one hour). A model without a price
    bills nothing, so it never lowers the estimate; none priced at all: 0."""
    if candidates is None:
        candidates = getattr(workload, "_spec_candidates", None)
    if candidates is None:
        from scheduling.services.submission import candidate_models

        candidates = candidate_models(workload=workload)
    models = list(candidates or [])
    if not models:
        return Decimal(0)
    per_hour = hourly_estimate(
        tenant=tenant,
        gpu_models=models,
        gpu_count=workload.gpu_count,
        fraction_milli=workload.gpu_fraction_milli,
        cpu_millicores=workload.cpu_millicores,
        ram_mib=workload.ram_mib,
        priced_only=True,
    ).get(workload.plan)
    if per_hour is None:
        return Decimal(0)
    if workload.plan == "spot" and workload.spot_max_price is not None:
        per_hour = min(
            per_hour, workload.spot_max_price * workload.gpu_count * workload.gpu_fraction_milli / 1000
        )
    seconds = seconds or workload.max_runtime_s or workload.estimated_runtime_s or 3600
    return per_hour * Decimal(seconds) / Decimal(3600)


# Admitted but not yet running: in no cost to date, so their estimates count against the budget.
NOT_YET_RUNNING = (
    WorkloadState.PENDING,
    WorkloadState.QUEUED,
    WorkloadState.SCHEDULED,
    WorkloadState.STARTING,
)


def committed_estimate(*, tenant) -> Decimal:
    """The estimates of the tenant's workloads admitted but not yet running (reserved ones are
    covered by their reservation's fee). Specs alike are priced once (a queue of a hundred equal
    jobs costs one estimate's queries)."""
    from scheduling.services.submission import candidate_models

    waiting = list(
        Workload.objects.for_tenant(tenant)
        .filter(state__in=NOT_YET_RUNNING)
        .exclude(plan=Plan.RESERVED)
        .prefetch_related("gpu_models")
    )
    if not waiting:
        return Decimal(0)
    catalog = list(GpuModel.objects.all())
    hourly: dict[tuple, Decimal] = {}
    total = Decimal(0)
    for w in waiting:
        models = candidate_models(workload=w, catalog=catalog)
        key = (
            frozenset(m.pk for m in models),
            w.plan,
            w.gpu_count,
            w.gpu_fraction_milli,
            w.cpu_millicores,
            w.ram_mib,
            w.spot_max_price,
        )
        if key not in hourly:
            hourly[key] = workload_estimate(tenant=tenant, workload=w, candidates=models, seconds=3600)
        seconds = w.max_runtime_s or w.estimated_runtime_s or 3600
        total += hourly[key] * Decimal(seconds) / Decimal(3600)
    return total


def budget_hard_limit_check(*, tenant, workload, actor) -> None:
    """Refuse a workload that would take the month past a budget whose limit refuses (``refuse``
    or ``stop``): the cost to date (usage, running work, reservation fees) plus the estimates of
    work admitted but not yet running plus this one's. Runs under the tenant's quota lock
    (``workload_submit``), so parallel submissions are counted one after the other."""
    budget = Budget.objects.filter(tenant=tenant).exclude(limit_action=BudgetLimitAction.ALERT).first()
    if budget is None or workload.plan == Plan.RESERVED:
        return
    spent = month_cost_to_date(tenant=tenant)
    waiting = committed_estimate(tenant=tenant)
    estimate = workload_estimate(tenant=tenant, workload=workload)
    if spent + waiting + estimate > budget.monthly_limit:
        cur = tenant.currency
        raise AdmissionRefused(
            f"Monthly budget {quantize_money(budget.monthly_limit, cur)} {cur} would be exceeded: "
            f"{quantize_money(spent, cur)} spent this month, {quantize_money(waiting, cur)} estimated for "
            f"work admitted but not yet running, and this workload is estimated at "
            f"{quantize_money(estimate, cur)}.",
            fields={
                "budget": [
                    f"Limit {quantize_money(budget.monthly_limit, cur)} {cur} ({budget.limit_action})."
                ]
            },
            code="budget_exceeded",
        )
