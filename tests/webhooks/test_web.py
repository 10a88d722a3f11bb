"""The webhooks pages: add an endpoint (its secret shown in that answer only), its deliveries with
every attempt, redeliver (htmx swaps the row), disable, a new secret, delete; admin scope only."""

from __future__ import annotations

import re

import pytest
from django.utils import timezone

from portal.crypto import secret_decrypt
from portal.models import Role
from tests.portal.conftest import HTMX
from webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent

pytestmark = pytest.mark.django_db
URL = "https://hooks.example.com/in"


def _add(client, **data):
    return client.post("/webhooks/", {"url": URL, "event_types": ["workload.state"], **data})


def test_adding_an_endpoint_shows_its_secret_once(owner_client):
    r = _add(owner_client, description="ops pager")
    assert r.status_code == 201 and "no-store" in r["Cache-Control"]
    html = r.content.decode()
    secret = re.search(r'id="webhook-secret-value">(whsec_[^<]+)<', html).group(1)
    endpoint = WebhookEndpoint.objects.get()
    assert secret_decrypt(endpoint.secret_ciphertext) == secret and endpoint.event_types == ["workload.state"]
    page = owner_client.get("/webhooks/").content.decode()
    assert URL in page and "ops pager" in page and secret not in page
    assert secret not in owner_client.get(f"/webhooks/{endpoint.pk}/").content.decode()


@pytest.mark.parametrize(
    ("data", "text"),
    [
        ({"url": "https://10.0.0.1/"}, "private address"),
        ({"url": "http://hooks.example.com/"}, "https"),
        ({"event_types": ["nope"]}, "Select a valid choice"),
        ({"event_types": []}, "required"),
    ],
)
def test_bad_input_is_shown_on_the_form_and_saves_nothing(owner_client, data, text):
    r = _add(owner_client, **data)
    assert r.status_code == 400 and text in r.content.decode()
    assert not WebhookEndpoint.objects.exists()


def _delivery(endpoint, state="failed"):
    event = WebhookEvent.objects.create(
        tenant=endpoint.tenant, type="workload.state", payload={"to": "running"}
    )
    d = WebhookDelivery.objects.create(
        tenant=endpoint.tenant,
        endpoint=endpoint,
        event=event,
        state=state,
        retry_until=timezone.now(),
        attempts=1,
    )
    WebhookAttempt.objects.create(
        tenant=endpoint.tenant, delivery=d, number=1, status=502, latency_ms=37, error="HTTP 502"
    )
    return d


def test_the_endpoint_page_lists_deliveries_and_redelivers_one(
    owner_client, django_capture_on_commit_callbacks
):
    _add(owner_client)
    endpoint = WebhookEndpoint.objects.get()
    d = _delivery(endpoint)
    page = owner_client.get(f"/webhooks/{endpoint.pk}/").content.decode()
    assert f'id="delivery-{d.pk}"' in page and "HTTP 502, 37 ms" in page and "Failed" in page
    # The refresh button's htmx request gets the deliveries card alone.
    part = owner_client.get(f"/webhooks/{endpoint.pk}/", **HTMX).content.decode()
    assert part.lstrip().startswith('<section class="card" id="webhook-deliveries"') and "<html" not in part
    with django_capture_on_commit_callbacks() as queued:
        row = owner_client.post(f"/webhooks/deliveries/{d.pk}/redeliver/", **HTMX)
    assert row.status_code == 200 and len(queued) == 1
    html = row.content.decode()
    assert html.lstrip().startswith(f'<tr id="delivery-{d.pk}"') and "queued again" in html
    d.refresh_from_db()
    assert d.state == "pending" and d.manual is True


def test_disable_roll_and_delete(owner_client):
    _add(owner_client)
    endpoint = WebhookEndpoint.objects.get()
    first = secret_decrypt(endpoint.secret_ciphertext)
    assert owner_client.post(f"/webhooks/{endpoint.pk}/", {"action": "disable"}).status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.enabled is False
    r = owner_client.post(f"/webhooks/{endpoint.pk}/", {"action": "roll"})
    new = re.search(r'id="webhook-secret-value">(whsec_[^<]+)<', r.content.decode()).group(1)
    endpoint.refresh_from_db()
    assert new != first and secret_decrypt(endpoint.secret_ciphertext) == new
    assert endpoint.previous_secret_expires_at is None  # the old one stops at once by default
    r = owner_client.post(f"/webhooks/{endpoint.pk}/", {"action": "roll", "expire_previous_in_s": "86400"})
    assert r.status_code == 200 and "with the old one too until" in r.content.decode()
    endpoint.refresh_from_db()
    assert secret_decrypt(endpoint.previous_secret_ciphertext) == new
    r = owner_client.post(f"/webhooks/{endpoint.pk}/", {"action": "roll", "expire_previous_in_s": "999999"})
    assert r.status_code == 400 and "7 days" in r.content.decode()
    assert owner_client.post(f"/webhooks/{endpoint.pk}/", {"action": "explode"}).status_code == 400
    assert owner_client.post(f"/webhooks/{endpoint.pk}/", {"action": "delete"}).status_code == 302
    assert not WebhookEndpoint.objects.exists()


@pytest.mark.parametrize("role", [Role.MEMBER, Role.BILLING, Role.VIEWER])
def test_the_pages_need_the_admin_scope(owner_client, tenant, add_member, signed_in, role):
    _add(owner_client)
    endpoint = WebhookEndpoint.objects.get()
    d = _delivery(endpoint)
    client = signed_in(add_member(tenant, role).user, tenant)
    assert owner_client.get("/webhooks/").status_code == 200  # positive control
    assert client.get("/webhooks/").status_code == 403
    assert client.get(f"/webhooks/{endpoint.pk}/").status_code == 403
    assert _add(client).status_code == 403
    assert client.post(f"/webhooks/deliveries/{d.pk}/redeliver/").status_code == 403
    assert client.post(f"/webhooks/{endpoint.pk}/", {"action": "delete"}).status_code == 403
    assert WebhookEndpoint.objects.count() == 1 and WebhookDelivery.objects.get().state == "failed"
    assert "/webhooks/" not in client.get("/").content.decode()  # no sidebar entry either
