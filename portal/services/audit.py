"""The audit log: one AuditEvent per change a person, a token or the system made."""

from __future__ import annotations

from typing import Any

from django.db.models import Model

from portal.actors import Actor
from portal.models import AuditEvent, Tenant


def audit_record(
    *,
    tenant: Tenant | None,
    actor: Actor,
    action: str,
    target: Model | None = None,
    data: dict[str, Any] | None = None,
) -> AuditEvent:
    return AuditEvent.objects.create(
        tenant=tenant,
        actor_type=actor.kind,
        actor_user=actor.user,
        actor_token=actor.token,
        actor_repr=str(actor)[:200],
        action=action,
        target_type=target._meta.label_lower if target is not None else "",
        target_id=str(target.pk) if target is not None else "",
        target_repr=str(target)[:200] if target is not None else "",
        data=data or {},
    )
