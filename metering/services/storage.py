"""Storage usage: tenant volumes billed per GiB-hour of their size.

What is billed of a volume: its size from its creation to its deletion (``created_at`` to
``deleted_at``), whether or not a workload uses it, at the storage price
(``storage_gib_hour_price``) of the tenant's rate card version in force, after the tenant's
discount. A version without a storage price bills nothing (the piece is reported unrated). The size
is the one in force over each piece: a resize (``scheduling.VolumeResize``, ``from_gib`` before its
``at``, ``to_gib`` from it) cuts the interval, so each size is billed for its own hours.

As for GPU usage (``metering.services.usage``), the interval is cut at every month boundary (UTC),
every price-version boundary and every resize; each piece is one :class:`StorageUsageRecord` keyed
by (volume, period, version, start), built with ``ignore_conflicts``, and only final pieces are
recorded: the deleted volume's, and a live volume's pieces that end at a boundary already past (a
resize is one once made: it happens at the moment it is asked for, never in the past). The monthly
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
from scheduling.models import Volume, VolumeResize

# Per volume, its resizes in order: (at, from_gib, to_gib).
Resizes = dict[int, list[tuple[datetime, int, int]]]


def _seconds(delta) -> Decimal:
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / Decimal(1_000_000)


def _resizes(volume_ids: list[int]) -> Resizes:
    out: Resizes = {}
    for vid, at, old, new in (
        VolumeResize.objects.filter(volume_id__in=volume_ids)
        .order_by("volume_id", "at", "id")
        .values_list("volume_id", "at", "from_gib", "to_gib")
    ):
        out.setdefault(vid, []).append((at, old, new))
    return out


def size_at(volume: Volume, resizes: Resizes, at: datetime) -> int:
    """The volume's size in force at ``at``: the last resize's at or before it, else the size before
    its first resize, else its size now."""
    changes = resizes.get(volume.pk) or []
    size = changes[0][1] if changes else volume.size_gib
    for when, _, new in changes:
        if when > at:
            break
        size = new
    return size


def _resize_cuts(volume: Volume, resizes: Resizes) -> list[datetime]:
    return [when for when, _, _ in resizes.get(volume.pk) or []]


def storage_rate(
    volume: Volume,
    s: datetime,
    e: datetime,
    *,
    pricing: TenantPricing,
    now: datetime,
    resizes: Resizes | None = None,
) -> StorageUsageRecord | None:
    """The record of ``[s, e)`` of a volume (unsaved), at the size in force at ``s`` (``[s, e)``
    never spans a resize), or None when no storage price is in force."""
    priced = pricing.book(volume.tenant_id).at(s)
    if priced is None or priced.version.storage_gib_hour_price is None:
        return None
    unit = discounted(
        priced.version.storage_gib_hour_price, pricing.account(volume.tenant_id).discount_percent
    )
    size = size_at(volume, resizes or {}, s)
    gib_seconds = _seconds(e - s) * size
    return StorageUsageRecord(
        tenant_id=volume.tenant_id,
        volume=volume,
        region_id=volume.region_id,
        period_start=period_of(s),
        version=priced.version,
        start=s,
        end=e,
        size_gib=size,
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
    resizes = _resizes([v.pk for v in volumes])
    rows: list[StorageUsageRecord] = []
    unrated: list[str] = []
    for v in volumes:
        end = v.deleted_at
        horizon = end if end is not None else now
        if horizon <= v.created_at:
            continue
        cuts = (
            period_starts_between(v.created_at, horizon)
            + pricing.book(v.tenant_id).boundaries(v.created_at, horizon)
            + [c for c in _resize_cuts(v, resizes) if c <= now]
        )
        pieces = split_interval(v.created_at, horizon, cuts)
        if end is None:
            pieces = [p for p in pieces if p[1] in set(cuts)]  # only pieces already final
        for s, e in pieces:
            row = storage_rate(v, s, e, pricing=pricing, now=now, resizes=resizes)
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
    resizes = _resizes([v.pk for v in volumes])
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
        cuts = pricing.book(v.tenant_id).boundaries(start, now) + _resize_cuts(v, resizes)
        for s, e in split_interval(start, now, cuts):
            row = storage_rate(v, s, e, pricing=pricing, now=now, resizes=resizes)
            out[v.tenant_id] = out.get(v.tenant_id, ZERO) + (row.amount if row is not None else ZERO)
    return out
