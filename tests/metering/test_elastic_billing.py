"""Elastic jobs are billed for the GPUs they hold, second by second: a resize ends and opens
allocation rows at the same instant, grown GPUs bill from the resize, and no resize adds the
per-allocation minimum."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest

from metering.models import UsageRecord
from metering.services.usage import usage_build
from scheduling.models import Allocation, Workload, WorkloadEvent
from scheduling.services.elastic import resize_apply
from tests.metering.conftest import utc

pytestmark = pytest.mark.django_db

T0 = utc(2024, 3, 5, 10)


def _elastic_job(tenant, node, h100, gpus: int, *, at=T0) -> Workload:
    w = Workload.objects.create(
        tenant=tenant, kind="job", state="running", image="img", gpu_count=gpus, started_at=at,
        elastic_min_gpus=1, elastic_max_gpus=8, elastic_target_gpus=8,
    )  # fmt: skip
    for i in range(gpus):
        Allocation.objects.create(
            tenant=tenant, workload=w, node=node, gpu=node.gpus.get(index=i), gpu_model=h100,
            plan="on_demand", started_at=at,
        )  # fmt: skip
    WorkloadEvent.objects.create(
        tenant=tenant, workload=w, at=at, from_state="starting", to_state="running", reason="started"
    )
    return w


def _stop(w, at):
    Allocation.objects.filter(workload=w, ended_at__isnull=True).update(ended_at=at, end_reason="stopped")


def _gpu_seconds(w) -> Decimal:
    return sum((r.gpu_seconds for r in UsageRecord.objects.filter(allocation__workload=w)), Decimal(0))


def test_shrink_then_grow_bills_exactly_the_gpu_minutes_held(tenant, card, node, h100):
    w = _elastic_job(tenant, node, h100, 4)
    # 4 GPUs for 10 min, 2 for the next 10, 4 again (2 grown) for the last 10: 40 + 20 + 40 = 100.
    resize_apply(workload=w, node_id=node.pk, indices=(0, 1), now=T0 + timedelta(minutes=10), reason="t")
    cmd, _, made = resize_apply(
        workload=w, node_id=node.pk, indices=(0, 1, 5, 6), now=T0 + timedelta(minutes=20), reason="t"
    )
    assert [a.gpu.index for a in made] == [5, 6] and cmd.payload["added_gpu_uuids"]
    assert cmd.payload["world_size"] == 4 and Workload.objects.get(pk=w.pk).gpu_count == 4
    _stop(w, T0 + timedelta(minutes=30))
    usage_build(now=T0 + timedelta(days=1))
    assert _gpu_seconds(w) == 100 * 60
    # 100 GPU-minutes at 2.00 per GPU-hour.
    amount = sum((r.amount for r in UsageRecord.objects.filter(allocation__workload=w)), Decimal(0))
    assert amount.quantize(Decimal("0.01")) == Decimal("3.33")


def test_a_gpu_held_for_97_seconds_bills_97_and_one_for_40_seconds_bills_40(tenant, card, node, h100):
    w = _elastic_job(tenant, node, h100, 1)
    # Grown by one GPU at 20 s, shrunk back at 60 s (40 s held); the job stops at 97 s.
    resize_apply(workload=w, node_id=node.pk, indices=(0, 3), now=T0 + timedelta(seconds=20), reason="t")
    resize_apply(workload=w, node_id=node.pk, indices=(0,), now=T0 + timedelta(seconds=60), reason="t")
    _stop(w, T0 + timedelta(seconds=97))
    usage_build(now=T0 + timedelta(days=1))
    by_gpu = {
        r.allocation.gpu.index: r.gpu_seconds
        for r in UsageRecord.objects.filter(allocation__workload=w).select_related("allocation__gpu")
    }
    # No minimum on the resized GPU (60 s): exactly its 40 s; the placement's GPU its 97 s.
    assert by_gpu == {0: Decimal(97), 3: Decimal(40)}


def test_a_failed_growth_bills_nothing_for_the_gpus_it_never_got(tenant, card, node, h100):
    from scheduling.services.elastic import resize_on_command_finished

    w = _elastic_job(tenant, node, h100, 2)
    cmd, _, made = resize_apply(
        workload=w, node_id=node.pk, indices=(0, 1, 2, 3), now=T0 + timedelta(minutes=5), reason="t"
    )
    assert len(made) == 2
    resize_on_command_finished(payload=cmd.payload, node_id=node.pk, state="failed")
    w.refresh_from_db()
    assert w.gpu_count == 2 and w.elastic_target_gpus == 2
    _stop(w, T0 + timedelta(minutes=10))
    usage_build(now=T0 + timedelta(days=1))
    assert _gpu_seconds(w) == 2 * 10 * 60
