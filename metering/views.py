"""Web pages of metering: the tenant's invoices with their PDF and CSV downloads, and the staff
finance reports (revenue, billed versus used GPU-hours, receivables), each with a CSV export
(``?export=csv``) and a server-drawn SVG chart.

Importing this module registers the sidebar entries; ``MeteringConfig.ready()`` imports it.
"""

from __future__ import annotations

import csv
import io
from datetime import date

from django import forms
from django.contrib.auth.mixins import AccessMixin
from django.core.paginator import Paginator
from django.http import HttpResponse
from django.utils import timezone
from django.views.generic import View

from metering import reports, reports_csv
from metering.charts import bar_chart
from metering.documents import (
    DocumentUnavailable,
    format_money,
    invoice_csv_document,
    invoice_filename,
    invoice_pdf,
)
from metering.models import CreditEntry, CreditKind, Invoice, InvoiceStatus
from metering.periods import period_of
from metering.selectors.billing_pages import credit_balances
from portal.actors import Actor
from portal.dashboard import register_nav
from portal.inputs import parse_month
from portal.models import Scope
from portal.services.audit import audit_record
from portal.views.base import TenantScopedMixin, forbidden, render_page

register_nav("invoices", "Invoices", "metering:invoices", order=60, scope=Scope.BILLING, icon="receipt")
# the tenant's usage, reservations and budget pages (``metering.views_billing``)
register_nav("usage", "Usage", "metering:usage", order=58, scope=Scope.BILLING, icon="chart")
register_nav(
    "reservations", "Reservations", "metering:reservations", order=62, scope=Scope.BILLING, icon="server"
)
register_nav("budget", "Budget", "metering:budget", order=64, scope=Scope.BILLING, icon="settings")
register_nav("finance", "Finance", "metering:finance-revenue", order=25, icon="chart", staff_only=True)

INVOICES_PER_PAGE = 24
CREDITS_PER_PAGE = 20
CHART_SERIES = 6  # the largest groups get a bar colour each; the rest is "Other"


# --- the tenant's invoices -----------------------------------------------------------------------------


class InvoiceListView(TenantScopedMixin, View):
    read_scope = Scope.BILLING
    model = Invoice
    template_name = "metering/invoices.html"

    def get(self, request):
        now = timezone.now()
        page = Paginator(self.get_queryset().order_by("-period_start", "-pk"), INVOICES_PER_PAGE).get_page(
            request.GET.get("page")
        )
        invoices = list(page.object_list)
        for inv in invoices:
            inv.total_display = format_money(inv.total, inv.currency)
            inv.payment = _payment_status(inv, now)
        credits = Paginator(
            self.scoped(CreditEntry).order_by("-created_at", "-pk"), CREDITS_PER_PAGE
        ).get_page(request.GET.get("credits_page"))
        entries = list(credits.object_list)
        for e in entries:
            e.amount_display = format_money(e.amount, e.currency)
        currency = self.tenant.currency
        balances = credit_balances(tenant=self.tenant)
        return self.render(
            {
                "invoices": invoices,
                "page": page,
                "credits": credits,
                "credit_entries": entries,
                "balances": [
                    (label, format_money(balances.get(kind, 0), currency))
                    for kind, label in CreditKind.choices
                ],
                "credit_total": format_money(sum(balances.values(), 0), currency),
            }
        )


def _payment_status(inv: Invoice, now) -> tuple[str, str]:
    """(label, badge class) of an invoice's payment: paid, due, overdue, draft or void."""
    if inv.status == InvoiceStatus.PAID:
        return "Paid", "badge-status-active"
    if inv.status == InvoiceStatus.VOID:
        return "Void", ""
    if inv.status == InvoiceStatus.DRAFT:
        return "Not yet due (draft)", ""
    if inv.total <= 0:
        return "Nothing to pay", "badge-status-active"
    if inv.due_at is not None and inv.due_at < now:
        return "Overdue", "badge-status-revoked"
    return "Awaiting payment", "badge-status-expired"


