"""Usage records from allocation intervals.

What is billed of an allocation: from the agent-reported start (the workload's first RUNNING event
at or after the allocation was made, before it ended) to the allocation's end as scheduling records
it (stop, exit, preemption, failure); when it ended because its node went DOWN, at the node's last
heartbeat if that is earlier. An allocation that never started bills nothing.

Slurm regions (``scheduling.services.slurm``): an allocation of a Slurm job (``slurm_job_label``)
is billed from its own start to its own end, which are Slurm's: its start as squeue and sacct give
it, its end as sacct records it. So every second sacct accounts is billed once, also for a job
gpupool never saw running, and a run sacct records as 0 s (it started and ended in the same whole
second) is one record of 0 s with the minimum below. Its end is final once it is sacct's (its
``end_reason`` ``slurm_<state>``) or gpupool's word on a run sacct no longer keeps
(``slurm_requeued``); one closed otherwise before sacct had its end (``slurm_released``: Slurm gave
its GPUs to another job first; a stop gpupool forced) is billed as still open until then.

Warm pools: a warm slot holds no allocation; its time, from its creation until a request binds it or
it is released, is the platform's cost (``PlatformCost`` rows, never on an invoice). A workload
bound to a warm slot is billed from the bind (its allocation's start), once it has run: the GPU
passes from the platform to the tenant at that instant.

The interval is cut at every month boundary (UTC) and every price-version boundary, giving one
record per piece, keyed by (allocation, period, version, start): building again makes the same keys
and ``ignore_conflicts`` keeps the first, so reruns and replays never bill twice. A piece is only
recorded once it is final: when the allocation has ended, or when the piece ends at a boundary that
is already past (an open allocation's completed months and price versions).

Volumes are billed by the same run, per GiB-hour of their size (``metering.services.storage``).

GPU memory (a rate card version's ``gpu_memory_gib_hour_price``): a record holds the share of its
GPU's memory the allocation was given, ``gpu_seconds`` times the model's GiB, as
``gpu_memory_gib_seconds``; on-demand and spot records add its price to ``amount`` and keep that
part in ``gpu_memory_amount`` (the invoice's "GPU memory" line). Reserved usage is covered by the
fee. Prices are the region's own where the card has one (``PricedVersion.price``).

Per-second billing with a minimum (``METERING_MINIMUM_BILLABLE_S``, default 60): an allocation that
ran less than the minimum bills the minimum; the difference is added to its last piece.

Elastic jobs (``scheduling.services.elastic``): each GPU is its own allocation, so the bill follows
the GPUs held second by second. A GPU a resize gives a running job (``Allocation.resized``) is billed
from that instant, as a warm bind is; a GPU a resize takes away ends then (``end_reason`` "resized").
Neither gets the minimum: a resize bills exactly the seconds each GPU was held. vCPUs and RAM stay
with the GPUs of the placement (a grown GPU carries none; a shrunk-away GPU's share ends with it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from django.conf import settings
from django.db.models import Exists, Max, OuterRef, Q, Sum
from django.utils import timezone

from metering.models import PlatformCost, StorageUsageRecord, UsageRecord
from metering.money import HOUR, ZERO, quantize_unit
from metering.periods import period_bounds, period_of, period_starts_between, previous_period, split_interval
from metering.services.rates import PriceBook, TenantPricing, discounted
from metering.services.spot import SpotHistory
from metering.services.storage import storage_accrued, storage_usage_build
from nodes.models import GpuMinuteRollup, GpuModel
from scheduling.models import (
    MILLI,
    SLURM_RELEASED,
    Allocation,
    Plan,
    Reservation,
    WarmSlot,
    WorkloadEvent,
    WorkloadState,
)

NODE_DOWN_REASONS = frozenset({"node_down"})
RESIZED = "resized"  # an elastic job's GPU taken back by a resize


@dataclass
class UsageBuildResult:
    created: int = 0
    unchanged: int = 0
    unrated: list[str] = field(default_factory=list)
    storage_created: int = 0  # volumes' records (metering.services.storage)


def _seconds(delta) -> Decimal:
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / Decimal(1_000_000)


def billable_interval(
    allocation: Allocation, *, started: datetime | None
) -> tuple[datetime, datetime | None] | None:
    """The billed ``[start, end)`` of an allocation (end None while it runs), or None if it never
    started. ``started`` is the workload's first RUNNING event inside the allocation."""
    if started is None:
        return None
    end = allocation.ended_at
    if end is not None and allocation.end_reason in NODE_DOWN_REASONS:
        last = allocation.node.last_heartbeat_at
        if last is not None and started <= last < end:
            end = last
    if end is not None and end <= started:
        return None
    return started, end


