"""Signals portal sends; apps above it connect receivers in ``AppConfig.ready()``."""

from django.dispatch import Signal

# Sent by ``seed_demo`` after the demo tenant and people exist, with ``tenant`` and ``stdout``.
# Each app seeds its own demo data (the fleet, prices, ...) idempotently.
seed_demo_requested = Signal()

# Sent by ``portal.services.tenants.tenant_set_status`` when a tenant becomes SUSPENDED (whoever suspends it:
# dunning or staff), inside that transaction, with ``tenant``, ``reason`` and ``actor``.
tenant_suspended = Signal()

# Sent by ``portal.events.publish`` and ``publish_many`` inside the caller's transaction, before the
# live push is queued for its commit, with ``events``: a list of ``(tenant_id, event)`` (tenant
# events only, each a dict with its ``type``). Receivers that record events (webhooks) write in the
# same transaction, so what they record commits or rolls back with the change.
tenant_events = Signal()
