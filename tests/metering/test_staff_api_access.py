"""Who opens the staff API (``/api/staff/v1/``): a staff session or a staff token, never a tenant's."""

from __future__ import annotations

import hashlib
import re
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from portal.actors import Actor
from portal.errors import PermissionDenied, ValidationFailed
from portal.models import AuditEvent, Membership, Role, StaffScope, StaffToken, Tenant, User
from portal.services.tenants import tenant_set_status
from portal.services.tokens import api_token_create
from portal.staff_tokens import staff_token_create, staff_token_revoke

pytestmark = pytest.mark.django_db

FINANCE = [
    "/api/staff/v1/finance/revenue/",
    "/api/staff/v1/finance/gpu-hours/",
    "/api/staff/v1/finance/receivables/",
]


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def staff(db) -> User:
    return User.objects.create_user(email="ops@gpupool.test", password="pw-for-tests-1", is_staff=True)


def test_a_tenant_token_made_by_staff_never_opens_the_staff_api(staff, make_tenant, api):
    # Positive control: the same person's session reads the reports.
    session = signed_in(staff)
    assert all(session.get(url).status_code == 200 for url in FINANCE)
    side = make_tenant("side")
    Membership.objects.create(tenant=side, user=staff, role=Role.OWNER)
    _, plaintext = api_token_create(tenant=side, name="ro", scopes=["read"], actor=Actor(user=staff))
    for url in FINANCE:
        response = api(plaintext).get(url)
        assert response.status_code == 403, (url, response.content)
        assert "tenant token" in response.json()["error"]["message"]
    # The staff pages take a session only: the bearer token is no sign-in there.
    for page in ("/staff/finance/", "/staff/finance/receivables/"):
        assert session.get(page).status_code == 200
        assert api(plaintext).get(page).status_code == 302
    tenant_set_status(tenant=side, status=Tenant.Status.SUSPENDED, reason="unpaid", actor=Actor.system())
    assert all(api(plaintext).get(url).status_code == 403 for url in FINANCE)


def test_a_staff_token_opens_the_staff_api_and_only_it(staff, make_tenant, make_token, api):
    token, plaintext = staff_token_create(
        user=staff, name="finance", scopes=[StaffScope.FINANCE_READ], actor=Actor(user=staff)
    )
    assert plaintext.startswith(f"gps_{token.key_id}_")
    assert StaffToken.objects.get(pk=token.pk).token_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert all(api(plaintext).get(url).status_code == 200 for url in FINANCE)
    # The tenant API never accepts it, and a tenant's own token still works there (control).
    tenant = make_tenant("acme")
    assert api(make_token(tenant)).get("/api/v1/me/").status_code == 200
    refused = api(plaintext).get("/api/v1/me/")
    assert refused.status_code == 401 and "staff API" in refused.json()["error"]["message"]
    assert api(plaintext).get("/api/v1/instances/").status_code == 401
    assert AuditEvent.objects.filter(action="staff_token.create", target_id=str(token.pk)).exists()


def test_a_staff_token_follows_its_person_and_its_state(staff, api):
    _, plaintext = staff_token_create(
        user=staff, name="finance", scopes=[StaffScope.FINANCE_READ], actor=Actor(user=staff)
    )
    url = FINANCE[0]
    assert api(plaintext).get(url).status_code == 200
    User.objects.filter(pk=staff.pk).update(is_staff=False)
    assert api(plaintext).get(url).status_code == 401
    User.objects.filter(pk=staff.pk).update(is_staff=True, is_active=False)
    assert api(plaintext).get(url).status_code == 401
    User.objects.filter(pk=staff.pk).update(is_active=True)
    assert api(plaintext).get(url).status_code == 200
    token = StaffToken.objects.get()
    staff_token_revoke(token=token, actor=Actor(user=staff))
    assert api(plaintext).get(url).status_code == 401
    assert AuditEvent.objects.filter(action="staff_token.revoke", target_id=str(token.pk)).exists()
    _, expired = staff_token_create(
        user=staff, name="old", scopes=[StaffScope.FINANCE_READ], actor=Actor(user=staff)
    )
    StaffToken.objects.filter(name="old").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert api(expired).get(url).status_code == 401


def test_a_staff_token_needs_the_routes_scope(staff, api, monkeypatch):
    _, plaintext = staff_token_create(
        user=staff, name="finance", scopes=[StaffScope.FINANCE_READ], actor=Actor(user=staff)
    )
    StaffToken.objects.update(scopes=[])  # a token of an older scope set, say
    response = api(plaintext).get(FINANCE[0])
    assert response.status_code == 403 and "finance:read" in response.json()["error"]["message"]


def test_only_staff_make_staff_tokens_and_only_their_own(staff, make_tenant):
    tenant = make_tenant("acme")
    owner = Membership.objects.get(tenant=tenant).user
    with pytest.raises(PermissionDenied):
        staff_token_create(user=owner, name="x", scopes=["finance:read"], actor=Actor(user=owner))
    other = User.objects.create_user(email="ops2@gpupool.test", password="x", is_staff=True)
    with pytest.raises(PermissionDenied):
        staff_token_create(user=other, name="x", scopes=["finance:read"], actor=Actor(user=staff))
    with pytest.raises(ValidationFailed) as exc:
        staff_token_create(user=staff, name="x", scopes=["read"], actor=Actor(user=staff))
    assert "scopes" in exc.value.fields
    assert not StaffToken.objects.exists()


def test_createstafftoken_prints_the_token_once(staff, capsys, api):
    call_command("createstafftoken", staff.email, "--name", "cli", "--scope", "finance:read")
    plaintext = capsys.readouterr().out.strip()
    assert plaintext.startswith("gps_")
    assert api(plaintext).get(FINANCE[2]).status_code == 200
    User.objects.create_user(email="dev@acme.test", password="x")
    with pytest.raises(CommandError, match="not active gpupool staff"):
        call_command("createstafftoken", "dev@acme.test", "--name", "x", "--scope", "finance:read")


def test_staff_make_their_token_in_the_admin_and_see_it_once(staff, api):
    page = signed_in(staff)  # staff, with no admin permissions granted
    assert page.get("/admin/portal/stafftoken/add/").status_code == 200
    created = page.post(
        "/admin/portal/stafftoken/add/", {"name": "ci", "scopes": ["finance:read"], "expires_at": ""}
    )
    assert created.status_code == 200 and "no-store" in created["Cache-Control"]
    plaintext = re.search(r"gps_[0-9a-f]{12}_[A-Za-z0-9_-]+", created.content.decode()).group(0)
    assert api(plaintext).get(FINANCE[0]).status_code == 200
    listing = page.get("/admin/portal/stafftoken/").content.decode()
    assert "ci" in listing and plaintext not in listing
    assert StaffToken.objects.get().user == staff
    # Another staff person's tokens are not theirs to see.
    other = signed_in(User.objects.create_user(email="ops2@gpupool.test", password="x", is_staff=True))
    key_id = StaffToken.objects.get().key_id
    assert key_id in listing and key_id not in other.get("/admin/portal/stafftoken/").content.decode()