def _running_events(allocations: list[Allocation]) -> dict[int, list[datetime]]:
    ids = {a.workload_id for a in allocations}
    out: dict[int, list[datetime]] = defaultdict(list)
    for wid, at in (
        WorkloadEvent.objects.filter(workload_id__in=ids, to_state=WorkloadState.RUNNING)
        .order_by("at")
        .values_list("workload_id", "at")
    ):
        out[wid].append(at)
    return out


def _start_of(allocation: Allocation, events: dict[int, list[datetime]]) -> datetime | None:
    for at in events.get(allocation.workload_id, ()):
        if at >= allocation.started_at and (allocation.ended_at is None or at < allocation.ended_at):
            return at
    return None


def _running_at(allocation: Allocation, events: dict[int, list[datetime]]) -> datetime | None:
    """The allocation's start if its workload had started running by then (an elastic grow)."""
    if any(at <= allocation.started_at for at in events.get(allocation.workload_id, ())):
        return allocation.started_at
    return None


def _per_gpu_share(
    allocation: Allocation, siblings: dict[tuple[int, int, datetime], int]
) -> tuple[Decimal, Decimal]:
    """vCPUs and GiB of RAM one allocation carries: the workload's per-node figures shared by its
    allocations made on that node in the same placement."""
    if allocation.resized:
        # A resize changes the GPUs, not the job's vCPUs and RAM: those stay with the placement's GPUs.
        return ZERO, ZERO
    w = allocation.workload
    n = siblings.get((allocation.workload_id, allocation.node_id, allocation.started_at), 1) or 1
    return Decimal(w.cpu_millicores) / Decimal(1000) / n, Decimal(w.ram_mib) / Decimal(1024) / n


def _telemetry(gpu_id: int, start: datetime, end: datetime) -> tuple[float | None, float | None]:
    floor = start.replace(second=0, microsecond=0)
    agg = GpuMinuteRollup.objects.filter(gpu_id=gpu_id, minute__gte=floor, minute__lt=end).aggregate(
        us=Sum("util_sum"), uc=Sum("util_count"), ms=Sum("mem_used_sum"), mc=Sum("mem_used_count")
    )
    util = agg["us"] / agg["uc"] if agg["uc"] else None
    mem = agg["ms"] / agg["mc"] if agg["mc"] else None
    return util, mem


