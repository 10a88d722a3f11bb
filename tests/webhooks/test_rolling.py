"""Rolling an endpoint's secret without refusing a delivery: while the roll keeps the old secret,
each delivery carries a ``v1`` under the new and the old one, so a receiver that still holds only
the old secret (or already only the new) accepts it; after that, only the new one signs. Real
deliveries (the delivery service, over HTTP) to a receiver that verifies with the client's
``gpupool.webhooks.verify``."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gpupool.webhooks import HEADER
from portal.actors import Actor
from webhooks.models import WebhookEndpoint
from webhooks.services.deliveries import delivery_attempt
from webhooks.services.endpoints import endpoint_create, endpoint_roll_secret
from webhooks.services.events import events_record

pytestmark = pytest.mark.django_db


def _deliver(tenant):
    [delivery] = events_record(events=[(tenant.pk, {"type": "budget.alert", "threshold": 80})])
    return delivery_attempt(delivery_id=delivery.pk)


def test_the_old_secret_signs_beside_the_new_until_it_expires(tenant, loopback, receiver, settings):
    settings.WEBHOOK_RETRY_BASE_S = 3600  # no retry queued during the test
    endpoint, old = endpoint_create(
        tenant=tenant, url=receiver.url(), event_types=["*"], actor=Actor.system()
    )
    endpoint, new = endpoint_roll_secret(endpoint=endpoint, actor=Actor.system(), expire_previous_in_s=3600)
    for holds in (old, new, [new, old]):  # not switched yet, switched, or holding both
        receiver.secret = holds
        attempt = _deliver(tenant)
        got = receiver.received[-1]
        assert attempt.status == 200 and got.verified, got.verify_error
        assert got.headers[HEADER].count("v1=") == 2
    # The overlap over: only the new secret signs; a receiver still on the old one refuses.
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        previous_secret_expires_at=timezone.now() - timedelta(seconds=1)
    )
    receiver.secret = old
    attempt = _deliver(tenant)
    got = receiver.received[-1]
    assert attempt.status == 400 and not got.verified and got.headers[HEADER].count("v1=") == 1
    receiver.secret = new
    assert _deliver(tenant).status == 200 and receiver.received[-1].verified


def test_a_roll_that_keeps_nothing_stops_the_old_secret_at_once(tenant, loopback, receiver, settings):
    settings.WEBHOOK_RETRY_BASE_S = 3600
    endpoint, old = endpoint_create(
        tenant=tenant, url=receiver.url(), event_types=["*"], actor=Actor.system()
    )
    endpoint, first = endpoint_roll_secret(endpoint=endpoint, actor=Actor.system(), expire_previous_in_s=600)
    # A second roll during the first's overlap keeps only what it replaces (here: nothing).
    endpoint, second = endpoint_roll_secret(endpoint=endpoint, actor=Actor.system())
    for holds, status in ((old, 400), (first, 400), (second, 200)):
        receiver.secret = holds
        assert _deliver(tenant).status == status
        assert receiver.received[-1].headers[HEADER].count("v1=") == 1
