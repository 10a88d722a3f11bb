"""Every row lock and advisory lock scheduling takes, in one place (Saleor's ``lock_objects.py``).

Lock order, to keep deadlocks out: the cycle's advisory lock, then a tenant's Quota row, then
Volume rows (by id), then Workload rows (by id), then Allocation rows, then WorkItem rows; a
Reservation row, then its (model, region) capacity advisory lock. Code that needs several takes
them in that order.
"""

from __future__ import annotations

import zlib

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q, QuerySet

from scheduling.models import Quota, Reservation, Volume, WorkItem, Workload

# The key of the scheduling cycle's PostgreSQL advisory lock (a stable 32-bit number).
CYCLE_LOCK_KEY = zlib.crc32(b"gpupool.scheduling.cycle")


def lock_quota(*, tenant) -> Quota:
    """The tenant's Quota row, created on first use and locked until the transaction ends.

    Every submission of a tenant takes this lock before counting the tenant's use, so two
    submissions of one tenant are admitted one after the other and cannot both pass a limit.
    Must run inside ``transaction.atomic()``.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("lock_quota needs a transaction")
    quota = Quota.objects.select_for_update().filter(tenant=tenant).first()
    if quota is not None:
        return quota
    # First submission of the tenant: make the row and lock it. A concurrent maker's insert waits
    # on the unique tenant column for ours to commit and then does nothing (ON CONFLICT DO
    # NOTHING: no failed statement, no savepoint, no "duplicate key" error in the server's log).
    Quota.objects.bulk_create(
        [Quota(tenant=tenant, **settings.SCHEDULING_DEFAULT_QUOTA)], ignore_conflicts=True
    )
    return Quota.objects.select_for_update().get(tenant=tenant)


def lock_workload(*, workload_id: int) -> Workload:
    """One workload row, locked until the transaction ends (state changes go through this)."""
    return Workload.objects.select_for_update().get(pk=workload_id)


def lock_workload_if_exists(*, workload_id: int) -> Workload | None:
    return Workload.objects.select_for_update().filter(pk=workload_id).first()


def lock_workloads(*, ids, states=None) -> dict[int, Workload]:
    """Several workload rows (optionally only those in ``states``), locked in id order."""
    qs = Workload.objects.select_for_update().filter(pk__in=list(ids))
    if states is not None:
        qs = qs.filter(state__in=list(states))
    return {w.pk: w for w in qs.order_by("pk")}


def lock_workloads_where(**filters) -> QuerySet[Workload]:
    """Workloads matching ``filters``, locked in id order; rows another transaction holds are
    skipped (the cycle and the reconciler come back to them), so these never wait on a tenant's
    stop or a fleet report. Joins are not locked (``of=self``)."""
    return Workload.objects.select_for_update(skip_locked=True, of=("self",)).filter(**filters).order_by("pk")


def lock_next_work_item(*, job_id: int, available: Q) -> WorkItem | None:
    """The lowest-index ``available`` item of a work-queue job, locked; items other workers are
    taking are skipped, so workers never queue behind each other."""
    return (
        WorkItem.objects.select_for_update(skip_locked=True, of=("self",))
        .filter(Q(job_id=job_id) & available)
        .order_by("index")
        .first()
    )


def lock_work_item(*, job_id: int, index: int) -> WorkItem | None:
    return WorkItem.objects.select_for_update().filter(job_id=job_id, index=index).first()


def lock_volume(*, volume_id: int) -> Volume:
    """One volume row, locked until the transaction ends (deleting it waits for attaching, and the
    other way round)."""
    return Volume.objects.select_for_update().get(pk=volume_id)


def lock_volumes(*, ids) -> dict[int, Volume]:
    """Volume rows locked in id order: a submission attaches them one workload at a time, so two
    exclusive users can never both pass the in-use check."""
    return {v.pk: v for v in Volume.objects.select_for_update().filter(pk__in=list(ids)).order_by("pk")}


def lock_reservation(*, reservation_id: int) -> Reservation:
    return Reservation.objects.select_for_update().get(pk=reservation_id)


def lock_reservation_capacity(*, gpu_model_id: int, region_id: int) -> None:
    """A transaction-long advisory lock on one (GPU model, region)'s reserved capacity, so two staff
    confirming reservations of it at once cannot both pass the capacity check. On SQLite (no
    advisory locks) every write transaction already runs alone (BEGIN IMMEDIATE)."""
    if connection.vendor != "postgresql":
        return
    key = zlib.crc32(f"gpupool.scheduling.reservation:{gpu_model_id}:{region_id}".encode())
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])


def cycle_lock_wait() -> None:
    """Take the cycle's lock for the current transaction, waiting for a running cycle to end: a
    staff change that must not race a placement (a GPU's MIG reconfiguration) holds it while it
    checks and marks the GPU. SQLite: see ``try_cycle_lock``."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("cycle_lock_wait needs a transaction")
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", [CYCLE_LOCK_KEY])


def try_cycle_lock() -> bool:
    """Take the cycle's single-flight lock for the current transaction, or return False at once.

    PostgreSQL: ``pg_try_advisory_xact_lock``, released when the transaction ends (also when the
    worker dies: the connection closes). SQLite has no advisory locks; the settings open every
    transaction with BEGIN IMMEDIATE, which takes the database's write lock at once, so two
    cycles (like any two writers) already run one after the other, and this returns True.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("try_cycle_lock needs a transaction")
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cur:
        cur.execute("SELECT pg_try_advisory_xact_lock(%s)", [CYCLE_LOCK_KEY])
        return bool(cur.fetchone()[0])
