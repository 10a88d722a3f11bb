"""Storage usage: tenant volumes billed per GiB-hour of their size.

What is billed of a volume: its size (``size_gib``, fixed for its life: volumes are not resized)
from its creation to its deletion (``created_at`` to ``deleted_at``), whether or not a workload
uses it, at the storage price (``storage_gib_hour_price``) of the tenant's rate card version in
force, after the tenant's discount. A version without a storage price bills nothing (the piece is
reported unrated).

As for GPU usage (``metering.services.usage``), the interval is cut at every month boundary (UTC)
and every price-version boundary; each piece is one :class:`StorageUsageRecord` keyed by (volume,
period, version, start), built with ``ignore_conflicts``, and only final pieces are recorded: the
deleted volume's, and a live volume's pieces that end at a boundary already past. The monthly
invoice gets one "Volume storage" line per period (``metering.services.invoice_build``).
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.db.models import Max, Q

from metering.models import StorageUsageRecord
from metering.money import HOUR, ZERO, quantize_unit
from metering.periods import period_of, period_starts_between, split_interval
from metering.services.rates import TenantPricing, discounted
from scheduling.models import Volume


def _seconds(delta) -> Decimal:
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / Decimal(1_000_000)


def storage_rate(
    volume: Volume, s: datetime, e: datetime, *, pricing: TenantPricing, now: datetime
) -> StorageUsageRecord | None:
    """The record of ``[s, e)`` of a volume (unsaved), or None when no storage price is in force."""
    priced = pricing.book(volume.tenant_id).at(s)
    if priced is None or priced.version.storage_gib_hour_price is None:
        return None
    unit = discounted(
        priced.version.storage_gib_hour_price, pricing.account(volume.tenant_id).discount_percent
    )
    gib_seconds = _seconds(e - s) * volume.size_gib
    return StorageUsageRecord(
        tenant_id=volume.tenant_id,
        volume=volume,
        region_id=volume.region_id,
        period_start=period_of(s),
        version=priced.version,
        start=s,
        end=e,
        size_gib=volume.size_gib,
        gib_seconds=gib_seconds,
        unit_price=unit,
        amount=quantize_unit(gib_seconds * unit / HOUR),
        created_at=now,
    )


def storage_usage_build(*, since: datetime, now: datetime, tenant=None) -> tuple[int, list[str]]:
    """Record the final pieces of volumes alive at or after ``since``. Safe to run any number of
    times. Returns (records made, unrated pieces)."""
    volumes = Volume.objects.filter(Q(deleted_at__isnull=True) | Q(deleted_at__gte=since))
    if tenant is not None:
        volumes = volumes.filter(tenant=tenant)
    volumes = list(volumes.order_by("tenant_id", "id"))
    if not volumes:
        return 0, []
    pricing = TenantPricing()
    pricing.load({v.tenant_id for v in volumes})
    rows: list[StorageUsageRecord] = []
    unrated: list[str] = []
    for v in volumes:
        end = v.deleted_at
        horizon = end if end is not None else now
        if horizon <= v.created_at:
            continue
        cuts = period_starts_between(v.created_at, horizon) + pricing.book(v.tenant_id).boundaries(
            v.created_at, horizon
        )
        pieces = split_interval(v.created_at, horizon, cuts)
        if end is None:
            pieces = [p for p in pieces if p[1] in set(cuts)]  # only pieces already final
        for s, e in pieces:
            row = storage_rate(v, s, e, pricing=pricing, now=now)
            if row is None:
                unrated.append(f"volume {v.pk}: no storage price in force at {s.isoformat()}")
            else:
                rows.append(row)
    existing = set(
        StorageUsageRecord.objects.filter(volume_id__in=[v.pk for v in volumes]).values_list(
            "volume_id", "period_start", "version_id", "start"
        )
    )
    new = [r for r in rows if (r.volume_id, r.period_start, r.version_id, r.start) not in existing]
    StorageUsageRecord.objects.bulk_create(new, batch_size=1000, ignore_conflicts=True)
    return len(new), unrated


def storage_accrued(*, tenant_ids, now: datetime, month_start: datetime) -> dict[int, Decimal]:
    """What live volumes (of ``tenant_ids``, or of every tenant when None) have accrued this month
    since their last record, per tenant, rated as their records will be (for the cost to date)."""
    out: dict[int, Decimal] = {}
    live = Volume.objects.filter(deleted_at__isnull=True)
    if tenant_ids is not None:
        live = live.filter(tenant_id__in=list(tenant_ids))
    volumes = list(live)
    if not volumes:
        return out
    pricing = TenantPricing()
    pricing.load({v.tenant_id for v in volumes})
    last = dict(
        StorageUsageRecord.objects.filter(volume_id__in=[v.pk for v in volumes])
        .values("volume_id")
        .annotate(m=Max("end"))
        .values_list("volume_id", "m")
    )
    for v in volumes:
        start = max(v.created_at, month_start, last.get(v.pk) or v.created_at)
        if start >= now:
            continue
        for s, e in split_interval(start, now, pricing.book(v.tenant_id).boundaries(start, now)):
            row = storage_rate(v, s, e, pricing=pricing, now=now)
            out[v.tenant_id] = out.get(v.tenant_id, ZERO) + (row.amount if row is not None else ZERO)
    return out
