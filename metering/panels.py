"""The dashboard's billing panels: the month's cost to date against the budget (with a small chart of
the cost by day), and what needs the attention of whoever pays (budget alerts fired this month,
unpaid invoices, a team in grace or suspended).

Registered with ``portal.dashboard`` (members with the billing scope see them) and mounted by
``metering.urls``. The cost figure is the one beat keeps every minute (``services.budgets``); the
budget panel reloads itself every minute, and a budget alert also arrives as a live event.
"""

from __future__ import annotations

from datetime import date

from django.utils import timezone

from metering.charts import line_chart
from metering.models import BudgetAlert, Invoice, InvoiceStatus
from metering.money import ZERO, quantize_money
from metering.periods import period_of
from metering.selectors.billing_pages import usage_by_day
from metering.services.budgets import budget_status
from portal.dashboard import register_panel
from portal.models import Scope
from portal.views.base import PanelView


def cumulative_cost(*, tenant, period_start: date, today: date, to_date) -> tuple[list[date], list]:
    """The days of the month and the cost so far at the end of each (None for days to come), from
    the usage records by day; today's point is ``to_date`` when that is more (work still running)."""
    usage = usage_by_day(tenant=tenant, period_start=period_start)
    daily: dict[date, object] = {}
    for (day, _), cell in usage.cells.items():
        daily[day] = daily.get(day, ZERO) + cell.amount
    out, total = [], ZERO
    for day in usage.days:
        if day > today:
            out.append(None)
            continue
        total += daily.get(day, ZERO)
        out.append(max(total, to_date) if day == today else total)
    return usage.days, out


class BudgetPanel(PanelView):
    title = "Cost this month"
    panel_template_name = "metering/panels/budget.html"
    read_scope = Scope.BILLING

    def get_context_data(self, **kwargs):
        now = timezone.now()
        status = budget_status(tenant=self.tenant, now=now)
        cur = status.currency
        percent = status.percent
        limit = None if status.monthly_limit is None else quantize_money(status.monthly_limit, cur)
        days, points = cumulative_cost(
            tenant=self.tenant, period_start=status.period_start, today=now.date(), to_date=status.amount
        )
        chart = line_chart(
            [f"{d.day} {d:%b}" for d in days],
            [None if v is None else quantize_money(v, cur) for v in points],
            levels=[] if limit is None else [("Budget", limit)],
            unit=cur,
            title=f"Cost to date by day, {status.period_start:%B %Y}",
        )
        return {
            "panel_url": self.request.path,
            "period": status.period_start,
            "amount": quantize_money(status.amount, cur),
            "currency": cur,
            "as_of": status.as_of,
            "limit": limit,
            "hard_limit": status.hard_limit,
            "percent": percent,
            "bar": 0 if percent is None else min(percent, 100),
            "thresholds": status.alert_thresholds,
            "fired": status.alerts_fired,
            "chart": chart,
        }


class AlertsPanel(PanelView):
    """Budget alerts fired this month, unpaid invoices (overdue ones marked) and the team's grace or
    suspension with its reason; an empty state when all is well. Two queries."""

    title = "Needs attention"
    panel_template_name = "metering/panels/alerts.html"
    read_scope = Scope.BILLING

    def get_context_data(self, **kwargs):
        now = timezone.now()
        alerts = list(
            BudgetAlert.objects.for_tenant(self.tenant)
            .filter(period_start=period_of(now))
            .order_by("-threshold")
        )
        invoices = list(
            Invoice.objects.for_tenant(self.tenant)
            .filter(status=InvoiceStatus.FINALIZED)
            .only("id", "period_start", "currency", "total", "due_at", "status")
            .order_by("due_at", "period_start")
        )
        for inv in invoices:
            inv.overdue = inv.due_at is not None and inv.due_at < now
            inv.total_shown = quantize_money(inv.total, inv.currency)
        for alert in alerts:
            alert.amount_shown = quantize_money(alert.amount, alert.currency)
            alert.limit_shown = quantize_money(alert.monthly_limit, alert.currency)
        tenant = self.tenant
        tenant_status = None
        if tenant.status != tenant.Status.ACTIVE:
            tenant_status = {
                "suspended": tenant.status == tenant.Status.SUSPENDED,
                "reason": tenant.suspended_reason,
            }
        return super().get_context_data(
            budget_alerts=alerts, invoices=invoices, tenant_status=tenant_status, **kwargs
        )


register_panel("alerts", "Needs attention", "metering:panel-alerts", order=2, scope=Scope.BILLING, wide=True)
register_panel("budget", "Cost this month", "metering:panel-budget", order=15, scope=Scope.BILLING)
