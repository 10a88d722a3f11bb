"""Budgets: the cost of the month so far, kept every minute, and alerts at thresholds.

``costs_to_date_update`` (beat, every minute) computes every tenant's cost to date with
``services.usage.costs_to_date`` (the one piece of code that prices usage, recorded and running),
stores it in ``CostToDate`` (what the dashboard and ``/api/v1/budget/`` show), and checks budgets:
each threshold of a budget's ``alert_thresholds`` (default 50/80/100 %) fires once per tenant and
month, guarded by the unique (tenant, month, threshold) row, so a rerun or a second worker never
alerts twice. An alert is audited, e-mailed to the tenant's owners and billing members (and its
billing address) and pushed to the tenant's browsers as a live event.

What the limit does is the budget's ``limit_action``: ``alert`` only; ``refuse`` new workloads
that would pass it (the admission check in ``metering.admission``, estimated at the dearest model
and region a request could land on, counting work admitted but not yet running); ``stop`` also
stops the tenant's running on-demand and spot work once the month's cost passes the limit: a
notice first (audited, e-mailed, pushed live), then, ``METERING_BUDGET_STOP_NOTICE_S`` later and
still over, each such workload is stopped through scheduling's stop service (its event's reason
``budget_exceeded``). Reserved work runs on: its reservation is paid for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from metering.models import Budget, BudgetAlert, BudgetLimitAction, CostToDate, default_alert_thresholds
from metering.money import ZERO, quantize_money
from metering.periods import period_bounds, period_of
from metering.services.notify import billing_contacts_mail
from metering.services.rates import TenantPricing
from metering.services.usage import costs_to_date, usage_build
from portal.actors import Actor
from portal.errors import DomainError, ValidationFailed
from portal.events import publish
from portal.models import Scope, Tenant
from portal.services.audit import audit_record

logger = logging.getLogger(__name__)
MAX_THRESHOLD = 1000  # percent


@dataclass(frozen=True)
class BudgetStatus:
    """What the dashboard and the API show: the month's cost so far against the budget."""

    period_start: object
    amount: Decimal
    currency: str
    as_of: datetime | None
    monthly_limit: Decimal | None
    limit_action: str | None
    alert_thresholds: list[int]
    alerts_fired: list[int]

    @property
    def percent(self) -> Decimal | None:
        if self.monthly_limit is None:
            return None
        if self.monthly_limit == 0:
            return None if self.amount == 0 else Decimal(MAX_THRESHOLD)
        return (self.amount * 100 / self.monthly_limit).quantize(Decimal("0.1"))

    @property
    def hard_limit(self) -> bool:
        return self.limit_action in (BudgetLimitAction.REFUSE, BudgetLimitAction.STOP)


def _percent(amount: Decimal, limit: Decimal) -> Decimal:
    if limit <= 0:
        return Decimal(0) if amount <= 0 else Decimal("Infinity")
    return amount * 100 / limit


def clean_thresholds(value) -> list[int]:
    """Thresholds as sorted, distinct whole percents in 1..1000; a 4xx naming the field otherwise."""
    if value is None:
        return default_alert_thresholds()
    if not isinstance(value, list | tuple):
        raise ValidationFailed(
            "alert_thresholds: a list of percents, e.g. [50, 80, 100].",
            fields={"alert_thresholds": ["Must be a list of whole percents."]},
        )
    out = set()
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise ValidationFailed(
                f"alert_thresholds: {item!r} is not a whole percent.",
                fields={"alert_thresholds": [f"{item!r} is not a whole percent."]},
            )
        try:
            n = int(item)
        except ValueError:
            raise ValidationFailed(
                f"alert_thresholds: {item!r} is not a whole percent.",
                fields={"alert_thresholds": [f"{item!r} is not a whole percent."]},
            ) from None
        if not 1 <= n <= MAX_THRESHOLD:
            raise ValidationFailed(
                f"alert_thresholds: {n} is outside 1..{MAX_THRESHOLD}.",
                fields={"alert_thresholds": [f"Each threshold is between 1 and {MAX_THRESHOLD}."]},
            )
        out.add(n)
    return sorted(out)


