"""``gpupool usage``, ``invoices`` (the PDF download) and ``budget`` against the live portal."""

from __future__ import annotations

import io
from datetime import date
from decimal import Decimal

import pytest
from pypdf import PdfReader

from metering.documents import invoice_number
from metering.models import BillingAccount
from metering.services.invoices import invoice_build, invoice_finalize
from metering.services.usage import usage_build
from portal.actors import Actor
from tests.metering.conftest import a100, card, h100, node, region, run, utc  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def invoice(tenant, card, run):  # noqa: F811
    """A finalized March 2024 invoice: 10 h on-demand at 2.00 and 5 h spot at 0.80, 10 % tax:
    26.40 USD."""
    BillingAccount.objects.create(tenant=tenant, tax_rate_percent=Decimal("10"))
    run(tenant, utc(2024, 3, 2), utc(2024, 3, 2, 10))
    run(tenant, utc(2024, 3, 5), utc(2024, 3, 5, 5), plan="spot")
    usage_build(since=utc(2024, 3, 1), now=utc(2024, 4, 1))
    draft = invoice_build(tenant=tenant, period_start=date(2024, 3, 1))
    return invoice_finalize(invoice=draft, actor=Actor.system(), now=utc(2024, 4, 4))


def test_usage_invoices_and_the_pdf(gp, invoice, tmp_path):
    records = gp.json("usage")
    assert sorted(Decimal(r["amount"]) for r in records) == [Decimal("4.00"), Decimal("20.00")]
    assert "2 records, total 24.00" in gp("usage").stderr
    listed = gp.json("invoices")
    assert [(i["id"], i["status"], i["total"]) for i in listed] == [(invoice.pk, "finalized", "26.400")]
    target = tmp_path / "march.pdf"
    saved = gp.json("invoices", "pdf", invoice.pk, "-o", target)
    assert saved["bytes"] == target.stat().st_size > 0
    text = "\n".join(p.extract_text() for p in PdfReader(io.BytesIO(target.read_bytes())).pages)
    assert invoice_number(invoice) in text and "26.40" in text
    r = gp("invoices", "pdf", invoice.pk + 1000, "-o", tmp_path / "none.pdf", code=1)
    assert "404" in r.stderr and not (tmp_path / "none.pdf").exists()


def test_budget_show_set_and_refusals(gp, tenant):
    r = gp("budget", "--hard", code=2)
    assert "--set" in r.stderr  # nothing to change yet
    b = gp.json("budget", "--set", "500", "--hard", "--alerts", "50,90")
    assert (b["monthly_limit"], b["hard_limit"], b["alert_thresholds"]) == ("500.00", True, [50, 90])
    b = gp.json("budget", "--soft")  # the rest is kept
    assert (b["monthly_limit"], b["hard_limit"], b["alert_thresholds"]) == ("500.00", False, [50, 90])
    assert gp.json("budget")["monthly_limit"] == "500.00"
    r = gp("budget", "--set", "-5", code=1)
    assert "monthly_limit" in r.stderr
    assert "500.00" in gp("budget").stdout
