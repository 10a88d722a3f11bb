"""A token's authority follows its creator's current role: demotion, deactivation and removal
(through the services or the Django admin) take it away, and so do invitations a removed admin sent."""

from __future__ import annotations

import pytest
from django.test import Client

from portal.actors import Actor
from portal.errors import NotFound
from portal.models import ApiToken, AuditEvent, Invitation, Membership, Role, User
from portal.services.invitations import invitation_accept, invitation_create, invitation_lookup
from portal.services.members import membership_change_role, membership_remove
from portal.services.tokens import api_token_create

pytestmark = pytest.mark.django_db

JSON = "application/json"


@pytest.fixture
def admin(tenant, add_member) -> Membership:
    return add_member(tenant, Role.ADMIN, email="admin@acme.test")


def _token(tenant, membership, scopes=("read", "write", "admin")) -> str:
    _, plaintext = api_token_create(
        tenant=tenant, name=f"t{ApiToken.objects.count()}", scopes=scopes, actor=Actor(user=membership.user)
    )
    return plaintext


def _mint(client):
    return client.post("/api/v1/tokens/", {"name": "more", "scopes": ["read", "admin"]}, content_type=JSON)


def test_a_demoted_admins_token_can_no_longer_act_as_admin(tenant, owner, admin, api):
    plaintext = _token(tenant, admin)
    assert api(plaintext).get("/api/v1/members/?role=owner").status_code == 200  # control
    assert _mint(api(plaintext)).status_code == 201
    # Demoted behind the services' back (say, an old admin form): the token still follows the role.
    Membership.objects.filter(pk=admin.pk).update(role=Role.VIEWER)
    assert api(plaintext).get("/api/v1/tokens/").status_code == 403
    assert _mint(api(plaintext)).status_code == 403
    assert api(plaintext).get("/api/v1/me/").json()["scopes"] == ["read"]


def test_demotion_revokes_tokens_beyond_the_new_role_and_the_invitations_sent(tenant, owner, admin, api):
    big, small = _token(tenant, admin), _token(tenant, admin, scopes=("read",))
    _, invite = invitation_create(
        tenant=tenant, email="new@acme.test", role=Role.MEMBER, actor=Actor(user=admin.user)
    )
    membership_change_role(membership=admin, role=Role.MEMBER, actor=Actor(user=owner))
    assert api(big).get("/api/v1/members/").status_code == 401
    assert api(small).get("/api/v1/members/").status_code == 200
    assert ApiToken.objects.get(scopes=["read", "write", "admin"]).revoked_at is not None
    with pytest.raises(NotFound):
        invitation_lookup(token=invite)
    assert AuditEvent.objects.filter(action="token.revoke", actor_type="user").exists()


def test_a_deactivated_persons_token_gets_401(tenant, admin, api):
    plaintext = _token(tenant, admin)
    assert api(plaintext).get("/api/v1/me/").status_code == 200
    User.objects.filter(pk=admin.user_id).update(is_active=False)
    assert api(plaintext).get("/api/v1/me/").status_code == 401
    User.objects.filter(pk=admin.user_id).update(is_active=True)
    assert api(plaintext).get("/api/v1/me/").status_code == 200


def test_a_membership_deleted_in_the_admin_leaves_no_working_token(tenant, admin, api):
    plaintext = _token(tenant, admin)
    assert api(plaintext).get("/api/v1/me/").status_code == 200
    Membership.objects.filter(pk=admin.pk).delete()  # what the admin's delete did
    assert api(plaintext).get("/api/v1/me/").status_code == 401


