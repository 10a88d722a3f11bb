"""Allocations of Slurm jobs are billed as Slurm accounted them: from their own start (Slurm's) to
their own end (sacct's), not from the workload's RUNNING event; a run sacct records as 0 s is one
record of 0 s with the minimum; one closed before sacct had its end waits for it."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import override_settings

from metering.models import UsageRecord
from metering.services.usage import usage_build
from scheduling.models import SLURM_RELEASED, Allocation
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db

T0 = utc(2024, 3, 5, 10)
DONE = "slurm_completed"  # sacct's end is in


def _slurm(a: Allocation, label: str = "4242") -> Allocation:
    Allocation.objects.filter(pk=a.pk).update(slurm_job_label=label)
    a.refresh_from_db()
    return a


def _records(a: Allocation) -> list[UsageRecord]:
    return list(UsageRecord.objects.filter(allocation=a).order_by("start"))


def test_a_slurm_allocation_bills_from_slurms_start_not_the_running_event(tenant, card, run):
    # Slurm started it at T0 (whole seconds); gpupool's RUNNING event came 0.7 s later.
    later = T0 + timedelta(milliseconds=700)
    slurm = _slurm(run(tenant, T0, T0 + timedelta(seconds=125), running_at=later, end_reason=DONE))
    agent = run(tenant, T0, T0 + timedelta(seconds=125), running_at=later)  # the control
    usage_build(now=T0 + timedelta(days=1))
    (rec,) = _records(slurm)
    assert (rec.start, rec.end, rec.seconds, rec.minimum_topup_s) == (
        T0,
        T0 + timedelta(seconds=125),
        Decimal(125),
        Decimal(0),
    )
    (other,) = _records(agent)
    assert other.start == later and other.seconds == Decimal("124.3")


@override_settings(METERING_MINIMUM_BILLABLE_S=60)
def test_a_slurm_run_of_zero_seconds_is_one_record_with_the_minimum(tenant, card, run):
    slurm = _slurm(run(tenant, T0, T0, end_reason=DONE))
    agent = run(tenant, T0, T0)  # an agent's allocation that ended as it began never ran
    first = usage_build(now=T0 + timedelta(days=1))
    (rec,) = _records(slurm)
    assert (rec.start, rec.end, rec.seconds, rec.minimum_topup_s) == (T0, T0, Decimal(0), Decimal(60))
    assert rec.gpu_seconds == 60 and rec.amount == Decimal("0.0333333333")  # 60 s at 2.00/h
    assert _records(agent) == [] and first.created == 1
    again = usage_build(now=T0 + timedelta(days=1))
    assert again.created == 0 and len(_records(slurm)) == 1


def test_a_slurm_allocation_over_a_month_end_bills_every_second_once(tenant, card, run):
    start = utc(2024, 3, 31, 23, 59, 0)
    a = _slurm(run(tenant, start, None, running_at=start + timedelta(milliseconds=400)))
    # Open: its finished month is recorded from Slurm's start.
    usage_build(now=utc(2024, 4, 1, 0, 0, 30))
    assert [(r.start, r.end) for r in _records(a)] == [(start, utc(2024, 4, 1))]
    # sacct's end; rebuilt twice.
    Allocation.objects.filter(pk=a.pk).update(ended_at=utc(2024, 4, 1, 0, 1, 0), end_reason=DONE)
    usage_build(now=utc(2024, 4, 1, 1))
    usage_build(now=utc(2024, 4, 1, 2))
    records = _records(a)
    assert [(r.start, r.end) for r in records] == [
        (start, utc(2024, 4, 1)),
        (utc(2024, 4, 1), utc(2024, 4, 1, 0, 1, 0)),
    ]
    assert sum(r.seconds for r in records) == 120


@pytest.mark.parametrize("closed_by", [SLURM_RELEASED, "stopped"])
def test_a_slurm_allocation_closed_before_sacct_has_its_end_waits_for_it(tenant, card, run, closed_by):
    # gpupool closed it at T0+90 s (another Slurm job took its GPU, or a stop gpupool forced);
    # sacct says it ended at T0+75 s.
    a = _slurm(run(tenant, T0, T0 + timedelta(seconds=90), end_reason=closed_by))
    usage_build(now=T0 + timedelta(seconds=95))
    assert _records(a) == []
    Allocation.objects.filter(pk=a.pk).update(ended_at=T0 + timedelta(seconds=75), end_reason=DONE)
    usage_build(now=T0 + timedelta(seconds=100))
    (rec,) = _records(a)
    assert (rec.end, rec.seconds) == (T0 + timedelta(seconds=75), Decimal(75))
