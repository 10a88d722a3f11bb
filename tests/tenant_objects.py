"""How the cross-tenant test makes one object of a tenant-owned model.

model_bakery fills any model; a model it cannot build (check constraints, required JSON shapes)
gets its own maker here, keyed by ``app_label.ModelName``.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db.models import Model
from model_bakery import baker

MAKERS: dict[str, Callable[..., Model]] = {}


def make_tenant_object(model: type[Model], *, tenant) -> Model:
    maker = MAKERS.get(model._meta.label)
    if maker is not None:
        return maker(tenant=tenant)
    return baker.make(model, tenant=tenant)


def _make_reservation(*, tenant):
    from datetime import timedelta

    from django.utils import timezone

    start = timezone.now()
    return baker.make(
        "scheduling.Reservation", tenant=tenant, starts_at=start, ends_at=start + timedelta(days=1), count=1
    )


MAKERS["scheduling.Reservation"] = _make_reservation


def _make_invoice(*, tenant):
    from datetime import date

    from metering.models import Invoice

    return Invoice.objects.create(tenant=tenant, period_start=date(2024, 3, 1), period_end=date(2024, 4, 1))


def _make_usage_record(*, tenant):
    from datetime import UTC, date, datetime

    from django.utils import timezone

    from metering.models import RateCard, RateCardVersion, UsageRecord
    from nodes.models import Gpu, GpuModel, Node, Region
    from scheduling.models import Allocation, Workload

    model = GpuModel.objects.order_by("pk").first()
    region, _ = Region.objects.get_or_create(code="maker-region", defaults={"name": "Maker"})
    node = Node.objects.create(hostname=f"maker-{tenant.pk}-{timezone.now().timestamp()}", region=region)
    gpu = Gpu.objects.create(
        node=node, index=0, uuid=f"GPU-maker-{node.pk}", model=model, reported_name=model.name
    )
    card, _ = RateCard.objects.get_or_create(name="maker card")
    version = RateCardVersion.objects.filter(rate_card=card).first() or RateCardVersion.objects.create(
        rate_card=card, number=1, effective_from=datetime(2020, 1, 1, tzinfo=UTC)
    )
    start, end = datetime(2024, 3, 1, tzinfo=UTC), datetime(2024, 3, 1, 1, tzinfo=UTC)
    workload = Workload.objects.create(tenant=tenant, kind="job", image="img")
    allocation = Allocation.objects.create(
        tenant=tenant,
        workload=workload,
        node=node,
        gpu=gpu,
        gpu_model=model,
        plan="on_demand",
        started_at=start,
        ended_at=end,
    )
    return UsageRecord.objects.create(
        tenant=tenant,
        allocation=allocation,
        workload=workload,
        gpu_model=model,
        region=region,
        plan="on_demand",
        period_start=date(2024, 3, 1),
        version=version,
        start=start,
        end=end,
        fraction_milli=1000,
        seconds=3600,
        gpu_seconds=3600,
        unit_price=2,
        amount=2,
    )


MAKERS["metering.Invoice"] = _make_invoice
MAKERS["metering.UsageRecord"] = _make_usage_record