def test_the_django_admin_cannot_change_memberships_or_tokens_behind_the_services(tenant, owner, admin):
    root = User.objects.create_superuser(email="root@gpupool.test", password="x")
    site = Client()
    site.force_login(root)
    token = ApiToken.objects.get(
        pk=ApiToken.objects.create(
            tenant=tenant, name="x", key_id="abc", token_hash="0" * 64, scopes=["read"], created_by=owner
        ).pk
    )
    assert site.get(f"/admin/portal/membership/{admin.pk}/change/").status_code == 200  # it may look
    site.post(
        f"/admin/portal/membership/{admin.pk}/change/",
        {"user": admin.user_id, "tenant": tenant.pk, "role": "owner"},
    )
    site.post(f"/admin/portal/membership/{admin.pk}/delete/", {"post": "yes"})
    site.post(
        f"/admin/portal/apitoken/{token.pk}/change/",
        {"name": "x", "tenant": tenant.pk, "scopes": '["read", "admin"]'},
    )
    site.post(
        "/admin/portal/invitation/add/",
        {
            "tenant": tenant.pk,
            "email": "x@y.test",
            "role": "owner",
            "expires_at_0": "2099-01-01",
            "expires_at_1": "00:00",
        },
    )
    admin.refresh_from_db()
    token.refresh_from_db()
    assert admin.role == Role.ADMIN and token.scopes == ["read"]
    assert not Invitation.objects.exists()
    # Removal goes through the service, audited, and takes the person's tokens with it.
    plaintext = _token(tenant, admin)
    site.post("/admin/portal/membership/", {"action": "remove_members", "_selected_action": [admin.pk]})
    assert not Membership.objects.filter(pk=admin.pk).exists()
    assert AuditEvent.objects.filter(action="member.remove", actor_user=root).exists()
    assert Client(HTTP_AUTHORIZATION=f"Bearer {plaintext}").get("/api/v1/me/").status_code == 401


def test_the_django_admins_revoke_actions_go_through_the_services_audited(tenant, owner, admin):
    root = User.objects.create_superuser(email="root@gpupool.test", password="x")
    site = Client()
    site.force_login(root)
    plaintext = _token(tenant, admin)
    token = ApiToken.objects.get(tenant=tenant, revoked_at__isnull=True, created_by=admin.user)
    kept = _token(tenant, Membership.objects.get(tenant=tenant, user=owner))
    _, invite = invitation_create(
        tenant=tenant, email="c@acme.test", role=Role.MEMBER, actor=Actor(user=owner)
    )
    invitation = Invitation.objects.get(email="c@acme.test")
    site.post("/admin/portal/apitoken/", {"action": "revoke", "_selected_action": [token.pk]})
    site.post(
        "/admin/portal/invitation/", {"action": "revoke_invitations", "_selected_action": [invitation.pk]}
    )
    assert Client(HTTP_AUTHORIZATION=f"Bearer {plaintext}").get("/api/v1/me/").status_code == 401
    assert Client(HTTP_AUTHORIZATION=f"Bearer {kept}").get("/api/v1/me/").status_code == 200  # control
    audited = set(AuditEvent.objects.filter(actor_user=root).values_list("action", "target_id"))
    assert ("token.revoke", str(token.pk)) in audited
    assert ("invitation.revoke", str(invitation.pk)) in audited
    with pytest.raises(NotFound):
        invitation_lookup(token=invite)


def test_an_invitation_sent_by_a_removed_admin_cannot_be_accepted(tenant, owner, admin):
    _, kept = invitation_create(tenant=tenant, email="a@acme.test", role=Role.MEMBER, actor=Actor(user=owner))
    _, plaintext = invitation_create(
        tenant=tenant, email="b@acme.test", role=Role.MEMBER, actor=Actor(user=admin.user)
    )
    Membership.objects.filter(pk=admin.pk).delete()  # removed outside the services
    newcomer = User.objects.create_user(email="b@acme.test", password="x")
    with pytest.raises(NotFound):
        invitation_accept(token=plaintext, user=newcomer)
    assert not Membership.objects.filter(user=newcomer).exists()
    # The owner's invitation is still good (control).
    other = User.objects.create_user(email="a@acme.test", password="x")
    assert invitation_accept(token=kept, user=other).role == Role.MEMBER


def test_removal_through_the_service_revokes_the_invitations_sent(tenant, owner, admin):
    _, plaintext = invitation_create(
        tenant=tenant, email="b@acme.test", role=Role.MEMBER, actor=Actor(user=admin.user)
    )
    membership_remove(membership=admin, actor=Actor(user=owner))
    assert not Invitation.objects.filter(accepted_at__isnull=True).exists()
    with pytest.raises(NotFound):
        invitation_lookup(token=plaintext)
