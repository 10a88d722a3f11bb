"""Live events: pushed after commit to the browsers and API clients of one tenant (or to staff)."""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

logger = logging.getLogger(__name__)

STAFF_GROUP = "staff"


def tenant_group(tenant_id: int) -> str:
    return f"tenant.{tenant_id}"


def _send(group: str, event: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, {"type": "gpupool.event", "event": event})
    except Exception:  # a lost live update must never break the change that caused it
        logger.warning("Could not push event %s to %s", event.get("type"), group, exc_info=True)


def publish(*, tenant_id: int | None, event: dict[str, Any], staff: bool = False) -> None:
    """Push ``event`` to the tenant's group (and the staff group) once the transaction commits."""

    def send() -> None:
        if tenant_id is not None:
            _send(tenant_group(tenant_id), event)
        if staff:
            _send(STAFF_GROUP, event)

    transaction.on_commit(send)


def publish_many(*, events: list[tuple[int | None, dict[str, Any]]]) -> None:
    """``publish`` for many tenant events at once (a scheduling cycle changes thousands of
    workloads): once the transaction commits, one message per tenant group carries its events in
    order (the websocket consumer sends them one by one, as if published one at a time)."""
    if not events:
        return
    by_group: dict[str, list[dict[str, Any]]] = {}
    for tenant_id, event in events:
        if tenant_id is not None:
            by_group.setdefault(tenant_group(tenant_id), []).append(event)

    async def send_all(layer: Any) -> None:
        for group, batch in by_group.items():
            try:
                await layer.group_send(group, {"type": "gpupool.events", "events": batch})
            except Exception:  # as in _send: a lost live update never breaks the change
                logger.warning("Could not push %d events to %s", len(batch), group, exc_info=True)

    def send() -> None:
        layer = get_channel_layer()
        if layer is None or not by_group:
            return
        try:
            async_to_sync(send_all)(layer)
        except Exception:
            logger.warning("Could not push %d events", len(events), exc_info=True)

    transaction.on_commit(send)