class InvoiceDownloadView(TenantScopedMixin, View):
    """``/billing/invoices/<pk>/pdf/`` and ``.../csv/``: the same documents as the API's actions."""

    read_scope = Scope.BILLING
    model = Invoice

    def get(self, request, pk: int, fmt: str):
        invoice = self.get_scoped_object(pk=pk)
        if fmt == "pdf":
            try:
                response = HttpResponse(invoice_pdf(invoice), content_type="application/pdf")
            except DocumentUnavailable as exc:
                return HttpResponse(exc.message, status=503, content_type="text/plain; charset=utf-8")
        else:
            response = HttpResponse(invoice_csv_document(invoice), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="{invoice_filename(invoice, fmt)}"'
        return response


# --- staff finance reports -------------------------------------------------------------------------------


class FinanceStaffMixin(AccessMixin):
    """Finance data spans every tenant: staff only; anonymous people sign in first."""

    def dispatch(self, request, *args, **kwargs):
        if not request.user.is_authenticated:
            return self.handle_no_permission()
        if not request.user.is_staff:
            return forbidden(request, "The finance reports are for gpupool staff.")
        return super().dispatch(request, *args, **kwargs)


def _months_back(month: date, n: int) -> date:
    index = month.year * 12 + month.month - 1 - n
    return date(index // 12, index % 12 + 1, 1)


class ReportFilterForm(forms.Form):
    """The filters of every finance report (web and API): a month range and a grouping."""

    start = forms.CharField(required=False, max_length=7, help_text="First month, YYYY-MM.")
    end = forms.CharField(required=False, max_length=7, help_text="Last month, YYYY-MM (inclusive).")
    group = forms.ChoiceField(required=False, choices=list(reports.GROUPS.items()))
    drafts = forms.BooleanField(required=False, help_text="Count draft invoices too.")

    def __init__(self, *args, groups: dict[str, str] = reports.GROUPS, default_months: int = 12, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["group"].choices = list(groups.items())
        self.default_group = next(iter(groups))
        self.default_months = default_months

    def clean_start(self) -> date | None:
        value = self.cleaned_data.get("start") or ""
        return parse_month(value) if value else None

    def clean_end(self) -> date | None:
        value = self.cleaned_data.get("end") or ""
        return parse_month(value) if value else None

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        end = data.get("end") or period_of(timezone.now())
        start = data.get("start") or _months_back(end, self.default_months - 1)
        if start > end:
            self.add_error("start", "The first month comes after the last.")
        elif len(reports.months_between(start, end)) > reports.MAX_MONTHS:
            self.add_error("end", f"At most {reports.MAX_MONTHS} months at a time.")
        data.update(start=start, end=end, group=data.get("group") or self.default_group)
        return data


def finance_export_audit(request, *, report: str, fmt: str) -> None:
    """Audit a staff person taking a finance report away (a CSV file, or the staff API's JSON)."""
    actor = Actor(user=request.user if request.user.is_authenticated else None)
    audit_record(
        tenant=None,
        actor=actor,
        action="finance.exported",
        data={"report": report, "format": fmt, "query": {k: request.GET.get(k) for k in request.GET}},
    )


def _csv_response(request, report: str, rows: list[list], filename: str) -> HttpResponse:
    finance_export_audit(request, report=report, fmt="csv")
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    response = HttpResponse(buf.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def _wants_csv(request) -> bool:
    return request.GET.get("export") == "csv"


class _ReportView(FinanceStaffMixin, View):
    groups: dict[str, str] = reports.GROUPS
    tab = ""

    def form(self, request) -> ReportFilterForm:
        form = ReportFilterForm(request.GET, groups=self.groups)
        form.is_valid()
        return form

    def page(self, request, template: str, context: dict, status: int = 200):
        query = request.GET.copy()
        query.pop("export", None)
        query["export"] = "csv"
        context.update(tab=self.tab, csv_query=query.urlencode())
        return render_page(request, template, context, status=status)


class RevenueView(_ReportView):
    tab = "revenue"

    def get(self, request):
        form = self.form(request)
        if form.errors:
            return self.page(request, "metering/finance_revenue.html", {"form": form}, status=400)
        f = form.cleaned_data
        statuses = (
            (*reports.REVENUE_STATUSES, InvoiceStatus.DRAFT) if f["drafts"] else reports.REVENUE_STATUSES
        )
        report = reports.revenue_report(
            first=f["start"], last=f["end"], group_by=f["group"], statuses=statuses
        )
        if _wants_csv(request):
            return _csv_response(
                request,
                self.tab,
                reports_csv.revenue_csv_rows(report),
                f"revenue-{f['start']:%Y-%m}-{f['end']:%Y-%m}-{f['group']}.csv",
            )
        return self.page(
            request,
            "metering/finance_revenue.html",
            {
                "form": form,
                "report": report,
                "group_label": reports.GROUPS[report.group_by],
                **_revenue_tables(report),
            },
        )


def _revenue_tables(report: reports.RevenueReport) -> dict:
    """Per currency: a pivot (group rows by month columns) and a stacked chart of the biggest groups."""
    labels = [f"{m:%Y-%m}" for m in report.months]
    out = []
    for cur in report.currencies or ["USD"]:
        rows = [r for r in report.rows if r.currency == cur]
        by_key: dict[str, dict] = {}
        for r in rows:
            entry = by_key.setdefault(r.key, {"label": r.label, "cells": {}, "total": reports.ZERO})
            entry["cells"][r.month] = entry["cells"].get(r.month, reports.ZERO) + r.amount
            entry["total"] += r.amount
        ranked = sorted(by_key.values(), key=lambda e: (-e["total"], e["label"]))
        for e in ranked:
            e["values"] = [format_money(e["cells"][m], cur) if m in e["cells"] else "" for m in report.months]
            e["total_display"] = format_money(e["total"], cur)
        series = [(e["label"], [e["cells"].get(m, 0) for m in report.months]) for e in ranked[:CHART_SERIES]]
        if len(ranked) > CHART_SERIES:
            rest = ranked[CHART_SERIES:]
            series.append(("Other", [sum((e["cells"].get(m, 0) for e in rest), 0) for m in report.months]))
        totals = [t for t in report.totals if t.currency == cur]
        out.append(
            {
                "currency": cur,
                "groups": ranked,
                "totals": [
                    {
                        "month": t.month,
                        "invoices": t.invoices,
                        **{
                            k: format_money(getattr(t, k), cur)
                            for k in ("charges", "credits", "credit_notes", "net", "tax", "total")
                        },
                    }
                    for t in totals
                ],
                "chart": bar_chart(labels, series, unit=cur, stacked=True, title=f"Revenue by month ({cur})"),
            }
        )
    return {"currencies": out}


class GpuHoursView(_ReportView):
    tab = "gpu-hours"
    groups = reports.GPU_HOUR_GROUPS

    def get(self, request):
        form = self.form(request)
        if form.errors:
            return self.page(request, "metering/finance_gpu_hours.html", {"form": form}, status=400)
        f = form.cleaned_data
        rows = reports.gpu_hours_report(first=f["start"], last=f["end"], group_by=f["group"])
        if _wants_csv(request):
            return _csv_response(
                request,
                self.tab,
                reports_csv.gpu_hours_csv_rows(rows),
                f"gpu-hours-{f['start']:%Y-%m}-{f['end']:%Y-%m}-{f['group']}.csv",
            )
        months = reports.months_between(f["start"], f["end"])
        fleet = {m: [reports.ZERO, reports.ZERO, reports.ZERO] for m in months}
        for r in rows:
            fleet[r.month][0] += r.capacity_h
            fleet[r.month][1] += r.used_h
            fleet[r.month][2] += r.billed_h
        chart = bar_chart(
            [f"{m:%Y-%m}" for m in months],
            [(name, [fleet[m][i] for m in months]) for i, name in enumerate(("Capacity", "Used", "Billed"))],
            unit="GPU-hours",
            title="Fleet capacity, used and billed GPU-hours by month",
        )
        return self.page(
            request, "metering/finance_gpu_hours.html", {"form": form, "rows": rows, "chart": chart}
        )


class ReceivablesView(_ReportView):
    tab = "receivables"

    def get(self, request):
        report = reports.receivables_report()
        if _wants_csv(request):
            return _csv_response(
                request,
                self.tab,
                reports_csv.receivables_csv_rows(report),
                f"receivables-{report.at:%Y-%m-%d}.csv",
            )
        totals = report.totals()
        blocks = []
        for cur, t in sorted(totals.items()):
            blocks.append(
                {
                    "currency": cur,
                    "totals": [(label, format_money(t[k], cur)) for k, label in reports.AGE_BUCKETS],
                    "outstanding": format_money(t["outstanding"], cur),
                    "overdue": format_money(t["overdue"], cur),
                    "chart": bar_chart(
                        [label for _, label in reports.AGE_BUCKETS],
                        [(f"Owed ({cur})", [t[k] for k, _ in reports.AGE_BUCKETS])],
                        unit=cur,
                        title=f"Receivables by age ({cur})",
                    ),
                }
            )
        rows = [
            {
                "tenant": r.tenant,
                "currency": r.currency,
                "invoices": r.invoices,
                "buckets": [format_money(r.buckets[k], r.currency) for k, _ in reports.AGE_BUCKETS],
                "outstanding": format_money(r.outstanding, r.currency),
                "overdue": r.overdue > 0,
            }
            for r in report.rows
        ]
        oldest = [
            {
                "invoice": inv,
                "owed": format_money(inv.owed, inv.currency),
                "days": (report.at - inv.due_at).days,
            }
            for inv in report.oldest
        ]
        return self.page(
            request,
            "metering/finance_receivables.html",
            {
                "report": report,
                "blocks": blocks,
                "rows": rows,
                "oldest": oldest,
                "buckets": reports.AGE_BUCKETS,
            },
        )