def thresholds_of(budget: Budget) -> list[int]:
    """A stored budget's thresholds; a value that is not valid (edited in the admin, say) counts
    as the default rather than stopping the alerts of every tenant."""
    try:
        return clean_thresholds(budget.alert_thresholds)
    except ValidationFailed:
        logger.warning(
            "Budget %s has invalid alert thresholds %r; using the default", budget.pk, budget.alert_thresholds
        )
        return default_alert_thresholds()


def clean_limit_action(value, hard_limit=None) -> str:
    """``limit_action`` as one of the choices; without one, ``hard_limit`` (the older flag) means
    ``refuse`` and its absence ``alert``."""
    if value is None or value == "":
        return BudgetLimitAction.REFUSE if hard_limit else BudgetLimitAction.ALERT
    if value not in BudgetLimitAction.values:
        raise ValidationFailed(
            f"limit_action: one of {', '.join(BudgetLimitAction.values)}.",
            fields={"limit_action": [f"One of {', '.join(BudgetLimitAction.values)}."]},
        )
    return value


def budget_set(
    *,
    tenant: Tenant,
    monthly_limit,
    hard_limit: bool | None = None,
    limit_action: str | None = None,
    alert_thresholds=None,
    actor: Actor,
) -> Budget:
    """Create or change the tenant's monthly budget (audited)."""
    try:
        limit = Decimal(str(monthly_limit))
    except (InvalidOperation, ValueError):
        raise ValidationFailed(
            "monthly_limit: not a number.", fields={"monthly_limit": ["Not a number."]}
        ) from None
    if not limit.is_finite() or limit < 0:
        raise ValidationFailed(
            "monthly_limit: must be 0 or more.", fields={"monthly_limit": ["Must be a number, 0 or more."]}
        )
    thresholds = clean_thresholds(alert_thresholds)
    action = clean_limit_action(limit_action, hard_limit)
    with transaction.atomic():
        budget, _ = Budget.objects.update_or_create(
            tenant=tenant,
            defaults={
                "monthly_limit": quantize_money(limit, tenant.currency),
                "limit_action": action,
                "alert_thresholds": thresholds,
                "stop_notice_at": None,
            },
        )
        audit_record(
            tenant=tenant,
            actor=actor,
            action="budget.set",
            target=budget,
            data={
                "monthly_limit": str(budget.monthly_limit),
                "limit_action": budget.limit_action,
                "thresholds": thresholds,
            },
        )
    return budget


def budget_status(*, tenant: Tenant, now: datetime | None = None) -> BudgetStatus:
    """The stored cost to date (kept by beat), or computed now if there is none for this month."""
    now = now or timezone.now()
    period = period_of(now)
    row = CostToDate.objects.filter(tenant=tenant, period_start=period).first()
    pricing = TenantPricing()
    card = pricing.card(tenant.pk)
    currency = card.currency if card is not None else tenant.currency
    if row is None:
        amount, as_of = costs_to_date(tenant_ids=[tenant.pk], now=now)[tenant.pk], now
    else:
        amount, as_of, currency = row.amount, row.as_of, row.currency
    budget = Budget.objects.filter(tenant=tenant).first()
    fired = list(
        BudgetAlert.objects.filter(tenant=tenant, period_start=period)
        .order_by("threshold")
        .values_list("threshold", flat=True)
    )
    return BudgetStatus(
        period_start=period,
        amount=amount,
        currency=currency,
        as_of=as_of,
        monthly_limit=budget.monthly_limit if budget else None,
        limit_action=budget.limit_action if budget else None,
        alert_thresholds=thresholds_of(budget) if budget else [],
        alerts_fired=fired,
    )


