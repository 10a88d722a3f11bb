"""A spot request with a maximum price only goes where the spot price is at or below it, and waits
with the reason "price" while it is above it everywhere (no place-preempt-place churn)."""

from decimal import Decimal

import pytest

from scheduling.models import Allocation, WorkloadState
from scheduling.pricing import register_price_provider, unregister_price_provider
from tests.scheduling.conftest import reload

pytestmark = pytest.mark.django_db


class MarketPrices:
    """Spot prices per region code, as metering's provider gives them from its market history."""

    def __init__(self, spot: dict[str, str]) -> None:
        self.spot = {code: Decimal(p) for code, p in spot.items()}

    def prices(self, *, gpu_model, region):
        return {"on_demand": Decimal("3"), "spot": self.spot.get(region.code), "reserved": None}

    def spot_floor(self, *, gpu_model, region):
        return Decimal("0.10")


@pytest.fixture
def market():
    provider = MarketPrices({"us-east-1": "2.00", "eu-west-1": "0.50"})
    register_price_provider(provider)
    yield provider
    unregister_price_provider(provider)


def _region_of(w) -> str:
    return Allocation.objects.filter(workload=w).values_list("node__region__code", flat=True).first()


def test_spot_work_goes_only_where_the_price_is_within_its_maximum(market, make_node, submit, tenant, cycle):
    make_node(region="us")
    make_node(region="eu")
    affordable = submit(tenant, plan="spot", gpu_count=1, spot_max_price="1.00")
    too_cheap = submit(tenant, plan="spot", gpu_count=1, spot_max_price="0.30")
    no_max = submit(tenant, plan="spot", gpu_count=1)
    cycle()

    assert reload(affordable).state == WorkloadState.SCHEDULED and _region_of(affordable) == "eu-west-1"
    assert reload(no_max).state == WorkloadState.SCHEDULED
    waiting = reload(too_cheap)
    assert waiting.state == WorkloadState.QUEUED
    assert waiting.pending_reason == "price"
    assert "spot price" in waiting.pending_message

    # The market falls in eu: the next cycle places it there.
    market.spot["eu-west-1"] = Decimal("0.25")
    cycle()
    placed = reload(too_cheap)
    assert placed.state == WorkloadState.SCHEDULED and _region_of(placed) == "eu-west-1"


def test_a_region_bound_request_waits_on_price_even_with_free_gpus(market, make_node, submit, tenant, cycle):
    make_node(region="us")
    w = submit(
        tenant, plan="spot", gpu_count=1, spot_max_price="1.50", region="us-east-1", other_regions_ok=False
    )
    cycle()
    w = reload(w)
    assert w.state == WorkloadState.QUEUED and w.pending_reason == "price"
    market.spot["us-east-1"] = Decimal("1.50")  # at the maximum is fine
    cycle()
    assert reload(w).state == WorkloadState.SCHEDULED
