"""The staff finance API: ``/api/staff/v1/finance/revenue/``, ``.../gpu-hours/``, ``.../receivables/``.

The same reports as the staff pages, as JSON; money as strings at the currency's places. Only staff
may read them: a signed-in staff person, or a staff token (``gps_...``) with the ``finance:read``
scope. A tenant's token gets 403 whoever made it; no credentials, 401. It lives outside the tenant
API (``/api/v1/``), which never accepts a staff token.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.authentication import SessionAuthentication
from rest_framework.response import Response
from rest_framework.views import APIView

from metering import reports
from metering.models import InvoiceStatus
from metering.money import quantize_money
from metering.views import ReportFilterForm, finance_export_audit
from portal.api.authentication import BearerTokenAuthentication, StaffTokenAuthentication
from portal.api.permissions import StaffPermission
from portal.errors import ValidationFailed
from portal.models import StaffScope


def _filters(request, groups: dict[str, str]) -> dict:
    form = ReportFilterForm(request.query_params, groups=groups)
    if not form.is_valid():
        fields = {k: list(v) for k, v in form.errors.items()}
        detail = "; ".join(f"{k}: {' '.join(v)}" for k, v in fields.items())
        raise ValidationFailed(detail, fields=fields)
    return form.cleaned_data


def _money(value, currency: str) -> str:
    return str(quantize_money(value, currency))


def _pct(value) -> str | None:
    return None if value is None else f"{value:.2f}"


FILTERS = [
    OpenApiParameter("start", str, description="First month, YYYY-MM (default: 11 months before end)."),
    OpenApiParameter("end", str, description="Last month, YYYY-MM, inclusive (default: this month)."),
]


class FinanceBase(APIView):
    # Tenant tokens are authenticated only so that StaffPermission can refuse them with a reason.
    authentication_classes = [StaffTokenAuthentication, BearerTokenAuthentication, SessionAuthentication]
    permission_classes = [StaffPermission]
    staff_scope = StaffScope.FINANCE_READ

    def finalize_response(self, request, response, *args, **kwargs):
        """Every report a staff person takes away is audited: who, which report, which months."""
        if response.status_code == 200:
            finance_export_audit(request, report=self.report_name, fmt="json")
        return super().finalize_response(request, response, *args, **kwargs)


class RevenueApi(FinanceBase):
    """Invoiced revenue by month and by tenant, GPU model, plan or region."""

    report_name = "revenue"

    @extend_schema(
        parameters=[
            *FILTERS,
            OpenApiParameter("group", str, enum=list(reports.GROUPS)),
            OpenApiParameter("drafts", bool, description="Count draft invoices too."),
        ],
        responses={200: dict},
    )
    def get(self, request):
        f = _filters(request, reports.GROUPS)
        statuses = (
            (*reports.REVENUE_STATUSES, InvoiceStatus.DRAFT) if f["drafts"] else reports.REVENUE_STATUSES
        )
        report = reports.revenue_report(
            first=f["start"], last=f["end"], group_by=f["group"], statuses=statuses
        )
        return Response(
            {
                "start": f"{f['start']:%Y-%m}",
                "end": f"{f['end']:%Y-%m}",
                "group": report.group_by,
                "statuses": list(report.statuses),
                "rows": [
                    {
                        "month": f"{r.month:%Y-%m}",
                        "currency": r.currency,
                        "key": r.key,
                        "label": r.label,
                        "amount": _money(r.amount, r.currency),
                        "gpu_hours": None if r.gpu_hours is None else f"{r.gpu_hours:.3f}",
                    }
                    for r in report.rows
                ],
                "totals": [
                    {
                        "month": f"{t.month:%Y-%m}",
                        "currency": t.currency,
                        "invoices": t.invoices,
                        **{
                            k: _money(getattr(t, k), t.currency)
                            for k in ("charges", "credits", "credit_notes", "net", "tax", "total")
                        },
                    }
                    for t in report.totals
                ],
            }
        )


class GpuHoursApi(FinanceBase):
    """Fleet capacity, used, billed and busy GPU-hours by month, for the fleet, a model or a region."""

    report_name = "gpu-hours"

    @extend_schema(
        parameters=[*FILTERS, OpenApiParameter("group", str, enum=list(reports.GPU_HOUR_GROUPS))],
        responses={200: dict},
    )
    def get(self, request):
        f = _filters(request, reports.GPU_HOUR_GROUPS)
        rows = reports.gpu_hours_report(first=f["start"], last=f["end"], group_by=f["group"])
        return Response(
            {
                "start": f"{f['start']:%Y-%m}",
                "end": f"{f['end']:%Y-%m}",
                "group": f["group"],
                "rows": [
                    {
                        "month": f"{r.month:%Y-%m}",
                        "key": r.key,
                        "label": r.label,
                        "capacity_gpu_hours": f"{r.capacity_h:.3f}",
                        "used_gpu_hours": f"{r.used_h:.3f}",
                        "billed_gpu_hours": f"{r.billed_h:.3f}",
                        "busy_gpu_hours": None if r.busy_h is None else f"{r.busy_h:.3f}",
                        "idle_gpu_hours": f"{r.idle_h:.3f}",
                        "utilisation_pct": _pct(r.utilisation_pct),
                        "busy_pct": _pct(r.busy_pct),
                    }
                    for r in rows
                ],
            }
        )


class ReceivablesApi(FinanceBase):
    """What finalized, unpaid invoices still owe, by tenant and by age past the due date."""

    report_name = "receivables"

    @extend_schema(responses={200: dict})
    def get(self, request):
        report = reports.receivables_report()
        return Response(
            {
                "at": report.at.isoformat(),
                "buckets": [k for k, _ in reports.AGE_BUCKETS],
                "totals": {
                    cur: {k: _money(v, cur) for k, v in t.items()}
                    for cur, t in sorted(report.totals().items())
                },
                "rows": [
                    {
                        "tenant_id": r.tenant_id,
                        "tenant": r.tenant,
                        "currency": r.currency,
                        "invoices": r.invoices,
                        "buckets": {k: _money(v, r.currency) for k, v in r.buckets.items()},
                        "outstanding": _money(r.outstanding, r.currency),
                        "overdue": _money(r.overdue, r.currency),
                    }
                    for r in report.rows
                ],
            }
        )
