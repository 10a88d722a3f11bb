"""Reservations: a tenant asks (REQUESTED); staff confirm (ACTIVE, guaranteed and billed) or either
cancels. While in force, the scheduler sets exactly ``count`` GPUs of the model in the region aside
for the tenant (``scheduling.services.cycle``): whole nodes, and the rest of the count on one node in
part, whose other GPUs anyone may use. Idle reserved capacity is lent to preemptible work only, which
the owner's work preempts when it needs it."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from nodes.models import GpuModel, Region
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from portal.services.audit import audit_record
from scheduling.locks import lock_reservation
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


def reservation_activate(*, reservation: Reservation, actor: Actor) -> Reservation:
    """Staff confirm a requested reservation: from now it is guaranteed (and billed)."""
    with transaction.atomic():
        r = lock_reservation(reservation_id=reservation.pk)
        if r.status != ReservationStatus.REQUESTED:
            raise Conflict(f"The reservation is {r.status}.")
        r.status = ReservationStatus.ACTIVE
        r.save(update_fields=["status"])
        audit_record(tenant=r.tenant, actor=actor, action="reservation.activate", target=r)
        cycle_request(reason="reservation")
    return r


def reservation_cancel(*, reservation: Reservation, actor: Actor, staff: bool = False) -> Reservation:
    """Cancel: a tenant may cancel a request; an active reservation only staff may end."""
    with transaction.atomic():
        r = lock_reservation(reservation_id=reservation.pk)
        if r.status == ReservationStatus.CANCELLED:
            raise Conflict("The reservation is already cancelled.")
        if r.status == ReservationStatus.ACTIVE and not staff:
            raise Conflict("An active reservation is ended by staff (it is a commitment).")
        r.status = ReservationStatus.CANCELLED
        r.save(update_fields=["status"])
        audit_record(tenant=r.tenant, actor=actor, action="reservation.cancel", target=r)
        cycle_request(reason="reservation")
    return r
