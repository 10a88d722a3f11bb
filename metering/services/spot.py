"""Spot prices per GPU model and region.

Formula: with ``u`` the share of the region's schedulable capacity of that model that is allocated
(allocated thousandths over the capacity of healthy, not isolated GPUs on READY nodes; 0 when there
is none), the floor ``F`` the rate card's spot price and ``D`` its on-demand price,

    spot = F + (D - F) * u ** 2

so the price stays near the floor while the fleet is idle and reaches the on-demand price when it is
full. Rounded half-up to 10 places. A new row is stored only when the price changes: the rows are the
history, each in force from its ``at`` until the next one. Spot usage is rated at the price in force
at each instant (see ``services.usage``); with no row yet, at the rate card's spot price.

Maximum price: after every update, a placed spot workload whose ``spot_max_price`` (per GPU-hour,
like the market price) is below the market price in force where it runs is preempted through
scheduling's ``workload_preempt`` (notice, event naming the price, then requeued or stopped). Its
billing stops where its allocation ends, as for any preemption.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from datetime import datetime
from decimal import Decimal

from django.db.models import Count, Max, Q, Sum
from django.utils import timezone

from metering.models import SpotPrice
from metering.money import quantize_unit
from metering.services.rates import current_prices
from nodes.models import Gpu, GpuHealth, GpuModel, NodeState
from portal.errors import Conflict
from scheduling.models import MILLI, Allocation, Plan, Workload, WorkloadState

logger = logging.getLogger(__name__)
# Placed: holding GPUs and not already being preempted or stopped (scheduling's preemptible states).
PREEMPTIBLE_STATES = (WorkloadState.SCHEDULED, WorkloadState.STARTING, WorkloadState.RUNNING)


def spot_formula(*, floor: Decimal, on_demand: Decimal, utilisation: Decimal) -> Decimal:
    u = min(max(Decimal(utilisation), Decimal(0)), Decimal(1))
    return quantize_unit(floor + (on_demand - floor) * u * u)


def spot_prices_update(*, now: datetime | None = None) -> list[SpotPrice]:
    now = now or timezone.now()
    capacity = {
        (r["model_id"], r["node__region_id"]): r["n"] * MILLI
        for r in Gpu.objects.filter(
            model__isnull=False,
            removed_at__isnull=True,
            isolated=False,
            health=GpuHealth.HEALTHY,
            node__state=NodeState.READY,
        )
        .values("model_id", "node__region_id")
        .annotate(n=Count("pk"))
    }
    used = {
        (r["gpu_model_id"], r["node__region_id"]): r["m"]
        for r in Allocation.objects.filter(ended_at__isnull=True)
        .values("gpu_model_id", "node__region_id")
        .annotate(m=Sum("fraction_milli"))
    }
    made = []
    models = {m.pk: m for m in GpuModel.objects.filter(pk__in={k[0] for k in capacity})}
    for (model_id, region_id), cap in sorted(capacity.items()):
        prices = current_prices(gpu_model=models[model_id], at=now, region=region_id)
        floor, on_demand = prices.get("spot"), prices.get("on_demand")
        if floor is None or on_demand is None or on_demand < floor:
            continue
        u = Decimal(min(used.get((model_id, region_id), 0), cap)) / Decimal(cap)
        price = spot_formula(floor=floor, on_demand=on_demand, utilisation=u)
        last = SpotPrice.objects.filter(gpu_model_id=model_id, region_id=region_id).order_by("-at").first()
        if last is not None and last.price == price:
            continue
        made.append(
            SpotPrice.objects.create(
                gpu_model_id=model_id,
                region_id=region_id,
                at=now,
                price=price,
                floor=floor,
                on_demand=on_demand,
                utilisation=u.quantize(Decimal("0.00001")),
            )
        )
    spot_preempt_over_max(now=now)
    return made


def spot_preempt_over_max(*, now: datetime | None = None) -> list[int]:
    """Preempt every placed spot workload whose maximum price is below the market price in force
    in a region and model it holds GPUs of. Returns the ids preempted."""
    from scheduling.services import workload_preempt

    now = now or timezone.now()
    held = list(
        Allocation.objects.filter(
            ended_at__isnull=True,
            plan=Plan.SPOT,
            workload__spot_max_price__isnull=False,
            workload__state__in=PREEMPTIBLE_STATES,
        )
        .values_list("workload_id", "gpu_model_id", "node__region_id", "workload__spot_max_price")
        .order_by("workload_id")
    )
    if not held:
        return []
    history = SpotHistory({(model_id, region_id) for _, model_id, region_id, _ in held})
    over: dict[int, tuple[Decimal, Decimal]] = {}
    for workload_id, model_id, region_id, max_price in held:
        price = history.at(model_id, region_id, now)
        if price is not None and price > max_price and workload_id not in over:
            over[workload_id] = (price, max_price)
    preempted = []
    for workload in Workload.objects.filter(pk__in=over).order_by("pk"):
        price, max_price = over[workload.pk]
        reason = f"spot price {price.normalize():f} above max {max_price.normalize():f}"
        try:
            workload_preempt(workload=workload, reason=reason[:64])
        except Conflict as exc:  # it stopped or was preempted meanwhile
            logger.info("Spot workload %s not preempted: %s", workload.pk, exc)
            continue
        preempted.append(workload.pk)
    return preempted


def current_spot_prices(*, pairs) -> dict[tuple[int, int], Decimal]:
    """The market price now of each (gpu_model, region) pair that has one, in two queries:
    ``{(model pk, region pk): price}`` (pairs without a region, or without a price, are left out)."""
    keys = {(m.pk, r.pk) for m, r in pairs if r is not None}
    if not keys:
        return {}
    models, regions = {m for m, _ in keys}, {r for _, r in keys}
    latest = (
        SpotPrice.objects.filter(gpu_model_id__in=models, region_id__in=regions, at__lte=timezone.now())
        .values("gpu_model_id", "region_id")
        .annotate(last=Max("at"))
        .order_by()
    )
    wanted = Q()
    for row in latest:
        if (row["gpu_model_id"], row["region_id"]) in keys:
            wanted |= Q(gpu_model_id=row["gpu_model_id"], region_id=row["region_id"], at=row["last"])
    if not wanted:
        return {}
    return {
        (model_id, region_id): price
        for model_id, region_id, price in SpotPrice.objects.filter(wanted).values_list(
            "gpu_model_id", "region_id", "price"
        )
    }


class SpotHistory:
    """Spot price rows of some (model, region) pairs, loaded once, for rating many intervals."""

    def __init__(self, pairs):
        pairs = set(pairs)
        self.rows: dict[tuple[int, int], list[tuple[datetime, Decimal]]] = {}
        if not pairs:
            return
        q = Q()
        for model_id, region_id in pairs:
            q |= Q(gpu_model_id=model_id, region_id=region_id)
        for model_id, region_id, at, price in (
            SpotPrice.objects.filter(q).order_by("at").values_list("gpu_model_id", "region_id", "at", "price")
        ):
            self.rows.setdefault((model_id, region_id), []).append((at, price))

    def changes(self, model_id: int, region_id: int, start: datetime, end: datetime) -> list[datetime]:
        return [at for at, _ in self.rows.get((model_id, region_id), ()) if start < at < end]

    def at(self, model_id: int, region_id: int, when: datetime) -> Decimal | None:
        rows = self.rows.get((model_id, region_id), [])
        i = bisect_right([r[0] for r in rows], when)
        return rows[i - 1][1] if i else None