class _Rater:
    """Rates pieces of many allocations with what they share, loaded once: RUNNING events, warm
    bindings, sibling allocations (for vCPU and RAM shares), the tenants' price books and the spot
    price history. ``usage_build`` records its final pieces; ``costs_to_date`` prices the open
    ones up to now with the same code."""

    def __init__(self, allocations: list[Allocation]):
        self.events = _running_events(allocations)
        self.warm = _warm_bound(allocations)
        self.siblings: dict[tuple[int, int, datetime], int] = defaultdict(int)
        for a in Allocation.objects.filter(workload_id__in={a.workload_id for a in allocations}).values(
            "workload_id", "node_id", "started_at"
        ):
            self.siblings[(a["workload_id"], a["node_id"], a["started_at"])] += 1
        self.pricing = TenantPricing()
        self.pricing.load({a.tenant_id for a in allocations})
        self.spot = SpotHistory(
            (a.gpu_model_id, a.node.region_id) for a in allocations if a.plan == Plan.SPOT
        )
        self.unrated: list[str] = []
        self._memory = dict(
            GpuModel.objects.filter(pk__in={a.gpu_model_id for a in allocations}).values_list(
                "pk", "memory_gib"
            )
        )

    def memory_gib(self, gpu_model_id: int) -> Decimal:
        """GiB of memory on one whole GPU of the model."""
        return Decimal(self._memory.get(gpu_model_id) or 0)

    def span(self, a: Allocation) -> tuple[datetime, datetime | None] | None:
        if a.slurm_job_label:
            # Slurm's own start and end (sacct's), whatever the workload's events say.
            final = a.end_reason.startswith("slurm_") and a.end_reason != SLURM_RELEASED
            return a.started_at, a.ended_at if final else None
        started = _start_of(a, self.events)
        if started is None and a.resized:
            # Given to a running elastic job: it runs on it from the resize (while the job ran).
            started = _running_at(a, self.events)
        if started is not None and (a.workload_id, a.gpu_id, a.started_at) in self.warm:
            # Bound to a warm slot: the tenant pays from the bind (until then the platform did).
            started = a.started_at
        return billable_interval(a, started=started)

    def cuts(self, a: Allocation, start: datetime, end: datetime) -> list[datetime]:
        cuts = period_starts_between(start, end) + self.pricing.book(a.tenant_id).boundaries(start, end)
        if a.plan == Plan.SPOT:
            cuts += self.spot.changes(a.gpu_model_id, a.node.region_id, start, end)
        return cuts

    def rate(self, a: Allocation, s: datetime, e: datetime, *, topup: Decimal, now: datetime):
        """The usage record of ``[s, e)`` of ``a`` (unsaved), or None when it has no price."""
        book, discount = self.pricing.book(a.tenant_id), self.pricing.account(a.tenant_id).discount_percent
        priced = book.at(s)
        if priced is None:
            self.unrated.append(f"allocation {a.pk}: no price version in force at {s.isoformat()}")
            return None
        plan_price = priced.price(a.gpu_model_id, a.plan, a.node.region_id)
        if a.plan == Plan.SPOT:
            # The market price in force, when there is one (see services.spot).
            market = self.spot.at(a.gpu_model_id, a.node.region_id, s)
            plan_price = market if market is not None else plan_price
        if plan_price is None:
            self.unrated.append(
                f"allocation {a.pk}: version {priced.version.number} has no {a.plan} price for "
                f"GPU model {a.gpu_model_id}"
            )
            return None
        vcpus, ram_gib = _per_gpu_share(a, self.siblings)
        seconds = _seconds(e - s)
        billed = seconds + topup
        gpu_seconds = billed * Decimal(a.fraction_milli) / Decimal(MILLI)
        vcpu_seconds = billed * vcpus
        ram_seconds = billed * ram_gib
        memory_seconds = gpu_seconds * self.memory_gib(a.gpu_model_id)
        memory_amount = ZERO
        # Reserved usage is covered by the reservation's fee; usage above its GPUs is billed
        # on-demand on the invoice (see services.invoices).
        unit = ZERO if a.plan == Plan.RESERVED else discounted(plan_price, discount)
        amount = gpu_seconds * unit / HOUR
        if a.plan != Plan.RESERVED:
            v = priced.version
            if v.vcpu_hour_price is not None:
                amount += vcpu_seconds * discounted(v.vcpu_hour_price, discount) / HOUR
            if v.ram_gib_hour_price is not None:
                amount += ram_seconds * discounted(v.ram_gib_hour_price, discount) / HOUR
            if v.gpu_memory_gib_hour_price is not None:
                memory_amount = quantize_unit(
                    memory_seconds * discounted(v.gpu_memory_gib_hour_price, discount) / HOUR
                )
                amount += memory_amount
        return UsageRecord(
            tenant_id=a.tenant_id,
            allocation=a,
            workload_id=a.workload_id,
            gpu_model_id=a.gpu_model_id,
            region_id=a.node.region_id,
            plan=a.plan,
            period_start=period_of(s),
            version=priced.version,
            start=s,
            end=e,
            fraction_milli=a.fraction_milli,
            seconds=seconds,
            minimum_topup_s=topup,
            gpu_seconds=gpu_seconds,
            vcpu_seconds=vcpu_seconds,
            ram_gib_seconds=ram_seconds,
            gpu_memory_gib_seconds=memory_seconds,
            gpu_memory_amount=memory_amount,
            unit_price=unit,
            amount=quantize_unit(amount),
            created_at=now,
        )


def _warm_bound(allocations: list[Allocation]) -> set[tuple[int, int, datetime]]:
    """(workload, GPU, bind time) of the warm slots the allocations' workloads were bound to."""
    return set(
        WarmSlot.objects.filter(
            bound_to_id__in={a.workload_id for a in allocations}, end_reason="bound"
        ).values_list("bound_to_id", "gpu_id", "ended_at")
    )


