"""Reservations: a tenant asks (REQUESTED); staff confirm (ACTIVE, guaranteed and billed) or either
cancels.

A reservation is a commitment. Staff confirm one only if the region holds its GPUs for its whole
term beside the other active reservations (409 naming the shortfall otherwise, unless staff
override it, which the audit records with what it risks). An active reservation is cancelled by
staff, or by the tenant where ``RESERVATION_CANCEL_ACTIVE_BY`` is ``tenant``; metering bills it to
the second up to ``cancelled_at`` and, with ``RESERVATION_CANCEL_FEE_PERCENT`` (recorded on the
reservation when it is cancelled), a fee of that percent of what the rest of its term would have
cost. While in force, the scheduler sets exactly ``count`` GPUs of the model in the region aside
for the tenant (``scheduling.services.cycle``): whole nodes, and the rest of the count on one node in
part, whose other GPUs anyone may use. Idle reserved capacity is lent to preemptible work only, which
the owner's work preempts when it needs it."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from nodes.models import Gpu, GpuModel, Region
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.services.audit import audit_record
from scheduling.locks import lock_reservation, lock_reservation_capacity
from scheduling.models import Reservation, ReservationStatus
from scheduling.services.triggers import cycle_request


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def reservation_request(
    *,
    tenant,
    gpu_model: str,
    region: str,
    count: int,
    starts_at: datetime,
    ends_at: datetime,
    actor: Actor,
    note: str = "",
) -> Reservation:
    model = (
        GpuModel.objects.filter(name__iexact=gpu_model).first()
        or GpuModel.objects.filter(short_name__iexact=gpu_model).first()
    )
    if model is None:
        raise _fail("gpu_model", f"Unknown GPU model {gpu_model!r}.")
    reg = Region.objects.filter(code=region).first()
    if reg is None:
        raise _fail("region", f"Unknown region {region!r}.")
    if count < 1:
        raise _fail("count", "At least one GPU.")
    if ends_at <= starts_at:
        raise _fail("ends_at", "Must be after starts_at.")
    if starts_at < timezone.now() - timedelta(minutes=5):
        raise _fail("starts_at", "Must not be in the past.")
    with transaction.atomic():
        reservation = Reservation.objects.create(
            tenant=tenant,
            gpu_model=model,
            region=reg,
            count=count,
            starts_at=starts_at,
            ends_at=ends_at,
            note=note[:255],
        )
        audit_record(tenant=tenant, actor=actor, action="reservation.request", target=reservation)
    return reservation


def reservation_capacity(*, reservation: Reservation) -> tuple[int, int]:
    """``(GPUs of the model in the region, the most of them other active reservations hold at any
    instant of this one's term)``: a sweep over the overlapping reservations' starts and ends."""
    r = reservation
    total = Gpu.objects.filter(model_id=r.gpu_model_id, node__region_id=r.region_id).count()
    points: dict[datetime, int] = defaultdict(int)
    for starts_at, ends_at, count in (
        Reservation.objects.filter(
            gpu_model_id=r.gpu_model_id,
            region_id=r.region_id,
            status=ReservationStatus.ACTIVE,
            starts_at__lt=r.ends_at,
            ends_at__gt=r.starts_at,
        )
        .exclude(pk=r.pk)
        .values_list("starts_at", "ends_at", "count")
    ):
        points[max(starts_at, r.starts_at)] += count
        points[min(ends_at, r.ends_at)] -= count
    peak = held = 0
    for at in sorted(points):
        held += points[at]
        peak = max(peak, held)
    return total, peak


def reservation_activate(
    *, reservation: Reservation, actor: Actor, override_capacity: bool = False, now: datetime | None = None
) -> Reservation:
    """Staff confirm a requested reservation: from now it is guaranteed (and billed). Refused (409)
    when the region cannot hold its GPUs for its whole term beside the other active reservations;
    ``override_capacity`` confirms it anyway and the audit says what that risks."""
    now = now or timezone.now()
    with transaction.atomic():
        r = lock_reservation(reservation_id=reservation.pk)
        lock_reservation_capacity(gpu_model_id=r.gpu_model_id, region_id=r.region_id)
        if r.status != ReservationStatus.REQUESTED:
            raise Conflict(f"The reservation is {r.status}.")
        total, held = reservation_capacity(reservation=r)
        free = max(total - held, 0)
        data = {}
        if r.count > free:
            what = (
                f"{r.count} {r.gpu_model.name} GPUs asked in {r.region.code}, but only {free} of {total} are "
                f"free for the whole term ({held} held by other reservations at the peak)"
            )
            if not override_capacity:
                raise Conflict(
                    f"Not enough capacity: {what}.",
                    fields={"count": [f"At most {free} for this term."]},
                    code="reservation_capacity",
                )
            data = {
                "capacity_override": True,
                "risk": (
                    f"The region is overbooked by {r.count - free} GPU(s) for this term: {what}. When "
                    "every reservation is in use at once, some of their GPUs cannot be given."
                ),
            }
        r.status = ReservationStatus.ACTIVE
        r.activated_at = now
        r.save(update_fields=["status", "activated_at"])
        audit_record(tenant=r.tenant, actor=actor, action="reservation.activate", target=r, data=data or None)
        cycle_request(reason="reservation")
    return r


def reservation_cancel(
    *, reservation: Reservation, actor: Actor, staff: bool = False, now: datetime | None = None
) -> Reservation:
    """Cancel: a tenant may cancel a request; an active reservation is ended by staff, or by the
    tenant where ``RESERVATION_CANCEL_ACTIVE_BY`` is ``tenant``. An active one is billed up to
    now, and the cancellation fee percent in force is recorded with it."""
    now = now or timezone.now()
    with transaction.atomic():
        r = lock_reservation(reservation_id=reservation.pk)
        if r.status == ReservationStatus.CANCELLED:
            raise Conflict("The reservation is already cancelled.")
        was_active = r.status == ReservationStatus.ACTIVE
        if was_active and not staff and settings.RESERVATION_CANCEL_ACTIVE_BY != "tenant":
            raise Conflict("An active reservation is ended by staff (it is a commitment).")
        r.status = ReservationStatus.CANCELLED
        r.cancelled_at = now
        fields = ["status", "cancelled_at"]
        if was_active and r.activated_at is None:  # confirmed before the time was kept
            r.activated_at = min(r.created_at, now)
            fields.append("activated_at")
        if was_active and now < r.ends_at:
            r.cancel_fee_percent = Decimal(settings.RESERVATION_CANCEL_FEE_PERCENT)
            fields.append("cancel_fee_percent")
        r.save(update_fields=fields)
        audit_record(
            tenant=r.tenant,
            actor=actor,
            action="reservation.cancel",
            target=r,
            data={"was_active": was_active, "cancel_fee_percent": str(r.cancel_fee_percent)},
        )
        cycle_request(reason="reservation")
    return r
