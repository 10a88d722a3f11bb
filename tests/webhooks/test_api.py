"""``/api/v1/webhooks/`` and ``/api/v1/webhook-deliveries/``: what is accepted, what is refused
(400 naming the field), who may (admin scope), and that another tenant's rows do not exist."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest

from portal.crypto import secret_decrypt
from portal.models import AuditEvent
from webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent

URL = "https://hooks.example.com/gpupool"
pytestmark = pytest.mark.django_db


@pytest.fixture
def owner_api(api, make_token, tenant):
    return api(make_token(tenant))


def _create(client, **body):
    return client.post("/api/v1/webhooks/", body, content_type="application/json")


def test_create_shows_the_secret_once_and_stores_it_encrypted(owner_api, tenant):
    r = _create(owner_api, url=URL, event_types=["workload.state", "invoice.paid"], description="ops")
    assert r.status_code == 201, r.content
    body = r.json()
    secret = body["secret"]
    assert secret.startswith("whsec_") and len(secret) > 40
    assert body["event_types"] == ["invoice.paid", "workload.state"] and body["enabled"] is True
    row = WebhookEndpoint.objects.get(pk=body["id"])
    assert secret not in row.secret_ciphertext and secret_decrypt(row.secret_ciphertext) == secret
    # Never again: not in the detail, the list, or the audit log.
    detail = owner_api.get(f"/api/v1/webhooks/{row.pk}/")
    assert detail.status_code == 200 and "secret" not in detail.json()
    assert secret not in owner_api.get("/api/v1/webhooks/").content.decode()
    audit = AuditEvent.objects.get(action="webhook.create")
    assert secret not in str(audit.data) and audit.data["url"] == URL
    # Rolling gives a new one, once.
    rolled = owner_api.post(f"/api/v1/webhooks/{row.pk}/roll-secret/")
    assert rolled.status_code == 200 and rolled.json()["secret"] not in (secret, "")
    row.refresh_from_db()
    assert secret_decrypt(row.secret_ciphertext) == rolled.json()["secret"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "http://hooks.example.com/", "event_types": ["*"]}, "url"),
        ({"url": "https://10.0.0.5/hook", "event_types": ["*"]}, "url"),
        ({"url": "https://169.254.169.254/latest", "event_types": ["*"]}, "url"),
        ({"url": "https://[::1]:8000/", "event_types": ["*"]}, "url"),
        ({"url": "https://localhost/", "event_types": ["*"]}, "url"),
        ({"url": "https://u:p@hooks.example.com/", "event_types": ["*"]}, "url"),
        ({"url": "gopher://hooks.example.com/", "event_types": ["*"]}, "url"),
        ({"url": 12, "event_types": ["*"]}, "url"),
        ({"url": {"a": 1}, "event_types": ["*"]}, "url"),
        ({"url": "https://x.example.com/" + "a" * 3000, "event_types": ["*"]}, "url"),
        ({"url": URL, "event_types": ["workload.exploded"]}, "event_types"),
        ({"url": URL, "event_types": ["workload.state", "nope"]}, "event_types"),
        ({"url": URL, "event_types": []}, "event_types"),
        ({"url": URL, "event_types": "workload.state"}, "event_types"),
        ({"url": URL, "event_types": [1]}, "event_types"),
        ({"url": URL, "event_types": ["*", "invoice.paid"]}, "event_types"),
        ({"url": URL, "event_types": ["*"], "description": 5}, "description"),
        ({"url": URL, "event_types": ["*"], "description": "x" * 201}, "description"),
        ({"url": URL, "event_types": ["*"], "description": "a\x00b"}, "description"),
        ({"url": URL, "event_types": ["*"], "enabled": "yes"}, "enabled"),
        ({"url": URL, "event_types": ["*"], "enabled": None}, "enabled"),
        ({"url": URL, "event_types": ["*"], "secret": "mine"}, "secret"),
        ({"url": URL, "event_types": ["*"], "headers": {"X": "1"}}, "headers"),
        ({"event_types": ["*"]}, "url"),
        ({"url": URL}, "event_types"),
    ],
)
def test_hostile_input_is_a_400_naming_the_field_and_writes_nothing(owner_api, body, field):
    r = _create(owner_api, **body)
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"], r.json()
    assert not WebhookEndpoint.objects.exists()
    assert not AuditEvent.objects.filter(action__startswith="webhook.").exists()


def test_an_endpoint_made_disabled_is_sent_nothing(owner_api, tenant):
    r = _create(owner_api, url=URL, event_types=["*"], enabled=False)
    assert r.status_code == 201 and r.json()["enabled"] is False
    from portal.events import publish

    publish(tenant_id=tenant.pk, event={"type": "budget.alert", "threshold": 50})
    assert not WebhookDelivery.objects.exists()
    owner_api.patch(f"/api/v1/webhooks/{r.json()['id']}/", {"enabled": True}, content_type="application/json")
    publish(tenant_id=tenant.pk, event={"type": "budget.alert", "threshold": 80})
    assert WebhookDelivery.objects.get().event.payload == {"threshold": 80}


def test_a_body_that_is_not_an_object_is_a_400(owner_api):
    r = owner_api.post("/api/v1/webhooks/", "[1, 2]", content_type="application/json")
    assert r.status_code == 400
    r = owner_api.post("/api/v1/webhooks/", "not json", content_type="application/json")
    assert r.status_code == 400


def test_patch_changes_what_it_names_and_refuses_the_rest(owner_api):
    pk = _create(owner_api, url=URL, event_types=["*"]).json()["id"]
    r = owner_api.patch(
        f"/api/v1/webhooks/{pk}/",
        {"event_types": ["budget.alert"], "enabled": False},
        content_type="application/json",
    )
    assert (
        r.status_code == 200 and r.json()["event_types"] == ["budget.alert"] and r.json()["enabled"] is False
    )
    for body, field in [
        ({"enabled": "no"}, "enabled"),
        ({"url": "https://192.168.0.1/"}, "url"),
        ({"event_types": ["made.up"]}, "event_types"),
        ({"id": 5}, "id"),
    ]:
        r = owner_api.patch(f"/api/v1/webhooks/{pk}/", body, content_type="application/json")
        assert r.status_code == 400 and field in r.json()["error"]["fields"], (body, r.content)
    row = WebhookEndpoint.objects.get(pk=pk)
    assert row.url == URL and row.event_types == ["budget.alert"] and row.enabled is False


def test_event_types_are_listed(owner_api):
    r = owner_api.get("/api/v1/webhook-event-types/")
    assert r.status_code == 200
    names = [t["name"] for t in r.json()]
    assert {"workload.state", "invoice.finalized", "invoice.paid", "invoice.overdue", "budget.alert"} <= set(
        names
    )
    assert {"volume.full", "workload.preemption_notice", "gang.completed"} <= set(names)


def test_the_endpoint_limit(owner_api, settings):
    settings.WEBHOOK_MAX_ENDPOINTS = 2
    assert _create(owner_api, url=URL, event_types=["*"]).status_code == 201
    assert _create(owner_api, url=URL, event_types=["*"]).status_code == 201
    r = _create(owner_api, url=URL, event_types=["*"])
    assert r.status_code == 400 and "at most 2" in r.json()["error"]["message"]


@pytest.mark.parametrize("scopes", [("read",), ("read", "write"), ("read", "write", "billing")])
def test_managing_webhooks_needs_the_admin_scope(api, make_token, tenant, owner_api, scopes):
    pk = _create(owner_api, url=URL, event_types=["*"]).json()["id"]
    client = api(make_token(tenant, scopes=scopes))
    assert client.get("/api/v1/webhooks/").status_code == 403
    assert client.get(f"/api/v1/webhooks/{pk}/").status_code == 403
    assert _create(client, url=URL, event_types=["*"]).status_code == 403
    assert client.delete(f"/api/v1/webhooks/{pk}/").status_code == 403
    assert client.get("/api/v1/webhook-deliveries/").status_code == 403
    assert WebhookEndpoint.objects.count() == 1


def _delivery(endpoint):
    from django.utils import timezone

    event = WebhookEvent.objects.create(
        tenant=endpoint.tenant, type="budget.alert", payload={"threshold": 50}
    )
    return WebhookDelivery.objects.create(
        tenant=endpoint.tenant,
        endpoint=endpoint,
        event=event,
        state="failed",
        retry_until=timezone.now(),
        attempts=3,
    )


def test_another_tenants_endpoints_and_deliveries_do_not_exist(
    api, make_token, make_tenant, tenant, owner_api
):
    pk = _create(owner_api, url=URL, event_types=["*"]).json()["id"]
    delivery = _delivery(WebhookEndpoint.objects.get(pk=pk))
    other = api(make_token(make_tenant("globex")))
    # Positive control: the owner reaches each of them by the same routes.
    assert owner_api.get(f"/api/v1/webhooks/{pk}/").status_code == 200
    assert owner_api.get(f"/api/v1/webhook-deliveries/{delivery.pk}/").status_code == 200
    assert (
        owner_api.get(f"/api/v1/webhook-deliveries/?endpoint={pk}").json()["results"][0]["id"] == delivery.pk
    )
    for method, url in [
        ("get", f"/api/v1/webhooks/{pk}/"),
        ("patch", f"/api/v1/webhooks/{pk}/"),
        ("delete", f"/api/v1/webhooks/{pk}/"),
        ("post", f"/api/v1/webhooks/{pk}/roll-secret/"),
        ("get", f"/api/v1/webhook-deliveries/{delivery.pk}/"),
        ("post", f"/api/v1/webhook-deliveries/{delivery.pk}/redeliver/"),
    ]:
        r = getattr(other, method)(
            url, {"enabled": False} if method == "patch" else None, content_type="application/json"
        )
        assert r.status_code == 404, (method, url, r.status_code)
    assert other.get("/api/v1/webhooks/").json()["results"] == []
    assert other.get("/api/v1/webhook-deliveries/").json()["results"] == []
    # Filtering by another tenant's endpoint is refused as an unknown id is.
    assert other.get(f"/api/v1/webhook-deliveries/?endpoint={pk}").status_code == 400
    delivery.refresh_from_db()
    assert delivery.state == "failed" and WebhookEndpoint.objects.get(pk=pk).enabled is True


def test_delivery_detail_shows_the_body_and_redeliver_queues_it(
    owner_api, django_capture_on_commit_callbacks
):
    pk = _create(owner_api, url=URL, event_types=["*"]).json()["id"]
    delivery = _delivery(WebhookEndpoint.objects.get(pk=pk))
    detail = owner_api.get(f"/api/v1/webhook-deliveries/{delivery.pk}/").json()
    assert detail["payload"]["type"] == "budget.alert" and detail["payload"]["data"] == {"threshold": 50}
    assert detail["payload"]["id"] == f"evt_{delivery.event_id}" and detail["attempt_log"] == []
    with django_capture_on_commit_callbacks() as callbacks:
        r = owner_api.post(f"/api/v1/webhook-deliveries/{delivery.pk}/redeliver/")
    assert r.status_code == 200 and r.json()["state"] == "pending"
    assert len(callbacks) == 1  # the attempt's task, queued after the commit
    delivery.refresh_from_db()
    assert delivery.manual is True and delivery.next_attempt_at is not None
    assert AuditEvent.objects.filter(action="webhook.redeliver").count() == 1
    # A disabled endpoint is not redelivered to.
    owner_api.patch(f"/api/v1/webhooks/{pk}/", {"enabled": False}, content_type="application/json")
    r = owner_api.post(f"/api/v1/webhook-deliveries/{delivery.pk}/redeliver/")
    assert r.status_code == 409


def test_delete_removes_the_endpoint_and_its_log(owner_api):
    pk = _create(owner_api, url=URL, event_types=["*"]).json()["id"]
    _delivery(WebhookEndpoint.objects.get(pk=pk))
    assert owner_api.delete(f"/api/v1/webhooks/{pk}/").status_code == 204
    assert not WebhookEndpoint.objects.exists() and not WebhookDelivery.objects.exists()


def test_rotate_secrets_re_encrypts_webhook_secrets(owner_api, settings):
    from cryptography.fernet import Fernet
    from django.core.management import call_command

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    settings.SECRETS_ENCRYPTION_KEYS = [old]
    r = _create(owner_api, url=URL, event_types=["*"])
    secret, before = r.json()["secret"], WebhookEndpoint.objects.get().secret_ciphertext
    settings.SECRETS_ENCRYPTION_KEYS = [new, old]
    call_command("rotate_secrets", stdout=io.StringIO())
    after = WebhookEndpoint.objects.get().secret_ciphertext
    assert after != before and Fernet(new.encode()).decrypt(after.encode()).decode() == secret
    settings.SECRETS_ENCRYPTION_KEYS = [new]
    assert secret_decrypt(after) == secret


def test_rotate_secrets_re_encrypts_a_kept_previous_secret_too(owner_api, settings):
    from cryptography.fernet import Fernet
    from django.core.management import call_command

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    settings.SECRETS_ENCRYPTION_KEYS = [old]
    made = _create(owner_api, url=URL, event_types=["*"]).json()
    owner_api.post(
        f"/api/v1/webhooks/{made['id']}/roll-secret/",
        {"expire_previous_in_s": 3600},
        content_type="application/json",
    )
    settings.SECRETS_ENCRYPTION_KEYS = [new, old]
    call_command("rotate_secrets", stdout=io.StringIO())
    settings.SECRETS_ENCRYPTION_KEYS = [new]  # the old key gone: both still readable
    assert secret_decrypt(WebhookEndpoint.objects.get().previous_secret_ciphertext) == made["secret"]


def _roll(client, pk, body=None):
    return client.post(f"/api/v1/webhooks/{pk}/roll-secret/", body or {}, content_type="application/json")


def test_a_roll_can_keep_the_old_secret_signing_for_a_while(owner_api):
    from django.utils import timezone

    made = _create(owner_api, url=URL, event_types=["*"]).json()
    before = timezone.now()
    r = _roll(owner_api, made["id"], {"expire_previous_in_s": 86400})
    assert r.status_code == 200, r.content
    rolled = r.json()
    row = WebhookEndpoint.objects.get()
    assert secret_decrypt(row.secret_ciphertext) == rolled["secret"] != made["secret"]
    assert secret_decrypt(row.previous_secret_ciphertext) == made["secret"]
    until = row.previous_secret_expires_at
    assert before + timedelta(days=1) <= until <= timezone.now() + timedelta(days=1)
    assert rolled["previous_secret_expires_at"] is not None
    assert owner_api.get(f"/api/v1/webhooks/{row.pk}/").json()["previous_secret_expires_at"] is not None
    assert AuditEvent.objects.filter(action="webhook.roll_secret").last().data == {
        "expire_previous_in_s": 86400
    }
    # A roll without it (the default, also with no body at all) stops the old one at once.
    r = owner_api.post(f"/api/v1/webhooks/{row.pk}/roll-secret/")
    assert r.status_code == 200 and r.json()["previous_secret_expires_at"] is None
    row.refresh_from_db()
    assert (row.previous_secret_ciphertext, row.previous_secret_expires_at) == ("", None)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"expire_previous_in_s": -1}, "expire_previous_in_s"),
        ({"expire_previous_in_s": 604801}, "expire_previous_in_s"),
        ({"expire_previous_in_s": "3600"}, "expire_previous_in_s"),
        ({"expire_previous_in_s": 1.5}, "expire_previous_in_s"),
        ({"expire_previous_in_s": True}, "expire_previous_in_s"),
        ({"expire_previous_in_s": None}, "expire_previous_in_s"),
        ({"keep": 60}, "keep"),
    ],
)
def test_a_hostile_roll_is_a_400_naming_the_field_and_changes_nothing(owner_api, body, field):
    made = _create(owner_api, url=URL, event_types=["*"]).json()
    r = _roll(owner_api, made["id"], body)
    assert r.status_code == 400 and field in r.json()["error"]["fields"], r.content
    assert secret_decrypt(WebhookEndpoint.objects.get().secret_ciphertext) == made["secret"]
    assert _roll(owner_api, made["id"], {"expire_previous_in_s": 604800}).status_code == 200  # the bound


def test_a_pending_delivery_of_a_disabled_endpoint_fails_without_a_request(owner_api, tenant):
    from portal.events import publish
    from webhooks.services.deliveries import delivery_attempt

    pk = _create(owner_api, url=URL, event_types=["*"]).json()["id"]
    publish(tenant_id=tenant.pk, event={"type": "budget.alert", "threshold": 50})
    delivery = WebhookDelivery.objects.get()
    owner_api.patch(f"/api/v1/webhooks/{pk}/", {"enabled": False}, content_type="application/json")
    assert delivery_attempt(delivery_id=delivery.pk) is None
    delivery.refresh_from_db()
    assert delivery.state == "failed" and delivery.last_error == "endpoint disabled"
    assert delivery.attempt_log.count() == 0


def test_purge_keeps_recent_events_and_pending_deliveries(owner_api, tenant, settings):
    from datetime import timedelta

    from django.utils import timezone

    from portal.events import publish
    from webhooks.services.deliveries import webhooks_purge

    settings.WEBHOOK_RETENTION_DAYS = 30
    _create(owner_api, url=URL, event_types=["*"])
    for threshold in (50, 80, 100):
        publish(tenant_id=tenant.pk, event={"type": "budget.alert", "threshold": threshold})
    old = timezone.now() - timedelta(days=31)
    done, pending, recent = WebhookDelivery.objects.order_by("pk")
    WebhookEvent.objects.filter(pk__in=[done.event_id, pending.event_id]).update(created_at=old)
    WebhookDelivery.objects.filter(pk=done.pk).update(state="succeeded", next_attempt_at=None)
    assert webhooks_purge() == 1
    assert set(WebhookEvent.objects.values_list("pk", flat=True)) == {pending.event_id, recent.event_id}
    assert not WebhookDelivery.objects.filter(pk=done.pk).exists()