def costs_to_date_update(*, now: datetime | None = None) -> int:
    """Store every tenant's cost of the month so far (those with usage or a running allocation
    this month, a budget, or a stored figure to bring to zero at a new month) and fire budget
    alerts. Returns how many tenants were updated."""
    now = now or timezone.now()
    period = period_of(now)
    # Allocations that ended since the last minute get their records first (the usage beat's wider
    # pass catches anything older), so the figure is recorded usage plus what is still running.
    usage_build(since=now - timedelta(hours=1), now=now)
    costs = costs_to_date(now=now)
    budgets = {b.tenant_id: b for b in Budget.objects.select_related("tenant")}
    tenant_ids = set(costs) | set(budgets) | set(CostToDate.objects.values_list("tenant_id", flat=True))
    pricing = TenantPricing()
    pricing.load(tenant_ids)
    tenant_currency = dict(Tenant.objects.filter(pk__in=tenant_ids).values_list("pk", "currency"))
    rows = []
    for tenant_id in sorted(tenant_ids):
        if tenant_id not in tenant_currency:
            continue
        card = pricing.card(tenant_id)
        rows.append(
            CostToDate(
                tenant_id=tenant_id,
                period_start=period,
                amount=costs.get(tenant_id, ZERO),
                currency=card.currency if card is not None else tenant_currency[tenant_id],
                as_of=now,
            )
        )
    CostToDate.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["tenant"],
        update_fields=["period_start", "amount", "currency", "as_of"],
    )
    currency = {r.tenant_id: r.currency for r in rows}
    fired = set(BudgetAlert.objects.filter(period_start=period).values_list("tenant_id", "threshold"))
    for tenant_id, budget in budgets.items():
        amount = costs.get(tenant_id, ZERO)
        percent = _percent(amount, budget.monthly_limit)
        for threshold in thresholds_of(budget):
            if percent >= threshold and (tenant_id, threshold) not in fired:
                budget_alert_fire(
                    budget=budget,
                    threshold=threshold,
                    amount=amount,
                    currency=currency.get(tenant_id, budget.tenant.currency),
                    now=now,
                )
        if budget.limit_action == BudgetLimitAction.STOP:
            budget_stop_enforce(
                budget=budget,
                amount=amount,
                currency=currency.get(tenant_id, budget.tenant.currency),
                now=now,
            )
    return len(rows)


BUDGET_STOP_REASON = "budget_exceeded"  # the workload events' reason when a stop budget stops them


def _stoppable(tenant_id: int):
    from scheduling.models import Plan, Workload, WorkloadState

    return (
        Workload.objects.filter(
            tenant_id=tenant_id, plan__in=[Plan.ON_DEMAND, Plan.SPOT], stop_requested_at__isnull=True
        )
        .exclude(state__in=[WorkloadState.STOPPED, WorkloadState.SUCCEEDED, WorkloadState.FAILED])
        .order_by("pk")
    )


def budget_stop_enforce(*, budget: Budget, amount: Decimal, currency: str, now: datetime) -> int:
    """A ``stop`` budget: under its limit, nothing (a notice of an earlier month or a raised limit
    is forgotten). Over it, the first time this month a notice (audited, e-mailed, live) that the
    tenant's on-demand and spot work stops in ``METERING_BUDGET_STOP_NOTICE_S``; once that has
    passed, each such workload not yet stopping is stopped. Returns how many were stopped."""
    from scheduling.services.lifecycle import workload_stop

    period = period_of(now)
    notice_s = settings.METERING_BUDGET_STOP_NOTICE_S
    over = amount > budget.monthly_limit
    noticed = (
        budget.stop_notice_at
        if budget.stop_notice_at and period_of(budget.stop_notice_at) == period
        else None
    )
    if not over:
        if budget.stop_notice_at is not None:
            Budget.objects.filter(pk=budget.pk).update(stop_notice_at=None)
        return 0
    if noticed is None:
        with transaction.atomic():
            # Only the run that sets the mark sends the notice (a second worker finds it set).
            marked = (
                Budget.objects.filter(pk=budget.pk, limit_action=BudgetLimitAction.STOP)
                .filter(Q(stop_notice_at__isnull=True) | Q(stop_notice_at__lt=period_bounds(period)[0]))
                .update(stop_notice_at=now)
            )
            if marked:
                _stop_notice(budget=budget, amount=amount, currency=currency, now=now, notice_s=notice_s)
        return 0
    if now < noticed + timedelta(seconds=notice_s):
        return 0
    stopped = 0
    limit = quantize_money(budget.monthly_limit, currency)
    for w in _stoppable(budget.tenant_id):
        try:
            workload_stop(
                workload=w,
                actor=Actor.system(),
                now=now,
                reason=BUDGET_STOP_REASON,
                message=f"Stopped: the month's cost passed the budget of {limit} {currency} (its limit stops work).",
            )
            stopped += 1
        except DomainError:  # already stopping or finished since it was read
            continue
    return stopped


