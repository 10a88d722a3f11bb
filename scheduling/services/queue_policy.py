"""Staff choose how each region's queue is ordered (``nodes.models.QueuePolicy``; the rules are in
``scheduling.engine.queueing``). Validate, lock the region, save, audit with before and after, and
ask for a cycle on commit so the new order applies at once."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from nodes.models import QueuePolicy, Region
from portal.actors import Actor
from portal.errors import ValidationFailed
from portal.services.audit import audit_record
from scheduling.services.triggers import cycle_request

QUEUE_POLICY_AUDIT_ACTION = "region.queue_policy"


def queue_policy_clean(value: Any) -> str:
    """The policy value, or ValidationFailed naming ``queue_policy``."""
    if not isinstance(value, str) or value not in QueuePolicy.values:
        allowed = ", ".join(repr(v) for v in QueuePolicy.values)
        raise ValidationFailed(
            f"queue_policy: must be one of {allowed}.",
            fields={"queue_policy": [f"Must be one of {allowed}."]},
        )
    return value


def region_queue_policy_set(*, region: Region, policy: Any, actor: Actor) -> bool:
    """Set a region's queue policy; returns whether it changed (no audit event when it did not)."""
    value = queue_policy_clean(policy)
    with transaction.atomic():
        locked = Region.objects.select_for_update().get(pk=region.pk)
        before = locked.queue_policy
        if before == value:
            region.queue_policy = value
            return False
        locked.queue_policy = value
        locked.save(update_fields=["queue_policy"])
        region.queue_policy = value
        audit_record(
            tenant=None,
            actor=actor,
            action=QUEUE_POLICY_AUDIT_ACTION,
            target=locked,
            data={"before": before, "after": value},
        )
        cycle_request(reason="queue policy")
    return True
