"""The API tokens page: the secret shown once, only its hash stored, revoking, and permissions."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.utils import timezone

from portal.models import ApiToken, AuditEvent, Role, hash_secret
from tests.portal.conftest import HTMX

pytestmark = pytest.mark.django_db

SECRET = re.compile(r"gpp_[0-9a-f]{12}_[A-Za-z0-9_-]{20,}")


def test_create_shows_the_secret_once_and_stores_only_its_hash(owner_client, api):
    response = owner_client.post(
        "/tokens/new/", {"name": "CI pipeline", "scopes": ["read", "write"], "expiry": "30"}
    )
    assert response.status_code == 201
    assert "no-store" in response["Cache-Control"]
    html = response.content.decode()
    plaintext = SECRET.search(html).group(0)
    assert "shown only this once" in html and "data-copy" in html

    token = ApiToken.objects.get(name="CI pipeline")
    assert token.token_hash == hash_secret(plaintext)
    assert token.scopes == ["read", "write"]
    assert dt.timedelta(days=29) < token.expires_at - timezone.now() <= dt.timedelta(days=30)
    stored = [str(v) for v in ApiToken.objects.values_list(*[f.attname for f in ApiToken._meta.fields]).get()]
    assert not any(plaintext in v for v in stored)
    assert plaintext not in str(dict(owner_client.session))

    reload = owner_client.get("/tokens/").content.decode()
    assert not SECRET.search(reload)
    assert "CI pipeline" in reload and token.display_prefix in reload

    assert api(plaintext).get("/api/v1/me/").status_code == 200  # the secret shown is the real one


def test_create_with_htmx_returns_the_secret_card_and_the_table_out_of_band(owner_client):
    response = owner_client.post(
        "/tokens/new/", {"name": "bot", "scopes": ["read"], "expiry": "never"}, **HTMX
    )
    assert response.status_code == 201
    html = response.content.decode()
    assert "<html" not in html
    assert html.lstrip().startswith('<section class="card card-success" id="token-create"')
    assert 'id="tokens" aria-labelledby="tokens-title" hx-swap-oob="true"' in html
    assert SECRET.search(html)
    assert ApiToken.objects.get(name="bot").expires_at is None


def test_expiry_on_a_date_ends_at_the_start_of_the_next_day_in_the_users_zone(owner_client, owner):
    owner.time_zone = "America/New_York"
    owner.save()
    day = timezone.localdate() + dt.timedelta(days=10)
    response = owner_client.post(
        "/tokens/new/", {"name": "dated", "scopes": ["read"], "expiry": "date", "expires_on": day.isoformat()}
    )
    assert response.status_code == 201
    expires = ApiToken.objects.get(name="dated").expires_at
    from zoneinfo import ZoneInfo

    local = expires.astimezone(ZoneInfo("America/New_York"))
    assert (local.date(), local.time()) == (day + dt.timedelta(days=1), dt.time.min)


def test_revoke_with_htmx_returns_the_row_with_its_new_status(owner_client, make_token, tenant):
    make_token(tenant, name="old")
    token = ApiToken.objects.get(name="old")
    response = owner_client.post(f"/tokens/{token.pk}/revoke/", **HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    assert html.startswith(f'<tr id="token-{token.pk}" class="token-row status-revoked">')
    assert "Revoked" in html and "/revoke/" not in html
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert AuditEvent.objects.filter(action="token.revoke", target_id=str(token.pk)).count() == 1
    again = owner_client.post(f"/tokens/{token.pk}/revoke/")
    assert again.status_code == 302  # idempotent
    assert AuditEvent.objects.filter(action="token.revoke", target_id=str(token.pk)).count() == 1


def test_scope_checkboxes_follow_the_role(tenant, add_member, signed_in, owner_client):
    assert len(re.findall(r'name="scopes"', owner_client.get("/tokens/").content.decode())) == 4
    admin = add_member(tenant, Role.ADMIN)
    html = signed_in(admin.user, tenant).get("/tokens/").content.decode()
    assert set(re.findall(r'name="scopes" value="(\w+)"', html)) == {"read", "write", "billing", "admin"}


@pytest.mark.parametrize("role", [Role.MEMBER, Role.BILLING, Role.VIEWER])
def test_tokens_page_needs_the_admin_scope(role, tenant, add_member, signed_in, make_token):
    make_token(tenant, name="theirs")
    token = ApiToken.objects.get(name="theirs")
    client = signed_in(add_member(tenant, role).user, tenant)
    page = client.get("/tokens/")
    assert page.status_code == 403
    assert "admin scope" in page.content.decode()
    assert (
        client.post("/tokens/new/", {"name": "x", "scopes": ["read"], "expiry": "never"}).status_code == 403
    )
    assert client.post(f"/tokens/{token.pk}/revoke/", **HTMX).status_code == 403
    assert ApiToken.objects.count() == 1
    token.refresh_from_db()
    assert token.revoked_at is None


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "", "scopes": ["read"], "expiry": "never"}, "name"),
        ({"name": "   ", "scopes": ["read"], "expiry": "never"}, "name"),
        ({"name": "n" * 101, "scopes": ["read"], "expiry": "never"}, "name"),
        ({"name": "n" * 200_000, "scopes": ["read"], "expiry": "never"}, "name"),
        ({"name": "nul\x00byte", "scopes": ["read"], "expiry": "never"}, "name"),
        ({"name": "ok", "expiry": "never"}, "scopes"),
        ({"name": "ok", "scopes": ["root"], "expiry": "never"}, "scopes"),
        ({"name": "ok", "scopes": ["read"], "expiry": "forever"}, "expiry"),
        ({"name": "ok", "scopes": ["read"], "expiry": "date"}, "expires_on"),
        ({"name": "ok", "scopes": ["read"], "expiry": "date", "expires_on": "2001-01-01"}, "expires_on"),
        ({"name": "ok", "scopes": ["read"], "expiry": "date", "expires_on": "9999-12-31"}, "expires_on"),
        ({"name": "ok", "scopes": ["read"], "expiry": "date", "expires_on": "31/02/2030"}, "expires_on"),
    ],
)
def test_bad_input_is_400_with_the_field_and_writes_nothing(owner_client, data, field):
    events = AuditEvent.objects.count()
    for headers in ({}, HTMX):
        response = owner_client.post("/tokens/new/", data, **headers)
        assert response.status_code == 400, response.content[:500]
        html = response.content.decode()
        assert f'id="id_{field}_error"' in html
        assert not SECRET.search(html)
    assert not ApiToken.objects.exists()
    assert AuditEvent.objects.count() == events
