"""Tenants, members and invitations through the services and the management commands."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from portal.actors import Actor
from portal.demo import DEMO_LOGINS, demo_seed
from portal.errors import Conflict, NotFound, PermissionDenied, ValidationFailed
from portal.models import AuditEvent, Invitation, Membership, Role, Tenant, User
from portal.services.invitations import (
    invitation_accept,
    invitation_create,
    invitation_lookup,
    invitations_purge_expired,
)
from portal.services.members import membership_change_role, membership_remove
from portal.services.tenants import tenant_create, tenant_set_status

pytestmark = pytest.mark.django_db


def test_createtenant_makes_tenant_owner_and_audit(
    capsys, mailoutbox, django_capture_on_commit_callbacks, client
):
    with django_capture_on_commit_callbacks(execute=True):
        call_command("createtenant", "lab-one", "--name", "Lab One", "--owner-email", "Boss@Lab.test")
    tenant = Tenant.objects.get(slug="lab-one")
    membership = Membership.objects.get(tenant=tenant)
    assert membership.role == Role.OWNER and membership.user.email == "boss@lab.test"
    assert not membership.user.has_usable_password()  # they set one through password reset
    assert tenant.billing_email == "boss@lab.test" and tenant.currency == "USD"
    assert set(AuditEvent.objects.filter(tenant=tenant).values_list("action", flat=True)) == {
        "tenant.create",
        "member.add",
    }
    assert "Created tenant lab-one" in capsys.readouterr().out

    # The new owner gets a link to choose a password, and it works.
    (mail,) = mailoutbox
    assert mail.to == ["boss@lab.test"] and "Lab One" in mail.subject
    link = re.search(r"https?://[^/\s]+(/password-reset/\S+)", mail.body).group(1)
    form_page = client.get(link, follow=True)
    assert form_page.status_code == 200
    done = client.post(
        form_page.redirect_chain[-1][0],
        {"new_password1": "a-Strong-pass-42", "new_password2": "a-Strong-pass-42"},
    )
    assert done.status_code == 302
    assert client.login(email="boss@lab.test", password="a-Strong-pass-42")


def test_password_reset_reaches_owners_who_never_set_a_password(mailoutbox, client):
    tenant_create(slug="lab", name="Lab", owner_email="new@lab.test", actor=Actor.system())
    response = client.post("/password-reset/", {"email": "NEW@lab.test"})
    assert response.status_code == 302
    assert [m.to for m in mailoutbox] == [["new@lab.test"]]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["Bad Slug!", "--name", "x", "--owner-email", "a@b.test"], "slug"),
        (["ok", "--name", " ", "--owner-email", "a@b.test"], "name"),
        (["ok", "--name", "x", "--owner-email", "nope"], "owner_email"),
        (["ok", "--name", "x", "--owner-email", "a@b.test", "--currency", "dollars"], "currency"),
    ],
)
def test_createtenant_rejects_bad_input_and_writes_nothing(args, field):
    with pytest.raises(CommandError, match=field):
        call_command("createtenant", *args)
    assert not Tenant.objects.exists() and not User.objects.exists()


def test_duplicate_slug_is_refused(make_tenant):
    make_tenant("acme")
    with pytest.raises(ValidationFailed) as exc:
        make_tenant("acme", owner_email="other@x.test")
    assert "slug" in exc.value.fields


def test_a_user_can_belong_to_several_tenants(make_tenant):
    a = make_tenant("a", owner_email="same@x.test")
    b = make_tenant("b", owner_email="same@x.test")
    user = User.objects.get(email="same@x.test")
    assert set(user.memberships.values_list("tenant_id", flat=True)) == {a.pk, b.pk}


def test_invitation_round_trip(tenant, owner, django_capture_on_commit_callbacks, mailoutbox):
    with django_capture_on_commit_callbacks(execute=True):
        invitation, plaintext = invitation_create(
            tenant=tenant, email="new@acme.test", role=Role.VIEWER, actor=Actor(user=owner)
        )
    assert plaintext in mailoutbox[0].body and invitation.token_hash != plaintext
    newcomer = User.objects.create_user(email="new@acme.test", password="pw")
    membership = invitation_accept(token=plaintext, user=newcomer)
    assert membership.role == Role.VIEWER and membership.tenant == tenant
    with pytest.raises(NotFound):
        invitation_accept(token=plaintext, user=newcomer)  # one use


def test_invitation_for_someone_else_is_refused(tenant, owner):
    _, plaintext = invitation_create(
        tenant=tenant, email="a@acme.test", role="member", actor=Actor(user=owner)
    )
    intruder = User.objects.create_user(email="b@acme.test", password="pw")
    with pytest.raises(PermissionDenied):
        invitation_accept(token=plaintext, user=intruder)
    assert not Membership.objects.filter(user=intruder).exists()


def test_expired_invitations_cannot_be_used_and_are_purged(tenant, owner):
    invitation, plaintext = invitation_create(
        tenant=tenant, email="late@acme.test", role="member", actor=Actor(user=owner)
    )
    Invitation.objects.filter(pk=invitation.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    user = User.objects.create_user(email="late@acme.test", password="pw")
    with pytest.raises(NotFound):
        invitation_accept(token=plaintext, user=user)
    assert invitations_purge_expired() == 1


def test_reinviting_replaces_the_open_invitation(tenant, owner):
    _, first = invitation_create(tenant=tenant, email="x@acme.test", role="member", actor=Actor(user=owner))
    _, second = invitation_create(tenant=tenant, email="x@acme.test", role="admin", actor=Actor(user=owner))
    assert Invitation.objects.filter(tenant=tenant).count() == 1
    with pytest.raises(NotFound):
        invitation_lookup(token=first)
    assert invitation_lookup(token=second).role == Role.ADMIN


def test_only_owners_grant_ownership(tenant, owner):
    admin = User.objects.create_user(email="adm@acme.test", password="pw")
    Membership.objects.create(tenant=tenant, user=admin, role=Role.ADMIN)
    member = Membership.objects.create(
        tenant=tenant, user=User.objects.create_user(email="m@acme.test", password="pw"), role=Role.MEMBER
    )
    with pytest.raises(PermissionDenied):
        membership_change_role(membership=member, role=Role.OWNER, actor=Actor(user=admin))
    with pytest.raises(PermissionDenied):
        invitation_create(tenant=tenant, email="o@acme.test", role=Role.OWNER, actor=Actor(user=admin))
    membership_change_role(membership=member, role=Role.OWNER, actor=Actor(user=owner))
    assert Membership.objects.get(pk=member.pk).role == Role.OWNER


def test_last_owner_is_protected_but_a_second_owner_unlocks_it(tenant, owner):
    mine = Membership.objects.get(user=owner)
    with pytest.raises(Conflict):
        membership_remove(membership=mine, actor=Actor(user=owner))
    other = Membership.objects.create(
        tenant=tenant, user=User.objects.create_user(email="o2@acme.test", password="pw"), role=Role.OWNER
    )
    membership_change_role(membership=mine, role=Role.MEMBER, actor=Actor(user=owner))
    with pytest.raises(Conflict):
        membership_remove(membership=other, actor=Actor(user=other.user))
    event = AuditEvent.objects.filter(action="member.role_change").get()
    assert event.data == {"from": "owner", "to": "member"} and event.actor_user == owner


def test_suspension_needs_a_reason(tenant):
    with pytest.raises(ValidationFailed) as exc:
        tenant_set_status(tenant=tenant, status="suspended", reason=" ", actor=Actor.system())
    assert "reason" in exc.value.fields
    assert Tenant.objects.get(pk=tenant.pk).status == "active"


def test_seed_demo_is_idempotent(capsys, settings, tmp_path, django_capture_on_commit_callbacks):
    settings.FLEET_FILE = tmp_path / "fleet.json"  # the simulated fleet's file, written on commit
    with django_capture_on_commit_callbacks(execute=True):
        call_command("seed_demo")
    counts = (
        Tenant.objects.count(),
        User.objects.count(),
        Membership.objects.count(),
        AuditEvent.objects.count(),
    )
    with django_capture_on_commit_callbacks(execute=True):
        call_command("seed_demo")
    assert counts == (
        Tenant.objects.count(),
        User.objects.count(),
        Membership.objects.count(),
        AuditEvent.objects.count(),
    )
    out = capsys.readouterr().out
    for login in DEMO_LOGINS:
        assert login.email in out
    tenant = demo_seed()
    roles = dict(Membership.objects.filter(tenant=tenant).values_list("user__email", "role"))
    assert roles == {DEMO_LOGINS[0].email: Role.OWNER, DEMO_LOGINS[1].email: Role.MEMBER}
    assert User.objects.get(email=DEMO_LOGINS[2].email).is_staff
