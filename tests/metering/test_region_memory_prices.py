"""Prices as the seeds describe them: a rate card prices a model per region, and GPU memory per
GiB-hour (shared and fractional GPUs above all); usage, estimates, the launch page's table and
invoices use them."""

import uuid
from datetime import date
from decimal import Decimal

import pytest

from metering.models import InvoiceLine, LineKind, RateCard, UsageRecord
from metering.pricing import provider
from metering.selectors.billing_pages import usage_by_day
from metering.selectors.shared import hourly_estimate
from metering.services.invoices import invoice_build
from metering.services.rates import rate_card_version_create
from metering.services.usage import usage_build
from nodes.models import Gpu, Node, Region
from portal.errors import ValidationFailed
from scheduling.models import Plan
from scheduling.pricing import gpu_price_table, price_key
from tests.metering.conftest import utc
from tests.portal.conftest import signed_in  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db
MARCH = date(2024, 3, 1)


@pytest.fixture
def eu(db):
    return Region.objects.get_or_create(code="eu-west-1", defaults={"name": "EU West"})[0]


@pytest.fixture
def priced(db, h100, a100, region, eu):
    """A default card: H100 on-demand 2.00/h, but 2.60/h in eu-west-1; GPU memory 0.01 per GiB-hour."""
    rc = RateCard.objects.create(name="Regional", currency="USD", is_default=True)
    rate_card_version_create(
        rate_card=rc,
        effective_from=utc(2020, 1, 1),
        gpu_prices={
            (h100.pk, Plan.ON_DEMAND): "2.00",
            (h100.pk, Plan.ON_DEMAND, eu.pk): "2.60",
            (h100.pk, Plan.SPOT): "0.80",
            (h100.pk, Plan.RESERVED): "1.50",
            (h100.pk, Plan.RESERVED, eu.pk): "1.80",
        },
        gpu_memory_gib_hour_price="0.01",
        allow_past=True,
    )
    return rc


@pytest.fixture
def eu_node(eu, h100):
    node = Node.objects.create(hostname="eu-0001", region=eu, cpu_cores=64, ram_mib=512 * 1024)
    for i in range(8):
        Gpu.objects.create(
            node=node, index=i, uuid=f"GPU-{uuid.uuid4()}", model=h100, reported_name=h100.name
        )
    return node


def test_usage_in_a_region_is_billed_at_that_regions_price_and_memory_per_gib_hour(
    tenant, priced, run, node, eu_node, h100
):
    run(tenant, utc(2024, 3, 2, 0), utc(2024, 3, 2, 2))  # us-east-1: 2 h x 2.00
    # eu-west-1, a quarter of a GPU for 4 h: 1 GPU-hour x 2.60 (the "run" helper uses its node)
    from scheduling.models import Allocation

    a = run(tenant, utc(2024, 3, 3, 0), utc(2024, 3, 3, 4), fraction_milli=250)
    Allocation.objects.filter(pk=a.pk).update(node=eu_node, gpu=eu_node.gpus.first())
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    us, eu_rec = UsageRecord.objects.order_by("start")
    # memory: the share of the GPU's 80 GiB held, per second
    assert us.gpu_memory_gib_seconds == Decimal(2 * 3600 * 80)
    assert eu_rec.gpu_memory_gib_seconds == Decimal(4 * 3600 * 20)
    assert us.amount == Decimal("4.00") + Decimal(2 * 80) * Decimal("0.01")
    assert eu_rec.amount == Decimal("2.60") + Decimal(4 * 20) * Decimal("0.01")
    invoice = invoice_build(tenant=tenant, period_start=MARCH)
    lines = {ln.kind: ln for ln in InvoiceLine.objects.filter(invoice=invoice)}
    assert lines[LineKind.ON_DEMAND].amount == Decimal("6.60")
    memory = lines[LineKind.GPU_MEMORY]
    assert memory.amount == Decimal("2.40") and memory.quantity == Decimal(240) and memory.unit == "gib-hour"
    assert invoice.total == Decimal("9.00")
    # the usage page's month shows the memory line
    month = usage_by_day(tenant=tenant, period_start=MARCH)
    assert month.memory_gib_hours == Decimal(240) and month.memory_amount == Decimal("2.40")


def test_the_usage_api_and_page_show_gpu_memory(
    tenant,
    owner,
    priced,
    run,
    node,
    make_token,
    api,
    signed_in,  # noqa: F811
):
    run(tenant, utc(2024, 3, 2, 0), utc(2024, 3, 2, 2), fraction_milli=500)  # 1 GPU-hour: 40 GiB for 2 h
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    (row,) = api(make_token(tenant)).get("/api/v1/usage/?period=2024-03-01").json()["results"]
    assert Decimal(row["gpu_memory_gib_seconds"]) == 2 * 3600 * 40
    assert Decimal(row["gpu_memory_amount"]) == Decimal("0.80")
    html = signed_in(owner, tenant).get("/billing/usage/?month=2024-03").content.decode()
    assert "data-usage-gpu-memory" in html and "80.000 GiB-hours" in html