def usage_build(
    *, tenant=None, since: datetime | None = None, now: datetime | None = None
) -> UsageBuildResult:
    """Record the final pieces of allocations that ended at or after ``since`` (default: the start
    of the previous month) or are still open, and the warm pools' time as platform cost. Safe to
    run any number of times."""
    now = now or timezone.now()
    if since is None:
        since = period_bounds(previous_period(period_of(now)))[0]
    if tenant is None:
        platform_costs_build(since=since, now=now)
    storage_made, storage_unrated = storage_usage_build(since=since, now=now, tenant=tenant)
    # Open allocations, recently ended ones, and any without a record yet (late data: an allocation
    # whose end reached the portal after ``since``).
    recorded = UsageRecord.objects.filter(allocation=OuterRef("pk"))
    qs = Allocation.objects.filter(
        Q(ended_at__isnull=True) | Q(ended_at__gte=since) | ~Exists(recorded)
    ).select_related("workload", "node")
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    allocations = list(qs.order_by("tenant_id", "id"))
    result = UsageBuildResult(storage_created=storage_made, unrated=list(storage_unrated))
    if not allocations:
        return result
    rater = _Rater(allocations)
    minimum = Decimal(settings.METERING_MINIMUM_BILLABLE_S)
    rows: list[UsageRecord] = []
    for a in allocations:
        span = rater.span(a)
        if span is None:
            continue
        start, end = span
        horizon = end if end is not None else now
        if horizon <= start and not (end == start and a.slurm_job_label):
            continue
        cuts = rater.cuts(a, start, horizon)
        # (A Slurm run of 0 s by sacct's whole seconds: one empty piece, for the minimum.)
        pieces = split_interval(start, horizon, cuts) or [(start, horizon)]
        if end is None:
            # Only pieces that end at a boundary already passed are final.
            pieces = [p for p in pieces if p[1] in set(cuts)]
        topup = (
            max(ZERO, minimum - _seconds(end - start))
            if end is not None and not a.resized and a.end_reason != RESIZED
            else ZERO
        )
        for i, (s, e) in enumerate(pieces):
            last = end is not None and i == len(pieces) - 1
            row = rater.rate(a, s, e, topup=topup if last else ZERO, now=now)
            if row is not None:
                rows.append(row)
    result.unrated += rater.unrated
    new = _not_recorded(rows)
    for row in new:  # telemetry only for the pieces not recorded yet
        row.avg_util_pct, row.avg_mem_used_mib = _telemetry(row.allocation.gpu_id, row.start, row.end)
    UsageRecord.objects.bulk_create(new, batch_size=1000, ignore_conflicts=True)
    result.created = len(new)
    result.unchanged = len(rows) - len(new)
    return result


def costs_to_date(*, tenant_ids=None, now: datetime | None = None) -> dict[int, Decimal]:
    """Unrounded cost of the current month so far per tenant (of ``tenant_ids``, or every tenant
    with usage this month or a running allocation): the month's usage records plus what the
    running allocations have accrued since their last record, rated exactly as their records will
    be (price versions, spot market price, vCPU, RAM and GPU memory, discount; no minimum yet), and
    the reservations' fees to now (to the second, as invoiced) with any cancellation fee of the
    month. Reserved usage is covered by the reservation's fee. A fixed number of queries, however many tenants."""
    now = now or timezone.now()
    period = period_of(now)
    month_start, _ = period_bounds(period)
    records = UsageRecord.objects.filter(period_start=period)
    running = Allocation.objects.filter(ended_at__isnull=True).exclude(plan=Plan.RESERVED)
    if tenant_ids is not None:
        tenant_ids = [getattr(t, "pk", t) for t in tenant_ids]
        records, running = records.filter(tenant_id__in=tenant_ids), running.filter(tenant_id__in=tenant_ids)
    out: dict[int, Decimal] = defaultdict(lambda: ZERO)
    storage = StorageUsageRecord.objects.filter(period_start=period)
    if tenant_ids is not None:
        storage = storage.filter(tenant_id__in=tenant_ids)
    for rows in (records, storage):
        for tenant_id, amount in (
            rows.values("tenant_id").annotate(s=Sum("amount")).values_list("tenant_id", "s")
        ):
            out[tenant_id] += amount or ZERO
    for tenant_id, amount in storage_accrued(tenant_ids=tenant_ids, now=now, month_start=month_start).items():
        out[tenant_id] += amount
    for tenant_id, amount in _reserved_accrued(tenant_ids=tenant_ids, now=now).items():
        out[tenant_id] += amount
    allocations = list(running.select_related("workload", "node").order_by("id"))
    if allocations:
        rater = _Rater(allocations)
        last_end = dict(
            UsageRecord.objects.filter(allocation_id__in=[a.pk for a in allocations])
            .values("allocation_id")
            .annotate(m=Max("end"))
            .values_list("allocation_id", "m")
        )
        for a in allocations:
            span = rater.span(a)
            if span is None or span[0] >= now:
                continue
            since = max(month_start, last_end.get(a.pk) or span[0])
            for s, e in split_interval(span[0], now, rater.cuts(a, span[0], now)):
                if s >= since:
                    row = rater.rate(a, s, e, topup=ZERO, now=now)
                    out[a.tenant_id] += row.amount if row is not None else ZERO
    if tenant_ids is not None:
        return {t: out[t] for t in tenant_ids}
    return dict(out)


