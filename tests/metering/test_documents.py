"""Invoice documents: the PDF (WeasyPrint, read back with pypdf) and the CSV, through the API and
the tenant's web pages, tenant-scoped and for the billing scope."""

from __future__ import annotations

import csv
import io
from datetime import date
from decimal import Decimal

import pytest
from pypdf import PdfReader

from metering.documents import format_money, invoice_number
from metering.models import BillingAccount, CreditKind
from metering.services.invoices import credit_grant, invoice_build, invoice_finalize
from metering.services.usage import usage_build
from portal.actors import Actor
from portal.models import Role
from tests.metering.conftest import utc
from tests.portal.conftest import add_member, signed_in  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_cycle_tasks(settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False


@pytest.fixture
def invoice(tenant, card, run):
    """A finalized March 2024 invoice: 10 h on-demand (20.00), 5 h spot (4.00), 5.00 promotional
    credit, 10 % tax on the rest: total 20.90 USD."""
    BillingAccount.objects.create(tenant=tenant, tax_rate_percent=Decimal("10"))
    run(tenant, utc(2024, 3, 2), utc(2024, 3, 2, 10))
    run(tenant, utc(2024, 3, 5), utc(2024, 3, 5, 5), plan="spot")
    usage_build(since=utc(2024, 3, 1), now=utc(2024, 4, 1))
    credit_grant(tenant=tenant, kind=CreditKind.PROMOTIONAL, amount="5", actor=Actor.system())
    draft = invoice_build(tenant=tenant, period_start=date(2024, 3, 1))
    return invoice_finalize(invoice=draft, actor=Actor.system(), now=utc(2024, 4, 4))


@pytest.fixture
def member_client(add_member, signed_in):  # noqa: F811
    """``member_client(tenant, role)``: a signed-in test client of a new member with that role."""

    def make(tenant, role):
        return signed_in(add_member(tenant, role).user, tenant)

    return make


def _pdf_text(content: bytes) -> str:
    return "\n".join(page.extract_text() for page in PdfReader(io.BytesIO(content)).pages)


def test_format_money_rounds_half_up_at_the_currency_places():
    assert format_money(Decimal("1234.565"), "USD") == "1,234.57 USD"
    assert format_money(Decimal("1234.5"), "JPY") == "1,235 JPY"
    assert format_money(Decimal("-0.5"), "BHD") == "-0.500 BHD"


def test_the_pdf_is_a_real_pdf_with_the_number_lines_and_total(invoice, make_token, api):
    assert invoice.total == Decimal("20.900")
    client = api(make_token(invoice.tenant, scopes=["read", "billing"]))
    response = client.get(f"/api/v1/invoices/{invoice.pk}/pdf/")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/pdf"
    assert f'filename="{invoice_number(invoice)}.pdf"' in response["Content-Disposition"]
    assert response.content.startswith(b"%PDF-")
    text = _pdf_text(response.content)
    assert invoice_number(invoice) in text
    assert "20.90 USD" in text  # the total
    assert "24.00 USD" in text  # the subtotal
    assert "-5.00 USD" in text  # credits applied
    assert "2.090 USD" not in text and "1.90 USD" in text  # tax, at the currency's places
    assert "On-demand usage" in text and "Spot usage" in text
    assert "10.000" in text and "avg 2.0000 USD" in text and "avg 0.8000 USD" in text  # quantity, unit price
    assert invoice.tenant.name in text and "2024-03-01" in text and "2024-03-31" in text
    assert "Open: awaiting payment" in text or "Overdue since" in text


def test_the_seller_comes_from_the_settings(invoice, make_token, api, settings):
    settings.METERING_SELLER = {
        "name": "Example GPU Cloud GmbH",
        "address": ["Hauptstrasse 1", "10115 Berlin"],
        "email": "invoices@example.com",
        "tax_id": "DE123456789",
    }
    client = api(make_token(invoice.tenant, scopes=["read", "billing"]))
    text = " ".join(_pdf_text(client.get(f"/api/v1/invoices/{invoice.pk}/pdf/").content).split())
    for part in (
        "Example GPU Cloud GmbH",
        "Hauptstrasse 1",
        "10115 Berlin",
        "invoices@example.com",
        "DE123456789",
    ):
        assert part in text


def test_the_csv_lines_sum_to_the_total(invoice, make_token, api):
    client = api(make_token(invoice.tenant, scopes=["read", "billing"]))
    response = client.get(f"/api/v1/invoices/{invoice.pk}/csv/")
    assert response.status_code == 200
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    lines = [r for r in rows[2:] if r[0]]  # numbered lines; the summary rows have no position
    assert [r[1] for r in lines] == ["on_demand", "spot", "credit", "tax"]
    total = next(r for r in rows if r[1] == "total")
    assert sum(Decimal(r[7]) for r in lines) == Decimal(total[7]) == invoice.total


def test_another_tenant_gets_404_for_both_documents(invoice, make_tenant, make_token, api):
    other = api(make_token(make_tenant("other")))
    for fmt in ("pdf", "csv"):
        response = other.get(f"/api/v1/invoices/{invoice.pk}/{fmt}/")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


def test_documents_need_the_billing_scope_not_write(invoice, make_token, api):
    reader = api(make_token(invoice.tenant, scopes=["read"]))
    response = reader.get(f"/api/v1/invoices/{invoice.pk}/pdf/")
    assert response.status_code == 403 and "billing" in response.json()["error"]["message"]


def test_web_downloads_for_billing_not_viewers(invoice, member_client, make_tenant):
    tenant = invoice.tenant
    billing = member_client(tenant, Role.BILLING)
    page = billing.get("/billing/invoices/")
    assert page.status_code == 200
    html = page.content.decode()
    assert f"/billing/invoices/{invoice.pk}/pdf/" in html and "20.90 USD" in html

    pdf = billing.get(f"/billing/invoices/{invoice.pk}/pdf/")
    assert pdf.status_code == 200 and pdf.content.startswith(b"%PDF-")
    assert invoice_number(invoice) in _pdf_text(pdf.content)
    csv_response = billing.get(f"/billing/invoices/{invoice.pk}/csv/")
    assert csv_response.status_code == 200 and csv_response["Content-Type"].startswith("text/csv")

    assert 'href="/billing/invoices/"' in billing.get("/").content.decode()  # the sidebar entry
    viewer = member_client(tenant, Role.VIEWER)
    assert 'href="/billing/invoices/"' not in viewer.get("/").content.decode()
    denied = viewer.get(f"/billing/invoices/{invoice.pk}/pdf/")
    assert denied.status_code == 403 and b"billing" in denied.content.lower()

    stranger_tenant = make_tenant("stranger")
    stranger = member_client(stranger_tenant, Role.OWNER)
    assert stranger.get(f"/billing/invoices/{invoice.pk}/pdf/").status_code == 404
    assert stranger.get(f"/billing/invoices/{invoice.pk}/csv/").status_code == 404
    assert f"/billing/invoices/{invoice.pk}/" not in stranger.get("/billing/invoices/").content.decode()


def test_a_draft_pdf_says_it_is_a_draft(tenant, card, run, make_token, api):
    run(tenant, utc(2024, 3, 2), utc(2024, 3, 2, 1))
    usage_build(since=utc(2024, 3, 1), now=utc(2024, 4, 1))
    draft = invoice_build(tenant=tenant, period_start=date(2024, 3, 1))
    response = api(make_token(tenant)).get(f"/api/v1/invoices/{draft.pk}/pdf/")
    text = _pdf_text(response.content)
    assert "Draft" in text and "2.00 USD" in text


def test_without_weasyprint_a_pdf_is_a_clear_503(invoice, make_token, api, monkeypatch, member_client):
    import sys

    monkeypatch.setitem(sys.modules, "weasyprint", None)  # import weasyprint raises ImportError
    client = api(make_token(invoice.tenant, scopes=["read", "billing"]))
    response = client.get(f"/api/v1/invoices/{invoice.pk}/pdf/")
    assert response.status_code == 503
    assert "scripts/install-system-deps" in response.json()["error"]["message"]
    assert client.get(f"/api/v1/invoices/{invoice.pk}/csv/").status_code == 200
    web = member_client(invoice.tenant, Role.BILLING)
    page = web.get(f"/billing/invoices/{invoice.pk}/pdf/")
    assert page.status_code == 503 and b"scripts/install-system-deps" in page.content
