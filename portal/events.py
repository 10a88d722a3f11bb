"""Live events: pushed after commit to the browsers of one tenant (or to staff).

A tenant's events go to one group per scope (``tenant.<id>.<scope>``): an event is published with
the scope a person needs to see it (``read`` for workloads, ``billing`` for budget alerts with their
amounts), and each socket is in the groups of the scopes its person's role holds. A change to a
person's memberships or account sends a note to their own group (``user.<id>``); their sockets then
look again and follow it (leave a scope's group, or close when they are no longer a member). Each
message names its group, so a socket also drops what was queued for a group it has just left.

A tenant's events are also announced at once, inside the caller's transaction
(``portal.signals.tenant_events``): the webhooks app records the ones endpoints asked for there, so
they commit or roll back with the change that made them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from channels.layers import get_channel_layer
from django.db import transaction

from portal.signals import tenant_events

logger = logging.getLogger(__name__)

STAFF_GROUP = "staff"
SEND_TIMEOUT_S = 5.0


def tenant_group(tenant_id: int, scope: str = "read") -> str:
    return f"tenant.{tenant_id}.{scope}"


def user_group(user_id: int) -> str:
    return f"user.{user_id}"


class _SenderLoop:
    """The event loop the channel layer's sends from synchronous code (views, tasks, on-commit
    callbacks) run on: one per process, on a thread of its own, for the process's life.

    ``async_to_sync`` from a thread without a loop starts a new event loop (and a thread) for every
    call, and channels_redis keeps its connections per event loop: each live event cost 1.9 ms of
    CPU and a new Redis connection. On one loop the layer keeps its connections, and a send costs a
    hand-over to that thread. A forked child (Celery's prefork pool) starts a loop of its own."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid = 0

    @classmethod
    def loop(cls) -> asyncio.AbstractEventLoop:
        loop = cls._loop
        if loop is None or cls._pid != os.getpid():
            with cls._lock:
                if cls._loop is None or cls._pid != os.getpid():
                    loop = asyncio.new_event_loop()
                    threading.Thread(target=loop.run_forever, name="gpupool-events", daemon=True).start()
                    cls._loop, cls._pid = loop, os.getpid()
                loop = cls._loop
        return loop

    @classmethod
    def run(cls, send: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``send(*args)`` there and wait for it (so live events keep their order)."""
        return asyncio.run_coroutine_threadsafe(send(*args), cls.loop()).result(SEND_TIMEOUT_S)


def _send(group: str, event: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        _SenderLoop.run(layer.group_send, group, {"type": "gpupool.event", "event": event, "group": group})
    except Exception:  # a lost live update must never break the change that caused it
        logger.warning("Could not push event %s to %s", event.get("type"), group, exc_info=True)


def publish(
    *, tenant_id: int | None, event: dict[str, Any], staff: bool = False, scope: str = "read"
) -> None:
    """Push ``event`` to the tenant's members whose role holds ``scope`` (and to the staff group)
    once the transaction commits. A tenant's event is also announced (``tenant_events``) now."""
    if tenant_id is not None:
        tenant_events.send(sender=None, events=[(tenant_id, event)])

    def send() -> None:
        if tenant_id is not None:
            _send(tenant_group(tenant_id, scope), event)
        if staff:
            _send(STAFF_GROUP, event)

    transaction.on_commit(send)


def membership_changed(*, user_id: int) -> None:
    """Once the transaction commits, tell the person's open sockets to look at their memberships
    and account again (a role changed, a membership ended, the account was deactivated)."""

    def send() -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        try:
            _SenderLoop.run(layer.group_send, user_group(user_id), {"type": "gpupool.membership"})
        except Exception:  # as in _send: the socket then follows at its next connect
            logger.warning("Could not tell user %s's sockets of a membership change", user_id, exc_info=True)

    transaction.on_commit(send)


def publish_many(*, events: list[tuple[int | None, dict[str, Any]]]) -> None:
    """``publish`` for many tenant events at once (a scheduling cycle changes thousands of
    workloads), each for the ``read`` scope: once the transaction commits, one message per tenant
    group carries its events in order (the websocket consumer sends them one by one, as if
    published one at a time)."""
    if not events:
        return
    tenant_events.send(sender=None, events=[(t, e) for t, e in events if t is not None])
    by_group: dict[str, list[dict[str, Any]]] = {}
    for tenant_id, event in events:
        if tenant_id is not None:
            by_group.setdefault(tenant_group(tenant_id), []).append(event)

    async def send_all(layer: Any) -> None:
        for group, batch in by_group.items():
            try:
                await layer.group_send(group, {"type": "gpupool.events", "events": batch, "group": group})
            except Exception:  # as in _send: a lost live update never breaks the change
                logger.warning("Could not push %d events to %s", len(batch), group, exc_info=True)

    def send() -> None:
        layer = get_channel_layer()
        if layer is None or not by_group:
            return
        try:
            _SenderLoop.run(send_all, layer)
        except Exception:
            logger.warning("Could not push %d events", len(events), exc_info=True)

    transaction.on_commit(send)