def _stop_notice(*, budget: Budget, amount: Decimal, currency: str, now: datetime, notice_s: int) -> None:
    tenant = budget.tenant
    spent, limit = quantize_money(amount, currency), quantize_money(budget.monthly_limit, currency)
    count = _stoppable(tenant.pk).count()
    audit_record(
        tenant=tenant,
        actor=Actor.system(),
        action="budget.stop_notice",
        target=budget,
        data={"amount": str(spent), "monthly_limit": str(limit), "notice_s": notice_s, "workloads": count},
    )
    publish(
        tenant_id=tenant.pk,
        scope=Scope.BILLING,
        event={
            "type": "budget.stop_notice",
            "amount": str(spent),
            "monthly_limit": str(limit),
            "currency": currency,
            "notice_s": notice_s,
            "at": now.isoformat(),
        },
    )
    message = (
        f"{tenant.name}: the month's cost, {spent} {currency}, has passed the monthly budget of "
        f"{limit} {currency}, whose limit stops work.\n\n"
        f"In {notice_s} seconds ({(now + timedelta(seconds=notice_s)):%Y-%m-%d %H:%M} UTC) the team's "
        f"running and queued on-demand and spot workloads ({count} now) will be stopped, unless the "
        "budget is raised or its limit action changed. Reserved work runs on.\n\n"
        f"Budget: {settings.SITE_URL.rstrip('/')}/billing/budget/\n"
    )
    transaction.on_commit(
        lambda: billing_contacts_mail(
            tenant=tenant, subject="running work stops: budget passed", message=message
        )
    )


def budget_alert_fire(
    *, budget: Budget, threshold: int, amount: Decimal, currency: str, now: datetime
) -> BudgetAlert | None:
    """Record the alert once per (tenant, month, threshold); only the run that records it audits,
    e-mails and publishes it. Returns None when it had already fired."""
    tenant = budget.tenant
    period = period_of(now)
    spent = quantize_money(amount, currency)
    limit = quantize_money(budget.monthly_limit, currency)
    try:
        with transaction.atomic():
            alert = BudgetAlert.objects.create(
                tenant=tenant,
                period_start=period,
                threshold=threshold,
                amount=spent,
                monthly_limit=limit,
                currency=currency,
                created_at=now,
            )
            audit_record(
                tenant=tenant,
                actor=Actor.system(),
                action="budget.alert",
                target=alert,
                data={
                    "threshold": threshold,
                    "amount": str(spent),
                    "monthly_limit": str(limit),
                    "currency": currency,
                },
            )
            publish(
                tenant_id=tenant.pk,
                scope=Scope.BILLING,  # amounts: only roles that see billing
                event={
                    "type": "budget.alert",
                    "threshold": threshold,
                    "amount": str(spent),
                    "monthly_limit": str(limit),
                    "currency": currency,
                    "period": f"{period:%Y-%m}",
                    "hard_limit": budget.hard_limit,
                    "limit_action": budget.limit_action,
                    "at": now.isoformat(),
                },
            )
    except IntegrityError:
        return None  # another run recorded it first
    _email_alert(alert, budget)
    return alert


def _email_alert(alert: BudgetAlert, budget: Budget) -> None:
    tenant = budget.tenant
    what = "reached" if alert.threshold < 100 else "passed" if alert.threshold > 100 else "used up"
    hard = {
        BudgetLimitAction.REFUSE: " New workloads that would pass the budget are refused.",
        BudgetLimitAction.STOP: (
            " New workloads that would pass the budget are refused, and once it is passed running "
            "on-demand and spot work is stopped after notice."
        ),
    }.get(budget.limit_action, "")
    message = (
        f"{tenant.name}: {alert.threshold}% of the monthly budget {what} for "
        f"{alert.period_start:%B %Y}.\n\n"
        f"Cost so far: {alert.amount} {alert.currency}\n"
        f"Monthly budget: {alert.monthly_limit} {alert.currency}\n{hard}\n"
        f"Budget and cost to date: {settings.SITE_URL.rstrip('/')}/\n"
    )
    billing_contacts_mail(tenant=tenant, subject=f"{alert.threshold}% of the monthly budget", message=message)
