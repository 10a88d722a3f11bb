"""The finance reports (``metering.reports``) as CSV rows: money at the currency's places, hours to
three places, percentages to two."""

from __future__ import annotations

from decimal import Decimal

from metering.money import quantize_money
from metering.reports import AGE_BUCKETS, GROUPS, GpuHoursRow, ReceivablesReport, RevenueReport


def revenue_csv_rows(report: RevenueReport) -> list[list]:
    group = GROUPS[report.group_by].lower()
    rows: list[list] = [["month", "currency", f"{group} key", group, "amount", "gpu_hours"]]
    for r in report.rows:
        rows.append(
            [
                f"{r.month:%Y-%m}",
                r.currency,
                r.key,
                r.label,
                quantize_money(r.amount, r.currency),
                "" if r.gpu_hours is None else r.gpu_hours.quantize(Decimal("0.001")),
            ]
        )
    rows.append([])
    rows.append(
        [
            "month",
            "currency",
            "invoices",
            "charges",
            "credits",
            "credit_notes",
            "net",
            "tax",
            "invoiced_total",
        ]
    )
    for t in report.totals:
        rows.append(
            [
                f"{t.month:%Y-%m}",
                t.currency,
                t.invoices,
                *(
                    quantize_money(v, t.currency)
                    for v in (t.charges, t.credits, t.credit_notes, t.net, t.tax, t.total)
                ),
            ]
        )
    return rows


def _pct(value: Decimal | None) -> str:
    return "" if value is None else f"{value:.2f}"


def gpu_hours_csv_rows(rows: list[GpuHoursRow]) -> list[list]:
    out: list[list] = [
        [
            "month",
            "key",
            "group",
            "capacity_gpu_hours",
            "used_gpu_hours",
            "billed_gpu_hours",
            "busy_gpu_hours",
            "utilisation_pct",
            "idle_gpu_hours",
            "busy_pct",
        ]
    ]
    q = Decimal("0.001")
    for r in rows:
        out.append(
            [
                f"{r.month:%Y-%m}",
                r.key,
                r.label,
                r.capacity_h.quantize(q),
                r.used_h.quantize(q),
                r.billed_h.quantize(q),
                "" if r.busy_h is None else r.busy_h.quantize(q),
                _pct(r.utilisation_pct),
                r.idle_h.quantize(q),
                _pct(r.busy_pct),
            ]
        )
    return out


def receivables_csv_rows(report: ReceivablesReport) -> list[list]:
    out: list[list] = [
        [
            "tenant_id",
            "tenant",
            "currency",
            "invoices",
            *(k for k, _ in AGE_BUCKETS),
            "outstanding",
            "overdue",
        ]
    ]
    for r in report.rows:
        out.append(
            [
                r.tenant_id,
                r.tenant,
                r.currency,
                r.invoices,
                *(quantize_money(v, r.currency) for v in (*r.buckets.values(), r.outstanding, r.overdue)),
            ]
        )
    return out
