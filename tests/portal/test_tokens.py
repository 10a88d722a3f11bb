"""API tokens: hashing, once-only display, expiry, revocation, scopes, last-used throttling."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from portal.actors import Actor
from portal.errors import PermissionDenied, ValidationFailed
from portal.models import ApiToken, AuditEvent, Membership, Role, User
from portal.services.members import membership_remove
from portal.services.tenants import tenant_set_status
from portal.services.tokens import api_token_authenticate, api_token_create

pytestmark = pytest.mark.django_db


def test_token_is_stored_only_as_a_sha256_hash(tenant, owner):
    token, plaintext = api_token_create(tenant=tenant, name="ci", scopes=["read"], actor=Actor(user=owner))
    assert plaintext.startswith(f"gpp_{token.key_id}_")
    assert len(plaintext.split("_", 2)[2]) >= 40  # 32 random bytes, url-safe
    row = ApiToken.objects.get(pk=token.pk)
    assert row.token_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    stored = [str(v) for v in ApiToken.objects.filter(pk=token.pk).values().get().values()]
    assert plaintext not in stored
    assert all(plaintext.split("_", 2)[2] not in value for value in stored)


def test_two_tokens_never_share_a_secret(tenant, make_token):
    assert make_token(tenant) != make_token(tenant)


def test_api_shows_the_secret_once(tenant, make_token, api):
    admin = api(make_token(tenant, scopes=["read", "write", "admin"]))
    created = admin.post(
        "/api/v1/tokens/", {"name": "deploy", "scopes": ["read"]}, content_type="application/json"
    )
    assert created.status_code == 201, created.content
    body = created.json()
    plaintext = body["token"]
    assert plaintext.startswith("gpp_")
    assert body["prefix"].startswith(plaintext.split("_", 2)[0] + "_" + plaintext.split("_", 2)[1])

    detail = admin.get(f"/api/v1/tokens/{body['id']}/")
    assert detail.status_code == 200
    assert "token" not in detail.json()
    listing = admin.get("/api/v1/tokens/").content.decode()
    assert plaintext not in listing and plaintext.split("_", 2)[2] not in listing

    # the shown secret works
    assert api(plaintext).get("/api/v1/me/").status_code == 200


def test_wrong_token_is_401_with_json_error(db, api):
    response = api("gpp_000000000000_not-a-real-secret").get("/api/v1/me/")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_token_with_tampered_secret_is_401(tenant, make_token, api):
    plaintext = make_token(tenant)
    tampered = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    assert api(tampered).get("/api/v1/me/").status_code == 401


def test_missing_credentials_is_401(client, db):
    response = client.get("/api/v1/me/")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"


def test_expired_token_is_401(tenant, owner, api):
    token, plaintext = api_token_create(
        tenant=tenant,
        name="short",
        scopes=["read"],
        expires_at=timezone.now() + timedelta(hours=1),
        actor=Actor(user=owner),
    )
    assert api(plaintext).get("/api/v1/me/").status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = api(plaintext).get("/api/v1/me/")
    assert response.status_code == 401
    assert "expired" in response.json()["error"]["message"]


def test_expiry_must_be_in_the_future(tenant, owner):
    with pytest.raises(ValidationFailed) as exc:
        api_token_create(
            tenant=tenant, name="x", scopes=["read"], expires_at=timezone.now(), actor=Actor(user=owner)
        )
    assert "expires_at" in exc.value.fields
    assert not ApiToken.objects.exists()


def test_revoked_token_is_401_and_revocation_is_audited(tenant, make_token, api):
    admin_token = make_token(tenant, scopes=["read", "admin"])
    victim = make_token(tenant, scopes=["read"], name="victim")
    victim_id = ApiToken.objects.get(name="victim").pk
    assert api(victim).get("/api/v1/me/").status_code == 200

    response = api(admin_token).post(f"/api/v1/tokens/{victim_id}/revoke/")
    assert response.status_code == 200
    assert response.json()["status"] == "revoked"
    denied = api(victim).get("/api/v1/me/")
    assert denied.status_code == 401
    assert "revoked" in denied.json()["error"]["message"]
    assert AuditEvent.objects.filter(action="token.revoke", target_id=str(victim_id)).count() == 1
    # revoking twice changes nothing
    api(admin_token).post(f"/api/v1/tokens/{victim_id}/revoke/")
    assert AuditEvent.objects.filter(action="token.revoke", target_id=str(victim_id)).count() == 1


@pytest.mark.parametrize(
    ("scopes", "method", "path", "expected"),
    [
        (["read"], "get", "/api/v1/members/", 200),
        (["read"], "get", "/api/v1/tokens/", 403),  # listing tokens needs admin
        (["read", "admin"], "get", "/api/v1/tokens/", 200),
        (["read"], "post", "/api/v1/tokens/", 403),
        (["read", "write"], "post", "/api/v1/invitations/", 403),  # team changes need admin
        (["billing"], "get", "/api/v1/members/", 403),  # billing alone cannot read the team
    ],
)
def test_scopes_gate_the_api(tenant, make_token, api, scopes, method, path, expected):
    client = api(make_token(tenant, scopes=scopes))
    response = getattr(client, method)(path, {}, content_type="application/json")
    assert response.status_code == expected, response.content
    if expected == 403:
        assert "scope" in response.json()["error"]["message"]


def test_write_implies_read(tenant, owner):
    token, _ = api_token_create(tenant=tenant, name="w", scopes=["write"], actor=Actor(user=owner))
    assert token.scopes == ["read", "write"]


def test_unknown_scope_and_blank_name_are_400_naming_the_field(tenant, make_token, api):
    admin = api(make_token(tenant, scopes=["read", "admin"]))
    bad_scope = admin.post(
        "/api/v1/tokens/", {"name": "x", "scopes": ["root"]}, content_type="application/json"
    )
    assert bad_scope.status_code == 400
    assert "scopes" in bad_scope.json()["error"]["fields"]
    blank = admin.post(
        "/api/v1/tokens/", {"name": "   ", "scopes": ["read"]}, content_type="application/json"
    )
    assert blank.status_code == 400
    assert "name" in blank.json()["error"]["fields"]
    assert ApiToken.objects.filter(tenant=tenant).count() == 1


def test_a_token_cannot_grant_more_than_it_holds(tenant, make_token, api):
    admin_only = api(make_token(tenant, scopes=["read", "admin"]))
    response = admin_only.post(
        "/api/v1/tokens/",
        {"name": "escalate", "scopes": ["read", "billing"]},
        content_type="application/json",
    )
    assert response.status_code == 403
    assert not ApiToken.objects.filter(name="escalate").exists()


def test_a_member_cannot_mint_admin_tokens(tenant):
    member = User.objects.create_user(email="m@acme.test", password="x")
    Membership.objects.create(tenant=tenant, user=member, role=Role.MEMBER)
    with pytest.raises(PermissionDenied):
        api_token_create(tenant=tenant, name="x", scopes=["read", "admin"], actor=Actor(user=member))


def test_removing_a_member_revokes_their_tokens(tenant, owner, api):
    member = User.objects.create_user(email="m@acme.test", password="x")
    membership = Membership.objects.create(tenant=tenant, user=member, role=Role.MEMBER)
    _, plaintext = api_token_create(tenant=tenant, name="m", scopes=["read"], actor=Actor(user=member))
    membership_remove(membership=membership, actor=Actor(user=owner))
    assert api(plaintext).get("/api/v1/me/").status_code == 401


def test_last_used_is_updated_at_most_once_a_minute(tenant, make_token, api, django_assert_max_num_queries):
    plaintext = make_token(tenant, scopes=["read"])
    client = api(plaintext)
    client.get("/api/v1/me/")
    token = ApiToken.objects.get()
    first = token.last_used_at
    assert first is not None
    client.get("/api/v1/me/")
    assert ApiToken.objects.get().last_used_at == first  # within the minute: untouched

    ApiToken.objects.update(last_used_at=first - timedelta(seconds=61))
    client.get("/api/v1/me/")
    assert ApiToken.objects.get().last_used_at > first - timedelta(seconds=1)


def test_me_reports_tenant_and_scopes(tenant, make_token, api):
    body = api(make_token(tenant, scopes=["read", "billing"])).get("/api/v1/me/").json()
    assert body["tenant"]["slug"] == "acme"
    assert body["scopes"] == ["read", "billing"]
    assert body["token"]["scopes"] == ["read", "billing"]


def test_suspended_tenant_tokens_get_403_with_the_reason(tenant, make_token, api):
    plaintext = make_token(tenant)
    tenant_set_status(tenant=tenant, status="suspended", reason="unpaid invoice", actor=Actor.system())
    response = api(plaintext).get("/api/v1/me/")
    assert response.status_code == 403
    assert "suspended" in response.json()["error"]["message"]
    assert "unpaid invoice" in response.json()["error"]["message"]


def test_createapitoken_prints_the_token_once(tenant, capsys):
    call_command("createapitoken", "acme", "--name", "cli", "--scope", "read", "--scope", "write")
    out = capsys.readouterr()
    plaintext = out.out.strip()
    assert plaintext.startswith("gpp_")
    token = ApiToken.objects.get(name="cli")
    assert token.scopes == ["read", "write"]
    assert token.token_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert "cannot be shown again" in out.err


def test_createapitoken_rejects_unknown_tenant_and_bad_expiry(tenant):
    with pytest.raises(CommandError, match="No tenant"):
        call_command("createapitoken", "nope", "--name", "x")
    with pytest.raises(CommandError, match="positive"):
        call_command("createapitoken", "acme", "--name", "x", "--expires-in-days", "0")
    assert not ApiToken.objects.exists()


def test_the_token_lookup_loads_what_the_orm_loads(tenant, owner, django_assert_num_queries):
    """``api_token_authenticate`` reads the token (with its creator's role) and its tenant in one
    ``raw()`` statement: every field as the ORM reads it for a plain ``select_related`` (JSON
    scopes, aware times)."""
    token, plaintext = api_token_create(
        tenant=tenant,
        name="ci",
        scopes=["read", "write"],
        actor=Actor(user=owner),
        expires_at=timezone.now() + timedelta(days=3),
    )
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    with django_assert_num_queries(1):
        found = api_token_authenticate(plaintext=plaintext)
        found_tenant = found.tenant
    expected = ApiToken.objects.select_related("tenant").get(pk=token.pk)
    for model_obj, orm_obj in ((found, expected), (found_tenant, expected.tenant)):
        assert type(model_obj) is type(orm_obj)
        for field in type(orm_obj)._meta.concrete_fields:
            got, want = getattr(model_obj, field.attname), getattr(orm_obj, field.attname)
            assert (got, type(got)) == (want, type(want)), field.name
            if hasattr(want, "tzinfo"):
                assert got.tzinfo is not None, field.name
    assert found.scopes == ["read", "write"]
    for model_obj, orm_obj in ((found, expected), (found_tenant, expected.tenant)):
        assert model_obj._state.adding is False and model_obj._state.db == orm_obj._state.db
    with django_assert_num_queries(1):  # the creator is loaded when asked
        assert found.created_by == owner
    assert api_token_authenticate(plaintext=f"gpp_{token.key_id}_wrong") is None
    assert api_token_authenticate(plaintext="gpp_nosuchkey_secret") is None
