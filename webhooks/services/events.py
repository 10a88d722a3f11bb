"""Recording events for webhooks: a tenant's live events whose type is in the catalog become
WebhookEvent rows with one WebhookDelivery per enabled endpoint that wants them.

This runs inside the transaction that made the change (``portal.signals.tenant_events``, sent by
``portal.events.publish``), so an event is recorded exactly when its change commits; the first
attempts are queued after that commit. One query finds the endpoints of every tenant in the batch
(a scheduling cycle publishes thousands of events at once); with no endpoint nothing is written.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from webhooks.catalog import EVENT_TYPES
from webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent


def on_tenant_events(sender: Any, events: list[tuple[int, dict[str, Any]]], **kwargs: Any) -> None:
    events_record(events=events)


def events_record(*, events: list[tuple[int, dict[str, Any]]]) -> list[WebhookDelivery]:
    wanted = [(t, e) for t, e in events if t is not None and e.get("type") in EVENT_TYPES]
    if not wanted:
        return []
    by_tenant: dict[int, list[WebhookEndpoint]] = {}
    for endpoint in WebhookEndpoint.objects.filter(tenant_id__in={t for t, _ in wanted}, enabled=True).only(
        "id", "tenant_id", "event_types"
    ):
        by_tenant.setdefault(endpoint.tenant_id, []).append(endpoint)
    if not by_tenant:
        return []
    now = timezone.now()
    rows: list[tuple[WebhookEvent, list[WebhookEndpoint]]] = []
    for tenant_id, event in wanted:
        targets = [ep for ep in by_tenant.get(tenant_id, ()) if ep.wants(event["type"])]
        if targets:
            data = {k: v for k, v in event.items() if k != "type"}
            rows.append(
                (WebhookEvent(tenant_id=tenant_id, type=event["type"], payload=data, created_at=now), targets)
            )
    if not rows:
        return []
    WebhookEvent.objects.bulk_create([row for row, _ in rows])
    until = now + timedelta(seconds=settings.WEBHOOK_RETRY_WINDOW_S)
    deliveries = WebhookDelivery.objects.bulk_create(
        [
            WebhookDelivery(
                tenant_id=row.tenant_id,
                endpoint=ep,
                event=row,
                next_attempt_at=now,
                retry_until=until,
                created_at=now,
            )
            for row, targets in rows
            for ep in targets
        ]
    )
    ids = [d.pk for d in deliveries]

    def enqueue() -> None:
        from webhooks.tasks import deliver

        for pk in ids:
            deliver.delay(pk)

    transaction.on_commit(enqueue)
    return deliveries


def event_body(event: WebhookEvent) -> bytes:
    """The JSON body every delivery of ``event`` sends (the same bytes each time)."""
    import json

    return json.dumps(
        {
            "id": f"evt_{event.pk}",
            "type": event.type,
            "created": event.created_at.isoformat(),
            "data": event.payload,
        },
        separators=(",", ":"),
        sort_keys=False,
        default=str,
    ).encode("utf-8")
