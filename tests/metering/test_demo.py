"""``make run``'s demo data has a rate card (prices on the launch page, per region) and a first
invoice for the demo tenant."""

from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from metering.models import Invoice, InvoiceStatus, LineKind, RateCard
from metering.periods import period_of, previous_period
from nodes.models import GpuModel, Region
from portal.demo import DEMO_TENANT_SLUG
from portal.models import Membership, Role, Tenant
from scheduling.pricing import gpu_price_table, price_key

pytestmark = pytest.mark.django_db


def test_seed_demo_prices_the_fleet_and_makes_a_first_invoice(
    tmp_path, settings, client, django_capture_on_commit_callbacks
):
    settings.FLEET_FILE = tmp_path / "fleet.json"
    out = StringIO()
    with django_capture_on_commit_callbacks(execute=True):
        call_command("seed_demo", stdout=out)
    assert "Rate card: Standard" in out.getvalue() and "First invoice:" in out.getvalue()
    card = RateCard.objects.get(is_default=True)
    h100 = GpuModel.objects.get(name="NVIDIA H100 SXM 80GB")
    t4 = GpuModel.objects.get(name="NVIDIA T4")
    use1, euw1, apne1 = (Region.objects.get(code=c) for c in ("us-east-1", "eu-west-1", "ap-northeast-1"))
    # What the launch page's table shows: every plan priced, Tokyo 10 % dearer.
    table = gpu_price_table(pairs=[(h100, use1), (t4, euw1), (t4, apne1)])
    assert table[price_key(h100, use1)] == {
        "on_demand": Decimal("3.00"),
        "spot": Decimal("1.20"),
        "reserved": Decimal("2.10"),
    }
    assert table[price_key(t4, apne1)]["on_demand"] == table[price_key(t4, euw1)]["on_demand"] * Decimal(
        "1.1"
    )
    assert card.versions.get().gpu_memory_gib_hour_price == Decimal("0.002")

    tenant = Tenant.objects.get(slug=DEMO_TENANT_SLUG)
    period = previous_period(period_of(timezone.now()))
    invoice = Invoice.objects.get(tenant=tenant, period_start=period)
    assert invoice.status == InvoiceStatus.FINALIZED
    kinds = {ln.kind: ln.amount for ln in invoice.lines.all()}
    # 2 H100s reserved the whole month on a one-month term: 2 x 2.10 x 730 = 3,066.00, less the credit.
    assert kinds[LineKind.RESERVED_FEE] == Decimal("3066.00") and kinds[LineKind.CREDIT] == Decimal("-100.00")
    assert invoice.total == Decimal("2966.00")
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
    client.force_login(owner)
    page = client.get("/billing/invoices/")
    html = page.content.decode()
    assert page.status_code == 200 and ("2,966.00" in html or "2966.00" in html)

    # A second run changes nothing.
    with django_capture_on_commit_callbacks(execute=True):
        call_command("seed_demo", stdout=StringIO())
    assert RateCard.objects.count() == 1 and Invoice.objects.filter(tenant=tenant).count() == 1
