"""Every row lock the webhooks app takes. Lock order: a tenant row (adding an endpoint), or a
delivery row; never both.

A delivery is locked twice per attempt, each time briefly: to claim it (skipping one another
worker holds, so two workers never send the same attempt) and to record the outcome. The HTTP
request runs between the two, holding no lock and no transaction.
"""

from __future__ import annotations

from webhooks.models import WebhookDelivery, WebhookEndpoint


def lock_delivery_claim(*, delivery_id: int) -> WebhookDelivery | None:
    """The delivery, locked, or None when it is gone or another worker holds it."""
    return (
        WebhookDelivery.objects.select_for_update(skip_locked=True, of=("self",))
        .select_related("endpoint")
        .filter(pk=delivery_id)
        .first()
    )


def lock_delivery(*, delivery_id: int) -> WebhookDelivery:
    return WebhookDelivery.objects.select_for_update().get(pk=delivery_id)


def lock_tenant_endpoints(*, tenant_id: int) -> None:
    """The tenant's row, locked while an endpoint is added, so two requests at once cannot both
    pass the endpoint limit. Taken before any delivery lock (and never with one)."""
    from portal.models import Tenant

    Tenant.objects.select_for_update().filter(pk=tenant_id).exists()


def lock_endpoints_after(*, after_id: int, limit: int) -> list[WebhookEndpoint]:
    """The next ``limit`` endpoints by id, locked while ``rotate_secrets`` re-encrypts their
    secrets, so a concurrent roll of one is not overwritten."""
    return list(WebhookEndpoint.objects.select_for_update().filter(pk__gt=after_id).order_by("pk")[:limit])
