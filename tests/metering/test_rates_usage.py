from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metering.models import RateCardVersion, UsageRecord
from metering.services.rates import current_prices, rate_card_version_create
from metering.services.usage import usage_build
from nodes.models import GpuMinuteRollup
from portal.errors import ValidationFailed
from scheduling.models import Plan
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db


def test_a_price_change_closes_the_open_version_and_never_starts_in_the_past(card, h100):
    now = timezone.now()
    with pytest.raises(ValidationFailed) as exc:
        rate_card_version_create(
            rate_card=card, effective_from=now - timedelta(days=1), gpu_prices={}, now=now
        )
    assert "effective_from" in exc.value.fields
    v2 = rate_card_version_create(
        rate_card=card,
        effective_from=now + timedelta(days=1),
        gpu_prices={(h100.pk, "on_demand"): "3"},
        now=now,
    )
    v1 = RateCardVersion.objects.get(rate_card=card, number=1)
    assert v1.effective_to == v2.effective_from and v2.number == 2
    assert current_prices(gpu_model=h100, at=now)["on_demand"] == Decimal("2")
    assert current_prices(gpu_model=h100, at=now + timedelta(days=2))["on_demand"] == Decimal("3")


@pytest.mark.parametrize("bad", ["-1", "abc", "NaN"])
def test_negative_or_non_numeric_prices_are_refused(card, h100, bad):
    with pytest.raises(ValidationFailed) as exc:
        rate_card_version_create(
            rate_card=card,
            effective_from=timezone.now() + timedelta(days=1),
            gpu_prices={(h100.pk, "spot"): bad},
        )
    assert "price_per_gpu_hour" in exc.value.fields


def test_overlapping_versions_are_refused_by_the_service_and_the_database(card, h100):
    start = timezone.now() + timedelta(days=10)
    rate_card_version_create(
        rate_card=card, effective_from=start, effective_to=start + timedelta(days=5), gpu_prices={}
    )
    with pytest.raises(ValidationFailed) as exc:
        rate_card_version_create(
            rate_card=card,
            effective_from=start + timedelta(days=1),
            effective_to=start + timedelta(days=2),
            gpu_prices={},
        )
    assert "overlaps version" in exc.value.message
    with pytest.raises(IntegrityError), transaction.atomic():
        RateCardVersion.objects.create(
            rate_card=card,
            number=99,
            effective_from=start + timedelta(days=2),
            effective_to=start + timedelta(days=3),
        )


def test_usage_is_per_second_with_fractions_cpu_and_telemetry(tenant, card, run):
    v = RateCardVersion.objects.get(rate_card=card)
    RateCardVersion.objects.filter(pk=v.pk).update(
        vcpu_hour_price=Decimal("0.036"), ram_gib_hour_price=Decimal("0.0036")
    )
    a = run(
        tenant,
        utc(2024, 3, 5, 10),
        utc(2024, 3, 5, 11, 30),
        fraction_milli=500,
        cpu_millicores=4000,
        ram_mib=16 * 1024,
    )
    for m in range(3):
        GpuMinuteRollup.objects.create(
            gpu_id=a.gpu_id,
            minute=utc(2024, 3, 5, 10, m),
            sample_count=6,
            util_sum=6 * (40 + 10 * m),
            util_count=6,
            mem_used_sum=6 * 1000,
            mem_used_count=6,
        )
    result = usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    assert result.created == 1 and not result.unrated
    rec = UsageRecord.objects.get()
    assert rec.seconds == 5400 and rec.gpu_seconds == 2700
    assert rec.vcpu_seconds == 4 * 5400 and rec.ram_gib_seconds == 16 * 5400
    # 0.75 GPU-hour x 2.00 + 6 vCPU-hours x 0.036 + 24 GiB-hours x 0.0036
    assert rec.amount == Decimal("1.5") + Decimal("0.216") + Decimal("0.0864")
    assert rec.avg_util_pct == pytest.approx(50.0) and rec.avg_mem_used_mib == pytest.approx(1000.0)


def test_the_minimum_is_billed_and_a_never_started_allocation_is_not(tenant, card, run):
    run(tenant, utc(2024, 3, 5, 10), utc(2024, 3, 5, 10, 0, 20))
    never = run(tenant, utc(2024, 3, 6, 10), utc(2024, 3, 6, 10, 5), running_at=utc(2024, 3, 6, 11))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    rec = UsageRecord.objects.get()
    assert rec.seconds == 20 and rec.minimum_topup_s == 40 and rec.gpu_seconds == 60
    assert not UsageRecord.objects.filter(allocation=never).exists()


def test_billing_stops_at_the_last_heartbeat_of_a_node_that_went_down(tenant, card, run, node):
    node.last_heartbeat_at = utc(2024, 3, 5, 10, 10)
    node.save()
    run(tenant, utc(2024, 3, 5, 10), utc(2024, 3, 5, 10, 13), end_reason="node_down")
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1))
    assert UsageRecord.objects.get().end == utc(2024, 3, 5, 10, 10)


def test_a_price_change_and_a_month_end_split_the_interval_and_reruns_change_nothing(tenant, card, run, h100):
    rate_card_version_create(
        rate_card=card,
        effective_from=utc(2024, 3, 31, 12),
        gpu_prices={(h100.pk, Plan.ON_DEMAND): "4.00"},
        allow_past=True,
    )
    run(tenant, utc(2024, 3, 31, 10), utc(2024, 4, 1, 2))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 5, 1))
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 5, 1))
    recs = list(UsageRecord.objects.order_by("start"))
    assert [(r.start, r.end) for r in recs] == [
        (utc(2024, 3, 31, 10), utc(2024, 3, 31, 12)),
        (utc(2024, 3, 31, 12), utc(2024, 4, 1)),
        (utc(2024, 4, 1), utc(2024, 4, 1, 2)),
    ]
    assert [r.amount for r in recs] == [Decimal(4), Decimal(48), Decimal(8)]
    assert [str(r.period_start) for r in recs] == ["2024-03-01", "2024-03-01", "2024-04-01"]


def test_an_open_allocation_records_only_its_finished_months(tenant, card, run):
    a = run(tenant, utc(2024, 3, 31, 22), None)
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 1, 1))
    assert [(r.start, r.end) for r in UsageRecord.objects.all()] == [(utc(2024, 3, 31, 22), utc(2024, 4, 1))]
    a.ended_at = utc(2024, 4, 1, 3)
    a.save()
    usage_build(since=utc(2024, 1, 1), now=utc(2024, 4, 2))
    assert UsageRecord.objects.count() == 2 and sum(r.seconds for r in UsageRecord.objects.all()) == 5 * 3600


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.integers(min_value=0, max_value=60 * 86400),
    st.integers(min_value=60, max_value=90 * 86400),
    st.sampled_from([1000, 500, 250, 1]),
)
def test_gpu_seconds_are_conserved_across_any_split(tenant, card, run, offset_s, length_s, fraction):
    UsageRecord.objects.all().delete()
    start = utc(2024, 1, 20) + timedelta(seconds=offset_s)
    end = start + timedelta(seconds=length_s)
    a = run(tenant, start, end, fraction_milli=fraction)
    usage_build(since=utc(2024, 1, 1), now=utc(2025, 1, 1))
    recs = UsageRecord.objects.filter(allocation=a)
    assert sum(r.seconds for r in recs) == length_s
    assert sum(r.gpu_seconds for r in recs) == Decimal(length_s) * fraction / 1000
