"""The dashboard's budget panel: the month's cost to date against the tenant's budget.

Registered with ``portal.dashboard`` (members with the billing scope see it) and mounted by
``metering.urls``. The figure is the one beat keeps every minute (``services.budgets``); the panel
reloads itself every minute, and a budget alert also arrives as a live event.
"""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from django.template import engines
from django.utils.cache import patch_vary_headers

from metering.money import quantize_money
from metering.services.budgets import budget_status
from portal.dashboard import register_panel
from portal.models import Scope
from portal.views.base import PanelView, htmx_partial

BODY = engines["django"].from_string(
    """<div class="budget-panel" hx-get="{{ panel_url }}" hx-trigger="every 60s" hx-swap="outerHTML">
  <div class="stat-row">
    <div class="stat"><span class="stat-value" data-cost-to-date>{{ amount }} {{ currency }}</span>
      <span class="stat-label">cost so far in {{ period|date:"F Y" }}</span></div>
    {% if limit is not None %}
    <div class="stat"><span class="stat-value">{{ limit }} {{ currency }}</span>
      <span class="stat-label">monthly budget{% if hard_limit %} (hard limit){% endif %}</span></div>
    {% endif %}
  </div>
  {% if limit is not None %}
  <div class="progress-line">
    <div class="progress" role="progressbar" aria-valuemin="0" aria-valuemax="100" aria-valuenow="{{ bar }}"
         aria-label="Share of the monthly budget used"><span style="width: {{ bar }}%"></span></div>
    <span class="muted small" data-budget-percent>{{ percent }}%</span>
  </div>
  <p class="muted small">Alerts at {% for t in thresholds %}{{ t }}%{% if not forloop.last %}, {% endif %}{% endfor %}.
    {% if fired %}Sent this month: {% for t in fired %}{{ t }}%{% if not forloop.last %}, {% endif %}{% endfor %}.{% endif %}</p>
  {% else %}
  <p class="muted small">No monthly budget set. <a href="{% url 'metering:budget' %}">Set one</a> to get alerts at 50, 80 and 100 % (or <code>PUT /api/v1/budget/</code>).</p>
  {% endif %}
  <p class="muted small">Updated every minute{% if as_of %}; as of <time datetime="{{ as_of|date:'c' }}">{{ as_of|date:"H:i" }} UTC</time>{% endif %}.</p>
</div>
"""
)


class BudgetPanel(PanelView):
    title = "Cost this month"
    panel_template_name = "metering/panels/budget"  # rendered from BODY, not a file

    def get_context_data(self, **kwargs):
        if not self.has_scope(Scope.BILLING):
            raise PermissionDenied("The cost panel needs the billing scope.")
        status = budget_status(tenant=self.tenant)
        cur = status.currency
        percent = status.percent
        return {
            "panel_url": self.request.path,
            "period": status.period_start,
            "amount": quantize_money(status.amount, cur),
            "currency": cur,
            "as_of": status.as_of,
            "limit": None if status.monthly_limit is None else quantize_money(status.monthly_limit, cur),
            "hard_limit": status.hard_limit,
            "percent": percent,
            "bar": 0 if percent is None else min(percent, 100),
            "thresholds": status.alert_thresholds,
            "fired": status.alerts_fired,
        }

    def get(self, request, *args, **kwargs):
        context = self.get_context_data(**kwargs)
        body = BODY.render(context, request)
        if not htmx_partial(request):
            page = engines["django"].get_template("portal/panel_page.html")
            body = page.render(
                {"panel_template": BODY.template, "panel_title": self.title, **context}, request
            )
        response = HttpResponse(body)
        patch_vary_headers(response, ["HX-Request"])
        return response


register_panel("budget", "Cost this month", "metering:panel-budget", order=15, scope=Scope.BILLING)
