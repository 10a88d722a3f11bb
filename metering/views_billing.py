"""The tenant's usage, reservations and budget pages.

* ``/billing/usage/``: a month's usage by UTC day and GPU model (stacked SVG charts and a table),
  the month's cost to date and the budget standing;
* ``/billing/reservations/``: the tenant's reservations and a buy form whose quote (monthly fee,
  term total, saving against on-demand) follows the form over htmx, then a confirm step; the
  reservation is made by ``scheduling.services.reservations.reservation_request``;
* ``/billing/budget/``: a form over ``services.budgets.budget_set`` (audited there).

Reading needs the billing scope; buying and editing the budget need it too (owners, admins and
billing members have it; members and viewers get a 403).
"""

from __future__ import annotations

import calendar
from datetime import datetime

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.shortcuts import redirect
from django.utils import timezone
from django.views.generic import View

from metering.charts import bar_chart
from metering.models import Budget, BudgetLimitAction
from metering.money import quantize_money
from metering.periods import period_of
from metering.selectors.billing_pages import (
    reservable_models,
    reservation_quote,
    reservation_terms,
    usage_by_day,
    usage_months,
)
from metering.services.budgets import budget_set, budget_status
from metering.services.rates import rate_card_for_tenant
from metering.views import CHART_SERIES
from nodes.models import GpuModel, Region
from portal.errors import DomainError
from portal.inputs import parse_month
from portal.models import Scope
from portal.views.base import TenantScopedMixin, render_page
from scheduling.models import Reservation
from scheduling.services.reservations import reservation_cancel, reservation_request

RESERVATIONS_PER_PAGE = 25


class BillingMixin(TenantScopedMixin):
    read_scope = Scope.BILLING
    write_scope = Scope.BILLING

    def currency(self) -> str:
        card = rate_card_for_tenant(tenant=self.tenant)
        return card.currency if card is not None else self.tenant.currency


def _money(value, currency: str) -> str:
    return f"{quantize_money(value, currency):,} {currency}"


# --- usage ---------------------------------------------------------------------------------------------


class UsageView(BillingMixin, View):
    template_name = "metering/usage.html"

    def get(self, request):
        this_month = period_of(timezone.now())
        value = (request.GET.get("month") or "").strip()
        month_error = ""
        month = this_month
        if value:
            try:
                month = parse_month(value)
            except forms.ValidationError as exc:
                month_error = exc.messages[0]
        months = usage_months(tenant=self.tenant)
        choices = sorted({this_month, month, *months}, reverse=True)
        if month_error:
            return self.render(
                {"month_error": month_error, "month_value": value, "months": choices, "month": this_month},
                status=400,
            )
        usage = usage_by_day(tenant=self.tenant, period_start=month)
        currency = self.currency()
        rows = []
        for day in usage.days:
            for model_id, name in usage.models.items():
                cell = usage.cells.get((day, model_id))
                if cell is not None:
                    rows.append(
                        {
                            "day": day,
                            "model": name,
                            "gpu_hours": cell.gpu_hours,
                            "gpu_seconds": cell.gpu_seconds,
                            "cost": _money(cell.amount, currency),
                        }
                    )
        ranked = list(usage.models.items())
        labels = [str(d.day) for d in usage.days]

        def series(attr: str):
            out = []
            for model_id, name in ranked[:CHART_SERIES]:
                out.append((name, [getattr(usage.cells.get((d, model_id)), attr, 0) for d in usage.days]))
            if len(ranked) > CHART_SERIES:
                rest = [m for m, _ in ranked[CHART_SERIES:]]
                out.append(
                    (
                        "Other",
                        [sum(getattr(usage.cells.get((d, m)), attr, 0) for m in rest) for d in usage.days],
                    )
                )
            return out

        charts = []
        if rows:
            charts = [
                bar_chart(labels, series("gpu_hours"), unit="GPU-hours", stacked=True,
                          title=f"GPU-hours by day, {month:%B %Y}"),
                bar_chart(labels, series("amount"), unit=currency, stacked=True,
                          title=f"Cost by day, {month:%B %Y}"),
            ]  # fmt: skip
        total = usage.total
        context = {
            "month": month,
            "months": choices,
            "is_current": month == this_month,
            "rows": rows,
            "charts": charts,
            "models": [
                {
                    "name": usage.models[m],
                    "gpu_hours": u.gpu_hours,
                    "gpu_seconds": u.gpu_seconds,
                    "cost": _money(u.amount, currency),
                }
                for m, u in usage.by_model.items()
            ],
            "total_gpu_hours": total.gpu_hours,
            "total_gpu_seconds": total.gpu_seconds,
            "memory_gib_hours": usage.memory_gib_hours,
            "memory_cost": _money(usage.memory_amount, currency) if usage.memory_amount else None,
            "total_cost": _money(total.amount, currency),
            "records": usage.records,
            "currency": currency,
        }
        if month == this_month:
            status = budget_status(tenant=self.tenant)
            context["budget"] = {
                "amount": _money(status.amount, status.currency),
                "as_of": status.as_of,
                "limit": None
                if status.monthly_limit is None
                else _money(status.monthly_limit, status.currency),
                "hard_limit": status.hard_limit,
                "percent": status.percent,
                "bar": 0 if status.percent is None else min(status.percent, 100),
                "fired": status.alerts_fired,
            }
        return self.render(context)