def _reserved_accrued(*, tenant_ids, now: datetime) -> dict[int, Decimal]:
    """Reservation fees of the month so far per tenant, and cancellation fees of the month: what
    the month's invoice will bill for them (``invoice_build.reserved_accrued``)."""
    from metering.services.invoice_build import billable_reservations, reserved_accrued

    start, _ = period_bounds(period_of(now))
    reservations = Reservation.objects.filter(billable_reservations(start, now))
    if tenant_ids is not None:
        reservations = reservations.filter(tenant_id__in=tenant_ids)
    reservations = list(reservations.order_by("pk"))
    out: dict[int, Decimal] = defaultdict(lambda: ZERO)
    if not reservations:
        return out
    pricing = TenantPricing()
    pricing.load({r.tenant_id for r in reservations})
    for r in reservations:
        account = pricing.account(r.tenant_id)
        out[r.tenant_id] += reserved_accrued(r, pricing.book(r.tenant_id), account.discount_percent, now=now)
    return out


def platform_costs_build(*, since: datetime, now: datetime) -> int:
    """Warm-pool time as the platform's cost: each warm slot from its creation until a request
    bound it (from then the tenant pays: see ``_Rater.span``) or it was released, cut at months,
    valued at the default rate card's on-demand price; final pieces only (an open slot's past
    months), one row per (slot, month). Never on a tenant's invoice. Returns rows made."""
    slots = list(
        WarmSlot.objects.filter(Q(ended_at__isnull=True) | Q(ended_at__gte=since))
        .select_related("pool", "node")
        .order_by("id")
    )
    if not slots:
        return 0
    book = PriceBook(TenantPricing().default_card)
    rows = []
    for slot in slots:
        end = slot.ended_at or now
        if end <= slot.created_at:
            continue
        cuts = period_starts_between(slot.created_at, end)
        pieces = split_interval(slot.created_at, end, cuts)
        if slot.ended_at is None:
            pieces = [p for p in pieces if p[1] in set(cuts)]
        for s, e in pieces:
            priced = book.at(s)
            price = (
                priced.price(slot.pool.gpu_model_id, Plan.ON_DEMAND, slot.node.region_id) if priced else None
            )
            gpu_seconds = _seconds(e - s)
            rows.append(
                PlatformCost(
                    kind=PlatformCost.Kind.WARM_POOL,
                    slot=slot,
                    gpu_model_id=slot.pool.gpu_model_id,
                    region_id=slot.node.region_id,
                    period_start=period_of(s),
                    start=s,
                    end=e,
                    gpu_seconds=gpu_seconds,
                    unit_price=price,
                    amount=quantize_unit(gpu_seconds * price / HOUR) if price is not None else ZERO,
                    bound_to_id=slot.bound_to_id,
                    created_at=now,
                )
            )
    PlatformCost.objects.bulk_create(rows, ignore_conflicts=True)
    return len(rows)


def _not_recorded(rows: list[UsageRecord]) -> list[UsageRecord]:
    """The rows whose key (allocation, period, version, start) has no record yet: one query per
    thousand allocations, served by the unique index."""
    by_alloc: dict[int, list[UsageRecord]] = defaultdict(list)
    for row in rows:
        by_alloc[row.allocation_id].append(row)
    ids = list(by_alloc)
    existing = set()
    for i in range(0, len(ids), 1000):
        chunk = ids[i : i + 1000]
        starts = {row.start for a in chunk for row in by_alloc[a]}
        existing |= set(
            UsageRecord.objects.filter(allocation_id__in=chunk, start__in=starts).values_list(
                "allocation_id", "period_start", "version_id", "start"
            )
        )
    return [r for r in rows if (r.allocation_id, r.period_start, r.version_id, r.start) not in existing]
