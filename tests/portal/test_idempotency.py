"""``Idempotency-Key`` on API creates: a repeat with the same key, route and body gets the first
answer; another body is 422; keys expire; concurrent repeats create one object."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from portal.models import ApiToken, IdempotencyKey, TenantSecret
from portal.services.idempotency import idempotency_keys_purge_expired
from tests.conftest import postgres_only
from tests.races import together


def post(client, url, body, key=None):
    headers = {"Idempotency-Key": key} if key is not None else {}
    return client.post(url, body, content_type="application/json", headers=headers)


@pytest.fixture
def acme(tenant, make_token, api):
    return api(make_token(tenant))


def test_a_repeated_create_returns_the_first_result(acme, tenant):
    first = post(acme, "/api/v1/tokens/", {"name": "ci", "scopes": ["read"]}, key="k-1")
    assert first.status_code == 201
    again = post(acme, "/api/v1/tokens/", {"name": "ci", "scopes": ["read"]}, key="k-1")
    assert again.status_code == 201
    assert again.json() == first.json()  # the same token, its secret included
    assert again["Idempotent-Replayed"] == "true"
    assert ApiToken.objects.filter(tenant=tenant, name="ci").count() == 1
    # Without a key (the positive control), a repeat makes a second token.
    assert post(acme, "/api/v1/tokens/", {"name": "ci", "scopes": ["read"]}).status_code == 201
    assert ApiToken.objects.filter(tenant=tenant, name="ci").count() == 2
    # The stored answer carries a secret: it is kept encrypted.
    row = IdempotencyKey.objects.get(tenant=tenant, key="k-1")
    assert first.json()["token"] not in row.response_encrypted


def test_another_body_or_route_with_the_same_key_is_422(acme, tenant):
    assert post(acme, "/api/v1/secrets/", {"name": "a", "value": "1"}, key="k-2").status_code == 201
    r = post(acme, "/api/v1/secrets/", {"name": "b", "value": "1"}, key="k-2")
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "idempotency_key_reused"
    assert "Idempotency-Key" in r.json()["error"]["fields"]
    r = post(acme, "/api/v1/tokens/", {"name": "x", "scopes": ["read"]}, key="k-2")
    assert r.status_code == 422
    assert sorted(TenantSecret.objects.filter(tenant=tenant).values_list("name", flat=True)) == ["a"]


def test_keys_are_per_tenant(acme, make_tenant, make_token, api):
    other = api(make_token(make_tenant("globex")))
    assert post(acme, "/api/v1/secrets/", {"name": "a", "value": "1"}, key="shared").status_code == 201
    r = post(other, "/api/v1/secrets/", {"name": "a", "value": "1"}, key="shared")
    assert r.status_code == 201
    assert "Idempotent-Replayed" not in r


def test_a_refused_create_keeps_no_key(acme, tenant):
    r = post(acme, "/api/v1/secrets/", {"name": "bad name!", "value": "1"}, key="k-3")
    assert r.status_code == 400
    assert not IdempotencyKey.objects.filter(key="k-3").exists()
    assert post(acme, "/api/v1/secrets/", {"name": "good", "value": "1"}, key="k-3").status_code == 201


def test_a_bad_key_is_refused_naming_the_header(acme, tenant):
    for key in ["", "has space", "x" * 256, "naïve"]:
        r = post(acme, "/api/v1/secrets/", {"name": "s", "value": "1"}, key=key)
        assert r.status_code == 400, key
        assert "Idempotency-Key" in r.json()["error"]["fields"]
    assert not TenantSecret.objects.filter(tenant=tenant).exists()


def test_keys_expire(acme, tenant, settings):
    settings.IDEMPOTENCY_KEY_TTL = timedelta(hours=1)
    assert post(acme, "/api/v1/secrets/", {"name": "a", "value": "1"}, key="k-4").status_code == 201
    IdempotencyKey.objects.filter(key="k-4").update(created_at=timezone.now() - timedelta(hours=2))
    # Expired: the key is forgotten, so the request runs again (and the name now exists: 4xx).
    r = post(acme, "/api/v1/secrets/", {"name": "a", "value": "1"}, key="k-4")
    assert r.status_code in (400, 409)
    assert post(acme, "/api/v1/secrets/", {"name": "b", "value": "1"}, key="k-5").status_code == 201
    IdempotencyKey.objects.filter(key="k-5").update(created_at=timezone.now() - timedelta(hours=2))
    assert idempotency_keys_purge_expired() == 1
    assert not IdempotencyKey.objects.exists()


def test_the_schema_documents_the_header_on_creates(acme):
    schema = acme.get("/api/schema/?format=json").json()
    create = schema["paths"]["/api/v1/jobs/"]["post"]
    assert any(p["name"] == "Idempotency-Key" and p["in"] == "header" for p in create["parameters"])
    stop = schema["paths"]["/api/v1/jobs/{id}/stop/"]["post"]
    assert not any(p["name"] == "Idempotency-Key" for p in stop.get("parameters", []))


@pytest.mark.django_db(transaction=True)
def test_concurrent_repeats_create_one_object(tenant, make_token):
    postgres_only("concurrent writers on a unique index")
    token = make_token(tenant)
    answers: list[tuple[int, dict]] = []

    def create():
        client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
        r = post(client, "/api/v1/secrets/", {"name": "raced", "value": "v"}, key="race")
        answers.append((r.status_code, r.json()))

    assert together(create, 6) == []
    assert [code for code, _ in answers] == [201] * 6
    assert all(body == answers[0][1] for _, body in answers)
    assert TenantSecret.objects.filter(tenant=tenant, name="raced").count() == 1


def test_an_answer_stored_under_a_removed_key_is_422_not_500(acme, settings):
    from cryptography.fernet import Fernet

    settings.SECRETS_ENCRYPTION_KEYS = [Fernet.generate_key().decode()]
    assert post(acme, "/api/v1/secrets/", {"name": "a", "value": "1"}, key="k-6").status_code == 201
    assert post(acme, "/api/v1/secrets/", {"name": "a", "value": "1"}, key="k-6").status_code == 201
    settings.SECRETS_ENCRYPTION_KEYS = [Fernet.generate_key().decode()]  # the old key dropped
    r = post(acme, "/api/v1/secrets/", {"name": "a", "value": "1"}, key="k-6")
    assert r.status_code == 422 and "no longer be read" in r.json()["error"]["message"]
