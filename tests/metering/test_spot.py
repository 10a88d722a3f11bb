from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metering.models import SpotPrice, UsageRecord
from metering.services.spot import spot_formula, spot_prices_update
from metering.services.usage import usage_build
from scheduling.models import Allocation, Plan
from scheduling.pricing import gpu_prices
from tests.metering.conftest import utc

prices = st.decimals(min_value=0, max_value=100, places=4)
shares = st.decimals(min_value=0, max_value=1, places=5)


@given(prices, prices, shares, shares)
def test_the_spot_price_stays_between_floor_and_on_demand_and_rises_with_use(a, b, u1, u2):
    floor, on_demand = min(a, b), max(a, b)
    lo, hi = sorted([u1, u2])
    p_lo = spot_formula(floor=floor, on_demand=on_demand, utilisation=lo)
    p_hi = spot_formula(floor=floor, on_demand=on_demand, utilisation=hi)
    assert floor <= p_lo <= p_hi <= on_demand
    assert spot_formula(floor=floor, on_demand=on_demand, utilisation=Decimal(0)) == floor
    assert spot_formula(floor=floor, on_demand=on_demand, utilisation=Decimal(1)) == on_demand


@pytest.mark.django_db
def test_spot_prices_follow_utilisation_with_history_and_bill_spot_usage(tenant, card, run, node, h100):
    # 8 H100 at on-demand 2.00, floor 0.80: idle = 0.80; 4 of 8 in use: 0.80 + 1.20 * 0.25 = 1.10
    spot_prices_update(now=utc(2024, 3, 1))
    spot_prices_update(now=utc(2024, 3, 1, 0, 1))  # unchanged: no new row
    assert list(SpotPrice.objects.values_list("price", flat=True)) == [Decimal("0.8")]
    spot = run(tenant, utc(2024, 3, 1, 1), None, plan=Plan.SPOT, gpu_index=0)
    for i in range(1, 4):
        run(tenant, utc(2024, 3, 1, 1), None, gpu_index=i)
    spot_prices_update(now=utc(2024, 3, 1, 2))
    assert [r.price for r in SpotPrice.objects.order_by("at")] == [Decimal("0.8"), Decimal("1.1")]
    assert SpotPrice.objects.order_by("at").last().utilisation == Decimal("0.5")
    assert gpu_prices(gpu_model=h100, region=node.region)["spot"] == Decimal("1.1")
    Allocation.objects.filter(pk=spot.pk).update(ended_at=utc(2024, 3, 1, 4))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    recs = UsageRecord.objects.filter(allocation_id=spot.pk).order_by("start")
    # 1 h at 0.80 and 2 h at 1.10
    assert [(r.start, r.end, r.amount) for r in recs] == [
        (utc(2024, 3, 1, 1), utc(2024, 3, 1, 2), Decimal("0.8")),
        (utc(2024, 3, 1, 2), utc(2024, 3, 1, 4), Decimal("2.2")),
    ]


@pytest.mark.django_db
def test_a_spot_workload_is_preempted_when_the_price_passes_its_maximum(tenant, card, run, node):
    from nodes.models import NodeCommand
    from scheduling.models import Workload, WorkloadEvent

    # 4 of 8 H100 in use after the update: 0.80 + 1.20 x 0.5^2 = 1.10 per GPU-hour.
    cheap = run(tenant, utc(2024, 3, 1, 1), None, plan=Plan.SPOT, gpu_index=0)
    rich = run(tenant, utc(2024, 3, 1, 1), None, plan=Plan.SPOT, gpu_index=1)
    no_max = run(tenant, utc(2024, 3, 1, 1), None, plan=Plan.SPOT, gpu_index=2)
    on_demand = run(tenant, utc(2024, 3, 1, 1), None, gpu_index=3)
    Workload.objects.filter(pk=cheap.workload_id).update(spot_max_price=Decimal("1.0"))
    Workload.objects.filter(pk=rich.workload_id).update(spot_max_price=Decimal("1.5"))
    spot_prices_update(now=utc(2024, 3, 1, 2))
    assert SpotPrice.objects.order_by("at").last().price == Decimal("1.1")

    w = Workload.objects.get(pk=cheap.workload_id)
    assert w.state == "preempted"
    event = WorkloadEvent.objects.filter(workload=w, to_state="preempted").get()
    assert "1.1" in event.message and "1" in event.reason and "spot price" in event.reason
    command = NodeCommand.objects.get(node=node, kind="preempt_workload")
    assert command.payload["workload_id"] == str(w.pk) and command.payload["notice_s"] == 30
    for untouched in (rich, no_max, on_demand):
        assert Workload.objects.get(pk=untouched.workload_id).state == "running"
    # The next update (price unchanged) does not preempt it again.
    spot_prices_update(now=utc(2024, 3, 1, 2, 1))
    assert NodeCommand.objects.filter(kind="preempt_workload").count() == 1

    # Billing stops where the allocation ends (the agent reports the stop after the notice).
    Allocation.objects.filter(pk=cheap.pk).update(ended_at=utc(2024, 3, 1, 2, 0, 30), end_reason="preempted")
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    assert UsageRecord.objects.filter(allocation_id=cheap.pk).order_by("end").last().end == utc(
        2024, 3, 1, 2, 0, 30
    )


@pytest.mark.django_db
def test_the_gpu_catalog_prices_every_model_and_region_in_a_fixed_number_of_queries(
    tenant, card, node, h100, a100, make_token, django_assert_max_num_queries
):
    """Each region shows its own market spot price (the latest row), or the rate card's where it has
    none; the queries do not grow with the models and regions listed."""
    from django.test import Client

    from nodes.models import Gpu, Node, Region

    eu = Region.objects.create(code="eu-west-1", name="EU West")
    for region, model in ((eu, h100), (node.region, a100), (eu, a100)):
        other = Node.objects.create(hostname=f"price-{region.code}-{model.pk}", region=region)
        Gpu.objects.create(node=other, index=0, uuid=f"GPU-{other.pk}", model=model, reported_name=model.name)
    for model, region, day, price in (
        (h100, node.region, 1, "0.9"),
        (h100, node.region, 2, "1.3"),
        (a100, eu, 1, "0.55"),
    ):
        SpotPrice.objects.create(gpu_model=model, region=region, at=utc(2024, 3, day), price=Decimal(price),
                                 floor=Decimal("0.4"), on_demand=Decimal("2"), utilisation=Decimal("0.4"))  # fmt: skip
    client = Client(HTTP_AUTHORIZATION=f"Bearer {make_token(tenant)}")
    with django_assert_max_num_queries(16):
        body = client.get("/api/v1/gpu-types/").json()
    spot = {
        (t["name"], a["region"]): Decimal(a["price_per_gpu_hour"]["spot"])
        for t in body
        for a in t["availability"]
    }
    assert spot == {
        (h100.name, "us-east-1"): Decimal("1.3000"),
        (h100.name, "eu-west-1"): Decimal("0.8000"),
        (a100.name, "us-east-1"): Decimal("0.4000"),
        (a100.name, "eu-west-1"): Decimal("0.5500"),
    }
    assert gpu_prices(gpu_model=a100, region=eu)["on_demand"] == Decimal("1.00")
