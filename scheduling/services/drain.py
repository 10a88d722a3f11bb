"""What runs on a node that a rolling upgrade drains (``nodes.services.rollouts``), which nodes asks
through the hooks registered in ``SchedulingConfig.ready()``.

- ``node_work_counts``: the workloads each node holds: open allocations, and allocations released
  without the node's word that it has not yet confirmed stopped (it may still run them).
- ``node_work_notice``: the preemption notice, through ``workload_preempt`` (the same event,
  tenant notice and webhook as any preemption). Before the deadline only instances are told, with
  the time left to the deadline (they never finish on their own); jobs may finish. At the deadline
  (``final``) everything left is preempted with its plan's notice: a job that requeues on
  preemption goes back to the queue (from its checkpoint) and runs elsewhere.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db.models import Count, Q
from django.utils import timezone

from portal.errors import DomainError
from scheduling.models import Allocation, Workload, WorkloadKind
from scheduling.services.lifecycle import PREEMPTIBLE_STATES, workload_preempt

logger = logging.getLogger(__name__)

MAX_NOTICE_S = 86400


def _held(node_ids: list[int]):
    return Allocation.objects.filter(node_id__in=node_ids).filter(
        Q(ended_at__isnull=True) | Q(stop_forced_at__isnull=False, stop_confirmed_at__isnull=True)
    )


def node_work_counts(node_ids: list[int]) -> dict[int, int]:
    return dict(
        _held(node_ids).values_list("node_id").annotate(n=Count("workload_id", distinct=True)).order_by()
    )


def node_work_notice(*, node_id: int, deadline: datetime, final: bool, reason: str) -> int:
    workloads = Workload.objects.filter(
        pk__in=_held([node_id]).filter(ended_at__isnull=True).values("workload_id"),
        state__in=PREEMPTIBLE_STATES,
    )
    if not final:
        workloads = workloads.filter(kind=WorkloadKind.INSTANCE)
    left = max(0, int((deadline - timezone.now()).total_seconds()))
    given = 0
    for workload in workloads.order_by("pk"):
        try:
            workload_preempt(
                workload=workload, reason=reason, notice_s=None if final else min(left, MAX_NOTICE_S)
            )
            given += 1
        except DomainError as exc:  # it stopped or moved meanwhile
            logger.info("No drain notice for workload %s: %s", workload.pk, exc.message)
    return given