# --- reservations --------------------------------------------------------------------------------------


def add_months(at: datetime, months: int) -> datetime:
    """The same day and time ``months`` later (the month's last day when it is shorter)."""
    index = at.month - 1 + months
    year, month = at.year + index // 12, index % 12 + 1
    return at.replace(year=year, month=month, day=min(at.day, calendar.monthrange(year, month)[1]))


class ReservationForm(forms.Form):
    gpu_model = forms.ChoiceField(label="GPU model")
    count = forms.IntegerField(label="GPUs", min_value=1, max_value=100_000, initial=1)
    region = forms.ChoiceField(label="Region")
    term = forms.TypedChoiceField(label="Term", coerce=int, help_text="Longer terms cost less per month.")

    def __init__(self, *args, models: list[GpuModel], regions: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["gpu_model"].choices = [(m.name, m.name) for m in models]
        self.fields["region"].choices = [(c, c) for c in regions]
        terms = reservation_terms()
        self.fields["term"].choices = [(t, f"{t} month{'s' if t != 1 else ''}") for t in terms]
        self.fields["term"].initial = terms[0] if terms else None
        self.fields["gpu_model"].error_messages["invalid_choice"] = "Unknown GPU model %(value)s."
        self.fields["region"].error_messages["invalid_choice"] = "Unknown region %(value)s."
        self.fields["term"].error_messages["invalid_choice"] = (
            "Choose a term of " + ", ".join(str(t) for t in terms) + " months; %(value)s is not one."
        )

    def show_error(self, exc: DomainError) -> None:
        self.add_error(None, exc.message)
        for key, errors in (exc.fields or {}).items():
            name = "term" if key in ("starts_at", "ends_at") else key
            if name in self.fields and name not in self.errors:
                for message in errors if isinstance(errors, list | tuple) else [errors]:
                    self.add_error(name, str(message))


class ReservationsMixin(BillingMixin):
    template_name = "metering/reservations.html"
    model = Reservation

    def form(self, data=None) -> ReservationForm:
        if not hasattr(self, "_models"):  # once per request
            self._models = {m.name: m for m in reservable_models(tenant=self.tenant)}
            self._regions = list(Region.objects.order_by("code").values_list("code", flat=True))
        return ReservationForm(data, models=list(self._models.values()), regions=self._regions)

    def quote_for(self, form: ReservationForm):
        """The quote of a valid form; None (with an error on the model) when it has no reserved price."""
        if not form.is_valid():
            return None
        d = form.cleaned_data
        model = self._models[d["gpu_model"]]
        quote = reservation_quote(
            tenant=self.tenant,
            gpu_model=model,
            count=d["count"],
            term=d["term"],
            currency=self.currency(),
            region=Region.objects.filter(code=d["region"]).first(),
        )
        if quote is None:
            form.add_error("gpu_model", f"{model.name} has no reserved price yet; choose another model.")
        return quote

    def page(self, form: ReservationForm, *, quote=None, confirm: bool = False, status: int = 200):
        reservations = (
            self.get_queryset().select_related("gpu_model", "region").order_by("-created_at", "-pk")
        )
        page = Paginator(reservations, RESERVATIONS_PER_PAGE).get_page(self.request.GET.get("page"))
        return self.render(
            {
                "form": form,
                "quote": quote,
                "confirm": confirm,
                "page": page,
                "reservations": page.object_list,
                "can_buy": self.has_scope(Scope.BILLING),
                "now": timezone.now(),
                # The cancellation policy (settings): may the tenant end an active one, at what fee.
                "tenant_may_end": settings.RESERVATION_CANCEL_ACTIVE_BY == "tenant",
                "cancel_fee_percent": settings.RESERVATION_CANCEL_FEE_PERCENT,
            },
            status=status,
        )


class ReservationsView(ReservationsMixin, View):
    """GET: the list and the buy form. POST without ``confirm``: the quote to confirm; with it:
    the reservation is requested (staff confirm it; then it is guaranteed and billed)."""

    def get(self, request):
        form = self.form()
        initial = {name: f.initial for name, f in form.fields.items()}
        initial["gpu_model"] = next(iter(self._models), "")
        initial["region"] = next(iter(dict(form.fields["region"].choices)), "")
        quote = self.quote_for(self.form(initial))  # the first choices' price, before any change
        return self.page(form, quote=quote)

    def post(self, request):
        form = self.form(request.POST)
        quote = self.quote_for(form)
        if quote is None:
            return self.page(form, status=400)
        if request.POST.get("confirm") != "1":
            return self.page(form, quote=quote, confirm=True)
        d = form.cleaned_data
        starts = timezone.now()
        try:
            r = reservation_request(
                tenant=self.tenant,
                gpu_model=d["gpu_model"],
                region=d["region"],
                count=d["count"],
                starts_at=starts,
                ends_at=add_months(starts, d["term"]),
                actor=self.actor,
                note=f"{d['term']}-month term, quoted {quote.money(quote.monthly_fee)} {quote.currency}/month",
            )
        except DomainError as exc:
            form.show_error(exc)
            return self.page(form, status=exc.status_code)
        messages.success(
            request,
            f"Reservation #{r.pk} requested: {r.count} x {r.gpu_model.name} in {r.region.code} for "
            f"{d['term']} months. gpupool staff confirm it; billing starts then.",
        )
        return redirect("metering:reservations")


class ReservationQuoteView(ReservationsMixin, View):
    """The quote card for the form as it stands (htmx, on every change)."""

    def get(self, request):
        form = self.form(request.GET)
        quote = self.quote_for(form)
        return render_page(
            request,
            "metering/_reservation_quote.html",
            {"form": form, "quote": quote},
            status=200 if quote is not None else 400,
        )


class ReservationCancelView(ReservationsMixin, View):
    def post(self, request, pk: int):
        r = self.get_scoped_object(pk=pk)
        try:
            reservation_cancel(reservation=r, actor=self.actor)
        except DomainError as exc:
            messages.error(request, exc.message)
        else:
            messages.success(request, f"Reservation #{r.pk} cancelled.")
        return redirect("metering:reservations")


# --- budget --------------------------------------------------------------------------------------------


class BudgetForm(forms.Form):
    monthly_limit = forms.DecimalField(
        label="Monthly budget", min_value=0, max_digits=15, decimal_places=3,
        help_text="In your billing currency; 0 with a limit that refuses refuses every new workload.",
    )  # fmt: skip
    alert_thresholds = forms.CharField(
        label="Alert at (percent of the budget)", max_length=200, initial="50, 80, 100",
        help_text="Comma-separated whole percents; each alert is e-mailed once a month.",
    )  # fmt: skip
    limit_action = forms.ChoiceField(
        label="When the month's cost reaches the budget",
        choices=BudgetLimitAction.choices,
        initial=BudgetLimitAction.ALERT,
        required=False,
        help_text="Stopping gives notice first (by e-mail and on the dashboard); reserved work runs on.",
    )

    def thresholds(self) -> list[str]:
        text = self.cleaned_data.get("alert_thresholds") or ""
        return [part.strip() for part in text.replace(";", ",").split(",") if part.strip()]


class BudgetView(BillingMixin, View):
    template_name = "metering/budget.html"

    def page(self, form: BudgetForm, status: int = 200):
        return self.render(
            {
                "form": form,
                "status": budget_status(tenant=self.tenant),
                "can_edit": self.has_scope(Scope.BILLING),
            },
            status=status,
        )

    def get(self, request):
        budget = Budget.objects.filter(tenant=self.tenant).first()
        initial = {}
        if budget is not None:
            initial = {
                "monthly_limit": quantize_money(budget.monthly_limit, self.currency()),
                "limit_action": budget.limit_action,
                "alert_thresholds": ", ".join(str(t) for t in budget.alert_thresholds or []),
            }
        return self.page(BudgetForm(initial=initial))

    def post(self, request):
        form = BudgetForm(request.POST)
        if not form.is_valid():
            return self.page(form, status=400)
        try:
            budget_set(
                tenant=self.tenant,
                monthly_limit=form.cleaned_data["monthly_limit"],
                limit_action=form.cleaned_data["limit_action"] or BudgetLimitAction.ALERT,
                alert_thresholds=form.thresholds(),
                actor=self.actor,
            )
        except DomainError as exc:
            form.add_error(None, exc.message)
            for key, errors in (exc.fields or {}).items():
                if key in form.fields:
                    for message in errors:
                        form.add_error(key, str(message))
            return self.page(form, status=exc.status_code)
        messages.success(request, "Budget saved.")
        return redirect("metering:budget")
