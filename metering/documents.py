"""Invoice documents: the PDF (WeasyPrint renders ``templates/metering/invoice_pdf.html``) and the CSV
(``metering.selectors.shared.invoice_csv``), with their file names and the money formatting they share.

Money is shown at the currency's places (``quantize_money``: half-up), from the stored Decimals, with
the currency code; times are UTC. The seller block comes from ``settings.METERING_SELLER`` (name, address
lines, e-mail and tax id; the ``METERING_SELLER_*`` environment variables).

WeasyPrint needs Pango (Debian: ``libpango-1.0-0``, ``libpangoft2-1.0-0``; see
``scripts/install-system-deps``); it is imported when a PDF is rendered, so the rest of the app runs
without it and a PDF request then fails with a clear 503.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.db.models import Sum
from django.template.loader import render_to_string
from django.utils import timezone

from metering.models import CreditNote, Invoice, InvoiceStatus, LineKind
from metering.money import ZERO, minor_units, quantize_money
from metering.selectors.shared import invoice_csv
from portal.errors import DomainError


class DocumentUnavailable(DomainError):
    status_code = 503
    code = "document_unavailable"


def format_money(amount: Decimal | int | str | None, currency: str) -> str:
    """``1234.5, "USD"`` -> ``"1,234.50 USD"``: the currency's places (half-up), thousands grouped."""
    if amount is None:
        return ""
    value = quantize_money(amount, currency)
    return f"{value:,.{minor_units(currency)}f} {currency.upper()}"


def format_quantity(value: Decimal | None) -> str:
    if value is None:
        return ""
    return f"{Decimal(value).quantize(Decimal('0.001')):,f}"


def _unit_price(line, currency: str) -> str:
    """The line's unit price; for usage lines, which sum records at their own prices, the average
    (amount / quantity, 4 places), marked as such."""
    if line.unit_price is not None:
        return format_money(line.unit_price, currency)
    if line.kind in (LineKind.CREDIT, LineKind.TAX) or not line.quantity:
        return ""
    average = (Decimal(line.amount) / Decimal(line.quantity)).quantize(Decimal("0.0001"))
    return f"avg {average:,f} {currency.upper()}"


@dataclass(frozen=True)
class DocumentLine:
    position: int
    description: str
    quantity: str
    unit: str
    unit_price: str
    amount: str


def _payment_status(invoice: Invoice, now) -> str:
    if invoice.status == InvoiceStatus.PAID:
        return f"Paid {invoice.paid_at:%Y-%m-%d %H:%M} UTC" if invoice.paid_at else "Paid"
    if invoice.status == InvoiceStatus.VOID:
        return "Void: nothing to pay"
    if invoice.status == InvoiceStatus.DRAFT:
        return "Draft: not yet due; amounts may change until it is finalized"
    if invoice.due_at is not None and invoice.due_at < now:
        return f"Overdue since {invoice.due_at:%Y-%m-%d} UTC"
    return "Open: awaiting payment"


def invoice_number(invoice: Invoice) -> str:
    """The number printed on the invoice and used in file names: ``INV-<year><month>-<id>``."""
    return f"INV-{invoice.period_start:%Y%m}-{invoice.pk:06d}"


def invoice_filename(invoice: Invoice, extension: str) -> str:
    return f"{invoice_number(invoice)}.{extension}"


def invoice_document_context(invoice: Invoice, *, now=None) -> dict:
    now = now or timezone.now()
    cur = invoice.currency
    lines = [
        DocumentLine(
            position=ln.position,
            description=ln.description,
            quantity="" if ln.kind in (LineKind.CREDIT, LineKind.TAX) else format_quantity(ln.quantity),
            unit=ln.unit,
            unit_price=_unit_price(ln, cur),
            amount=format_money(ln.amount, cur),
        )
        for ln in invoice.lines.all()
        if ln.kind != LineKind.TAX
    ]
    credit_notes = CreditNote.objects.filter(invoice=invoice).aggregate(s=Sum("amount"))["s"] or ZERO
    tenant = invoice.tenant
    seller = settings.METERING_SELLER
    return {
        "invoice": invoice,
        "number": invoice_number(invoice),
        "seller": seller,
        "buyer": {"name": tenant.name, "slug": tenant.slug, "email": tenant.billing_email},
        "status": invoice.get_status_display(),
        "payment_status": _payment_status(invoice, now),
        "period_last_day": invoice.period_end - timedelta(days=1),
        "lines": lines,
        "subtotal": format_money(invoice.subtotal, cur),
        "credits": format_money(-invoice.credits, cur) if invoice.credits else "",
        "tax_rate": f"{invoice.tax_rate_percent.normalize():f}",
        "tax": format_money(invoice.tax, cur),
        "total": format_money(invoice.total, cur),
        "credit_notes": format_money(credit_notes, cur) if credit_notes else "",
        "balance": format_money(invoice.total - credit_notes, cur),
        "issued_at": invoice.finalized_at,
        "generated_at": now,
    }


def invoice_html(invoice: Invoice, *, now=None) -> str:
    return render_to_string("metering/invoice_pdf.html", invoice_document_context(invoice, now=now))


def invoice_pdf(invoice: Invoice, *, now=None) -> bytes:
    """The invoice as a PDF (bytes starting with ``%PDF``)."""
    try:
        from weasyprint import HTML
    except (ImportError, OSError) as exc:  # the package, or Pango under it, is missing
        raise DocumentUnavailable(
            f"PDF rendering is not available on this server ({exc.__class__.__name__}); "
            "download the CSV, or install the system packages in scripts/install-system-deps."
        ) from exc
    return HTML(string=invoice_html(invoice, now=now)).write_pdf()


def invoice_csv_document(invoice: Invoice) -> str:
    return invoice_csv(invoice=invoice)
