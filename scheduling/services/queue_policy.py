"""Staff choose how each region's queue is ordered (``nodes.models.QueuePolicy``; the rules are in
``scheduling.engine.queueing``), and optionally another policy for one plan's work there
(``queue_policy_by_plan``: plan -> non-blank policy; a plan left out follows the region's). Validate, lock the region, save, audit with before and after, and
ask for a cycle on commit so the new order applies at once."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from nodes.models import QueuePolicy, Region
from portal.actors import Actor
from portal.errors import ValidationFailed
from portal.services.audit import audit_record
from scheduling.models import Plan
from scheduling.services.triggers import cycle_request

QUEUE_POLICY_AUDIT_ACTION = "region.queue_policy"
UNSET: Any = object()


def queue_policy_clean(value: Any) -> str:
    """The policy value, or ValidationFailed naming ``queue_policy``."""
    if not isinstance(value, str) or value not in QueuePolicy.values:
        allowed = ", ".join(repr(v) for v in QueuePolicy.values)
        raise ValidationFailed(
            f"queue_policy: must be one of {allowed}.",
            fields={"queue_policy": [f"Must be one of {allowed}."]},
        )
    return value


def queue_policy_by_plan_clean(value: Any) -> dict[str, str]:
    """The plan -> policy map, or ValidationFailed naming ``queue_policy_by_plan``."""
    plans = Plan.values
    policies = [v for v in QueuePolicy.values if v]

    def fail(message: str) -> ValidationFailed:
        return ValidationFailed(
            f"queue_policy_by_plan: {message}", fields={"queue_policy_by_plan": [message]}
        )

    if not isinstance(value, dict):
        raise fail("Must be an object of plan -> policy.")
    out: dict[str, str] = {}
    for plan, policy in value.items():
        if plan not in plans:
            raise fail(f"Unknown plan {str(plan)[:40]!r}; plans: {', '.join(plans)}.")
        if not isinstance(policy, str) or policy not in policies:
            raise fail(f"{plan}: must be one of {', '.join(policies)}.")
        out[plan] = policy
    return out


def region_queue_policy_set(
    *, region: Region, policy: Any = UNSET, by_plan: Any = UNSET, actor: Actor
) -> bool:
    """Set a region's queue policy and/or its per-plan policies (the whole map); returns whether
    anything changed (no audit event when nothing did)."""
    after: dict[str, Any] = {}
    if policy is not UNSET:
        after["queue_policy"] = queue_policy_clean(policy)
    if by_plan is not UNSET:
        after["queue_policy_by_plan"] = queue_policy_by_plan_clean(by_plan)
    with transaction.atomic():
        locked = Region.objects.select_for_update().get(pk=region.pk)
        before = {name: getattr(locked, name) for name in after}
        for name, value in after.items():
            setattr(region, name, value)
        if before == after:
            return False
        for name, value in after.items():
            setattr(locked, name, value)
        locked.save(update_fields=list(after))
        audit_record(
            tenant=None,
            actor=actor,
            action=QUEUE_POLICY_AUDIT_ACTION,
            target=locked,
            data={"before": before, "after": after},
        )
        cycle_request(reason="queue policy")
    return True