def test_estimates_and_the_launch_table_use_the_regions_price(
    tenant, priced, node, eu_node, h100, region, eu
):
    table = gpu_price_table(pairs=[(h100, region), (h100, eu)])
    assert table[price_key(h100, region)]["on_demand"] == Decimal("2.00")
    assert table[price_key(h100, eu)]["on_demand"] == Decimal("2.60")
    assert table[price_key(h100, eu)]["reserved"] == Decimal("1.80")
    mem = Decimal(80) * Decimal("0.01")  # one whole GPU holds its 80 GiB
    assert (
        hourly_estimate(tenant=tenant, gpu_models=[h100], regions=[region], gpu_count=1, fraction_milli=1000)[
            "on_demand"
        ]
        == Decimal("2.00") + mem
    )
    # anywhere: the dearest region
    assert (
        hourly_estimate(tenant=tenant, gpu_models=[h100], gpu_count=2, fraction_milli=1000)["on_demand"]
        == (Decimal("2.60") + mem) * 2
    )
    est = provider.estimate(
        tenant=tenant,
        gpu_model=h100,
        regions=[eu],
        gpu_count=1,
        fraction_milli=500,
        cpu_millicores=0,
        ram_mib=0,
    )
    assert est["on_demand"] == (Decimal("2.60") + mem) / 2


def test_reserved_fees_use_the_regions_reserved_price(tenant, priced, reserve, eu):
    r = reserve(tenant, utc(2024, 3, 1), utc(2024, 4, 1))
    r.region = eu
    r.save()
    invoice = invoice_build(tenant=tenant, period_start=MARCH)
    (fee,) = InvoiceLine.objects.filter(invoice=invoice, kind=LineKind.RESERVED_FEE)
    assert fee.amount == Decimal("1.80") * 730


def test_a_price_for_an_unknown_region_or_a_negative_memory_price_is_refused(priced, h100):
    with pytest.raises(ValidationFailed, match="region"):
        rate_card_version_create(
            rate_card=priced,
            effective_from=utc(2031, 1, 1),
            gpu_prices={(h100.pk, Plan.ON_DEMAND, 987654): "1"},
        )
    with pytest.raises(ValidationFailed, match="gpu_memory_gib_hour_price"):
        rate_card_version_create(
            rate_card=priced,
            effective_from=utc(2031, 1, 1),
            gpu_prices={(h100.pk, Plan.ON_DEMAND): "1"},
            gpu_memory_gib_hour_price="-1",
        )


def test_the_cost_estimate_api_prices_a_region(tenant, priced, node, eu_node, make_token, api):
    client = api(make_token(tenant))

    def estimate(**extra):
        body = {"gpu_model": "NVIDIA H100 SXM 80GB", "gpu_count": 1, **extra}
        return client.post("/api/v1/cost-estimate/", body, content_type="application/json")

    mem = Decimal(80) * Decimal("0.01")
    assert Decimal(estimate(region="us-east-1").json()["per_hour"]["on_demand"]) == Decimal("2.00") + mem
    assert Decimal(estimate(region="eu-west-1").json()["per_hour"]["on_demand"]) == Decimal("2.60") + mem
    assert Decimal(estimate().json()["per_hour"]["on_demand"]) == Decimal("2.60") + mem  # the dearest
    bad = estimate(region="mars-1")
    assert bad.status_code == 400 and "region" in bad.json()["error"]["fields"]


def test_the_reservation_quote_uses_the_regions_reserved_price(tenant, owner, priced, eu, signed_in):  # noqa: F811
    from tests.portal.conftest import HTMX

    client = signed_in(owner, tenant)
    form = {"gpu_model": "NVIDIA H100 SXM 80GB", "count": "1", "term": "1"}
    eu_html = client.get(
        "/billing/reservations/quote/", {**form, "region": "eu-west-1"}, **HTMX
    ).content.decode()
    us_html = client.get(
        "/billing/reservations/quote/", {**form, "region": "us-east-1"}, **HTMX
    ).content.decode()
    assert f'data-quote="monthly">{Decimal("1.80") * 730:.2f} USD<' in eu_html
    assert f'data-quote="monthly">{Decimal("1.50") * 730:.2f} USD<' in us_html


def test_the_cost_estimate_prices_only_where_the_minimum_versions_are_met(
    tenant, priced, node, eu_node, make_token, api
):
    """eu-west-1 is dearer; with min_cuda only us-east-1's upgraded node qualifies, so the estimate
    is us-east-1's price; with a minimum no node meets, a 400 names the field."""
    Node.objects.filter(pk=node.pk).update(driver_version="550.54.15", cuda_version="12.4")
    Node.objects.filter(pk=eu_node.pk).update(driver_version="525.60.13", cuda_version="12.0")
    client = api(make_token(tenant))

    def estimate(**extra):
        body = {"gpu_model": "NVIDIA H100 SXM 80GB", "gpu_count": 1, **extra}
        return client.post("/api/v1/cost-estimate/", body, content_type="application/json")

    mem = Decimal(80) * Decimal("0.01")
    assert Decimal(estimate(min_cuda="12").json()["per_hour"]["on_demand"]) == Decimal("2.60") + mem
    assert Decimal(estimate(min_cuda="12.4").json()["per_hour"]["on_demand"]) == Decimal("2.00") + mem
    none = estimate(min_cuda="12.4", region="eu-west-1")
    assert none.status_code == 400 and "no node with" in none.json()["error"]["fields"]["min_cuda"][0].lower()
    newest = estimate(min_driver="560")
    assert newest.status_code == 400 and "min_driver" in newest.json()["error"]["fields"]
    for field, value, reason in (
        ("min_cuda", "12.x", "Not a version"),
        ("min_rocm", "6.1", "has no ROCm"),
        ("min_driver", "550.0.dev1", "release version"),
    ):
        bad = estimate(**{field: value})
        assert bad.status_code == 400 and reason in bad.json()["error"]["fields"][field][0], bad.json()
