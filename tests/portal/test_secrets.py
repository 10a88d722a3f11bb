"""Tenant secrets: the API (write-only, by name, scoped, audited), encryption at rest and rotation."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet
from django.core.management import call_command
from django.core.management.base import CommandError

from portal.models import AuditEvent, TenantSecret
from portal.services.secrets import SecretMissing, secrets_resolve

pytestmark = pytest.mark.django_db

VALUE = "s3cr3t-p@ss word\n"  # kept exactly: spaces, a newline


@pytest.fixture
def admin_client(tenant, make_token, api):
    return api(make_token(tenant))


def post(client, url, body):
    return client.post(url, body, content_type="application/json")


def test_create_list_replace_delete_never_return_the_value(admin_client, tenant):
    r = post(admin_client, "/api/v1/secrets/", {"name": "DB_PASSWORD", "value": VALUE})
    assert r.status_code == 201, r.content
    assert set(r.json()) == {"name", "created_at", "updated_at"}
    listed = admin_client.get("/api/v1/secrets/").json()["results"]
    assert [s["name"] for s in listed] == ["DB_PASSWORD"]
    detail = admin_client.get("/api/v1/secrets/DB_PASSWORD/")
    assert detail.status_code == 200 and "value" not in detail.json()
    for response in (r, admin_client.get("/api/v1/secrets/"), detail):
        assert VALUE.strip().encode() not in response.content

    row = TenantSecret.objects.get(tenant=tenant, name="DB_PASSWORD")
    assert VALUE not in row.ciphertext and row.ciphertext.startswith("gAAAAA")  # a Fernet token
    assert secrets_resolve(tenant_id=tenant.pk, names=["DB_PASSWORD"]) == {"DB_PASSWORD": VALUE}

    r = admin_client.put("/api/v1/secrets/DB_PASSWORD/", {"value": "new"}, content_type="application/json")
    assert r.status_code == 200 and "value" not in r.json()
    assert secrets_resolve(tenant_id=tenant.pk, names=["DB_PASSWORD"]) == {"DB_PASSWORD": "new"}

    assert admin_client.delete("/api/v1/secrets/DB_PASSWORD/").status_code == 204
    assert admin_client.get("/api/v1/secrets/").json()["results"] == []
    with pytest.raises(SecretMissing, match="DB_PASSWORD"):
        secrets_resolve(tenant_id=tenant.pk, names=["DB_PASSWORD"])

    audit = list(
        AuditEvent.objects.filter(tenant=tenant, action__startswith="secret.").order_by("created", "id")
    )
    assert [(a.action, a.data) for a in audit] == [
        ("secret.create", {"name": "DB_PASSWORD"}),
        ("secret.update", {"name": "DB_PASSWORD"}),
        ("secret.delete", {"name": "DB_PASSWORD"}),
    ]
    assert all(a.actor_type == "token" for a in audit)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "has space", "value": "x"}, "name"),
        ({"name": "-dash", "value": "x"}, "name"),
        ({"name": "A" * 65, "value": "x"}, "name"),
        ({"name": "OK", "value": ""}, "value"),
        ({"name": "OK", "value": 5}, "value"),
        ({"name": "OK", "value": "a\x00b"}, "value"),
        ({"name": "OK", "value": "x" * (16 * 1024 + 1)}, "value"),
        ({"name": "OK"}, "value"),
        ({"value": "x"}, "name"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_stores_nothing(admin_client, body, field):
    r = post(admin_client, "/api/v1/secrets/", body)
    assert r.status_code == 400, r.content
    assert field in r.json()["error"]["fields"]
    assert (
        not TenantSecret.objects.exists() and not AuditEvent.objects.filter(action="secret.create").exists()
    )


def test_a_name_taken_is_a_400_naming_name(admin_client):
    assert post(admin_client, "/api/v1/secrets/", {"name": "K", "value": "1"}).status_code == 201
    r = post(admin_client, "/api/v1/secrets/", {"name": "K", "value": "2"})
    assert r.status_code == 400 and "name" in r.json()["error"]["fields"]


def test_read_tokens_see_names_and_cannot_write(admin_client, tenant, make_token, api):
    assert post(admin_client, "/api/v1/secrets/", {"name": "API_KEY", "value": "abc123"}).status_code == 201
    reader = api(make_token(tenant, scopes=("read",)))
    r = reader.get("/api/v1/secrets/")
    assert r.status_code == 200 and [s["name"] for s in r.json()["results"]] == ["API_KEY"]
    assert b"abc123" not in r.content
    assert post(reader, "/api/v1/secrets/", {"name": "X", "value": "1"}).status_code == 403
    assert (
        reader.put("/api/v1/secrets/API_KEY/", {"value": "2"}, content_type="application/json").status_code
        == 403
    )
    assert reader.delete("/api/v1/secrets/API_KEY/").status_code == 403
    assert TenantSecret.objects.get(name="API_KEY") and secrets_resolve(
        tenant_id=tenant.pk, names=["API_KEY"]
    ) == {"API_KEY": "abc123"}


def test_another_tenants_secret_does_not_exist(admin_client, make_tenant, make_token, api):
    assert post(admin_client, "/api/v1/secrets/", {"name": "MINE", "value": "1"}).status_code == 201
    assert admin_client.get("/api/v1/secrets/MINE/").status_code == 200  # the owner's positive control
    other = api(make_token(make_tenant("globex")))
    assert other.get("/api/v1/secrets/").json()["results"] == []
    assert other.get("/api/v1/secrets/MINE/").status_code == 404
    assert (
        other.put("/api/v1/secrets/MINE/", {"value": "x"}, content_type="application/json").status_code == 404
    )
    assert other.delete("/api/v1/secrets/MINE/").status_code == 404
    assert TenantSecret.objects.filter(name="MINE").count() == 1


def test_rotation_re_encrypts_under_the_new_key_and_the_old_one_can_go(settings, tenant, admin_client):
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    settings.SECRETS_ENCRYPTION_KEYS = [old]
    assert post(admin_client, "/api/v1/secrets/", {"name": "K", "value": "v1"}).status_code == 201
    before = TenantSecret.objects.get(name="K").ciphertext

    settings.SECRETS_ENCRYPTION_KEYS = [new, old]  # 1. the new key first
    call_command("rotate_secrets")  # 2. re-encrypt
    after = TenantSecret.objects.get(name="K").ciphertext
    assert after != before
    settings.SECRETS_ENCRYPTION_KEYS = [new]  # 3. drop the old key
    assert secrets_resolve(tenant_id=tenant.pk, names=["K"]) == {"K": "v1"}
    assert Fernet(new.encode()).decrypt(after.encode()) == b"v1"

    # Without the key that encrypted a secret, it cannot be read, and rotation says so.
    settings.SECRETS_ENCRYPTION_KEYS = [Fernet.generate_key().decode()]
    with pytest.raises(SecretMissing, match="cannot be decrypted"):
        secrets_resolve(tenant_id=tenant.pk, names=["K"])
    with pytest.raises(CommandError, match="1 secret"):
        call_command("rotate_secrets")
