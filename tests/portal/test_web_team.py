"""The team page: invitations by email, accepting them, roles, removal, and who may do what."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from portal.middleware import SESSION_TENANT_KEY
from portal.models import AuditEvent, Invitation, Membership, Role, User
from tests.portal.conftest import HTMX, PASSWORD

pytestmark = pytest.mark.django_db


@pytest.fixture
def invite(owner_client, django_capture_on_commit_callbacks, mailoutbox):
    """``invite(email, role)``: invite through the team page; returns the link path from the email."""

    def send(email: str, role: str = Role.MEMBER) -> str:
        with django_capture_on_commit_callbacks(execute=True):
            response = owner_client.post("/team/invitations/", {"email": email, "role": role}, **HTMX)
        assert response.status_code == 200, response.content
        return re.search(r"http://[^/\s]+(/invitations/[^/\s]+/)", mailoutbox[-1].body).group(1)

    return send


def test_team_page_lists_members_with_forms_for_an_owner(owner_client, tenant, add_member):
    member = add_member(tenant, Role.MEMBER)
    html = owner_client.get("/team/").content.decode()
    assert member.user.email in html
    assert f'action="/team/members/{member.pk}/role/"' in html
    assert 'action="/team/invitations/"' in html
    assert "No open invitations" in html


def test_invite_sends_an_email_with_a_working_link(owner_client, invite, mailoutbox, tenant):
    path = invite("new.person@example.com", Role.BILLING)
    assert mailoutbox[-1].to == ["new.person@example.com"]
    assert "Acme" in mailoutbox[-1].subject
    page = Client().get(path)
    assert page.status_code == 200
    html = page.content.decode()
    assert "Join Acme" in html and "new.person@example.com" in html and "Billing" in html
    listed = owner_client.get("/team/").content.decode()
    assert "new.person@example.com" in listed and "No open invitations" not in listed


def test_invite_response_is_the_form_plus_the_invitation_list_out_of_band(owner_client, invite):
    with_oob = owner_client.post("/team/invitations/", {"email": "x@example.com", "role": "viewer"}, **HTMX)
    html = with_oob.content.decode()
    assert html.lstrip().startswith('<section class="card" id="invite-card"')
    assert 'id="invitations" aria-labelledby="invitations-title" hx-swap-oob="true"' in html
    assert "Invitation sent to x@example.com" in html


def test_accepting_as_a_new_person_creates_account_and_membership(invite, tenant):
    path = invite("newbie@example.com", Role.MEMBER)
    browser = Client()
    response = browser.post(
        path,
        {
            "full_name": "New Bie",
            "password": "a-long-passphrase-9",
            "password_confirm": "a-long-passphrase-9",
        },
    )
    assert response.status_code == 302 and response["Location"] == "/"
    user = User.objects.get(email="newbie@example.com")
    assert user.full_name == "New Bie" and user.check_password("a-long-passphrase-9")
    assert Membership.objects.get(user=user, tenant=tenant).role == Role.MEMBER
    assert browser.session[SESSION_TENANT_KEY] == tenant.pk
    assert "Welcome to Acme" in browser.get("/").content.decode()
    assert Invitation.objects.get(email="newbie@example.com").accepted_by == user
    assert browser.get(path).status_code == 404  # used once


def test_signup_with_a_weak_or_mismatched_password_writes_nothing(invite):
    path = invite("weak@example.com")
    browser = Client()
    weak = browser.post(path, {"full_name": "W", "password": "123", "password_confirm": "123"})
    assert weak.status_code == 400
    assert 'id="id_password_error"' in weak.content.decode()
    mismatch = browser.post(
        path, {"full_name": "W", "password": "long-enough-pass-1", "password_confirm": "other-1"}
    )
    assert mismatch.status_code == 400
    assert 'id="id_password_confirm_error"' in mismatch.content.decode()
    blank = browser.post(path, {})
    assert blank.status_code == 400
    assert not User.objects.filter(email="weak@example.com").exists()
    assert Invitation.objects.get(email="weak@example.com").accepted_at is None


def test_signed_in_person_with_the_invited_address_accepts(invite, make_tenant, signed_in):
    other = make_tenant("globex")  # owner@globex.test exists and has a password
    path = invite("owner@globex.test", Role.ADMIN)
    person = User.objects.get(email="owner@globex.test")
    anonymous = Client().get(path).content.decode()
    assert "Sign in to accept" in anonymous and "/login/?next=/invitations/" in anonymous
    client = signed_in(person, other)
    assert client.get(path).status_code == 200
    response = client.post(path)
    assert response.status_code == 302
    membership = Membership.objects.get(user=person, tenant__slug="acme")
    assert membership.role == Role.ADMIN
    assert client.session[SESSION_TENANT_KEY] == membership.tenant_id


def test_existing_account_cannot_be_taken_over_through_the_signup_form(invite, make_tenant):
    make_tenant("globex")
    path = invite("owner@globex.test")
    response = Client().post(
        path, {"full_name": "Mallory", "password": "takeover-pass-1", "password_confirm": "takeover-pass-1"}
    )
    assert response.status_code == 409
    assert User.objects.get(email="owner@globex.test").check_password(PASSWORD)
    assert not Membership.objects.filter(user__email="owner@globex.test", tenant__slug="acme").exists()


def test_signed_in_as_someone_else_gets_403(invite, tenant, add_member, signed_in):
    path = invite("someone@example.com")
    stranger = add_member(tenant, Role.VIEWER)
    client = signed_in(stranger.user, tenant)
    assert client.get(path).status_code == 403
    response = client.post(path)
    assert response.status_code == 403
    assert "someone@example.com" in response.content.decode()
    assert Invitation.objects.get(email="someone@example.com").accepted_at is None


def test_unknown_invitation_token_is_404(client):
    assert client.get("/invitations/not-a-real-token/").status_code == 404
    assert client.post("/invitations/not-a-real-token/", {"password": "x"}).status_code == 404


def test_change_role_with_htmx_returns_the_member_section(owner_client, tenant, add_member):
    member = add_member(tenant, Role.MEMBER)
    response = owner_client.post(f"/team/members/{member.pk}/role/", {"role": "admin"}, **HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    assert html.lstrip().startswith('<section class="card" id="members"')
    assert "is now Admin" in html
    member.refresh_from_db()
    assert member.role == Role.ADMIN
    assert AuditEvent.objects.filter(action="member.role_change", target_id=str(member.pk)).exists()


def test_change_role_without_htmx_redirects_back(owner_client, tenant, add_member):
    member = add_member(tenant, Role.MEMBER)
    response = owner_client.post(f"/team/members/{member.pk}/role/", {"role": "viewer"})
    assert response.status_code == 302 and response["Location"] == "/team/"


def test_last_owner_cannot_be_demoted_or_removed(owner_client, owner, tenant):
    mine = Membership.objects.get(user=owner, tenant=tenant)
    events = AuditEvent.objects.count()
    demote = owner_client.post(f"/team/members/{mine.pk}/role/", {"role": "member"}, **HTMX)
    assert demote.status_code == 409
    assert "at least one owner" in demote.content.decode()
    remove = owner_client.post(f"/team/members/{mine.pk}/remove/", **HTMX)
    assert remove.status_code == 409
    assert "last owner cannot be removed" in remove.content.decode()
    full_page = owner_client.post(f"/team/members/{mine.pk}/remove/")
    assert full_page.status_code == 409 and "<html" in full_page.content.decode()
    mine.refresh_from_db()
    assert mine.role == Role.OWNER
    assert AuditEvent.objects.count() == events


def test_remove_member(owner_client, tenant, add_member, make_token):
    member = add_member(tenant, Role.MEMBER)
    response = owner_client.post(f"/team/members/{member.pk}/remove/", **HTMX)
    assert response.status_code == 200
    assert member.user.email not in response.content.decode().split("hx-swap-oob")[0]
    assert not Membership.objects.filter(pk=member.pk).exists()


def test_admin_cannot_make_an_owner(tenant, add_member, signed_in):
    admin = add_member(tenant, Role.ADMIN)
    member = add_member(tenant, Role.MEMBER)
    client = signed_in(admin.user, tenant)
    assert 'value="owner"' not in client.get("/team/").content.decode().split('id="invite-card"')[1]
    response = client.post(f"/team/members/{member.pk}/role/", {"role": "owner"}, **HTMX)
    assert response.status_code == 403
    assert "Only an owner" in response.content.decode()
    member.refresh_from_db()
    assert member.role == Role.MEMBER
    invite = client.post("/team/invitations/", {"email": "boss@example.com", "role": "owner"})
    assert invite.status_code == 400  # not a choice an admin has
    assert not Invitation.objects.filter(email="boss@example.com").exists()


@pytest.mark.parametrize("role", [Role.MEMBER, Role.VIEWER, Role.BILLING])
def test_non_admins_see_the_team_but_cannot_change_it(role, tenant, owner, add_member, signed_in):
    me = add_member(tenant, role)
    other = add_member(tenant, Role.VIEWER)
    owner_membership = Membership.objects.get(user=owner, tenant=tenant)
    client = signed_in(me.user, tenant)
    page = client.get("/team/")
    assert page.status_code == 200
    html = page.content.decode()
    assert owner.email in html and "/role/" not in html and 'action="/team/invitations/"' not in html
    attempts = [
        client.post(f"/team/members/{other.pk}/role/", {"role": "admin"}, **HTMX),
        client.post(f"/team/members/{owner_membership.pk}/remove/"),
        client.post("/team/invitations/", {"email": "x@example.com", "role": "member"}),
    ]
    assert [r.status_code for r in attempts] == [403, 403, 403]
    assert "admin scope" in attempts[1].content.decode()
    assert attempts[0]["X-Gpupool-Message"]
    other.refresh_from_db()
    assert other.role == Role.VIEWER
    assert Membership.objects.filter(pk=owner_membership.pk).exists()
    assert not Invitation.objects.exists()


def test_revoke_and_resend_invitation(owner_client, invite, mailoutbox):
    invite("pending@example.com")
    invitation = Invitation.objects.get(email="pending@example.com")
    resent = owner_client.post(f"/team/invitations/{invitation.pk}/resend/", **HTMX)
    assert resent.status_code == 200
    assert "new invitation link was sent" in resent.content.decode()
    fresh = Invitation.objects.get(email="pending@example.com")
    assert fresh.pk != invitation.pk  # the old link is dead
    revoked = owner_client.post(f"/team/invitations/{fresh.pk}/revoke/", **HTMX)
    assert revoked.status_code == 200
    assert "No open invitations" in revoked.content.decode()
    assert not Invitation.objects.filter(email="pending@example.com").exists()


def test_inviting_a_member_again_is_a_409_on_the_email_field(owner_client, owner):
    response = owner_client.post("/team/invitations/", {"email": owner.email, "role": "member"}, **HTMX)
    assert response.status_code == 409
    html = response.content.decode()
    assert 'id="id_email_error"' in html and "Already a member" in html
    assert not Invitation.objects.exists()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"email": "", "role": "member"}, "email"),
        ({"email": "not-an-email", "role": "member"}, "email"),
        ({"email": "a@b.test", "role": "emperor"}, "role"),
        ({"email": "a@b.test", "role": ""}, "role"),
        ({"email": "x" * 5000 + "@example.com", "role": "member"}, "email"),
        ({"email": "a@b.test", "role": "r" * 100_000}, "role"),
        ({"email": "nul\x00@b.test", "role": "member"}, "email"),
    ],
)
def test_invite_bad_input_is_400_with_the_field_and_writes_nothing(owner_client, data, field, mailoutbox):
    events = AuditEvent.objects.count()
    response = owner_client.post("/team/invitations/", data, **HTMX)
    assert response.status_code == 400
    assert f'id="id_{field}_error"' in response.content.decode()
    assert not Invitation.objects.exists()
    assert AuditEvent.objects.count() == events
    assert mailoutbox == []


@pytest.mark.parametrize("role", ["", "emperor", "x" * 10_000])
def test_change_role_bad_input_is_400(owner_client, tenant, add_member, role):
    member = add_member(tenant, Role.MEMBER)
    response = owner_client.post(f"/team/members/{member.pk}/role/", {"role": role}, **HTMX)
    assert response.status_code == 400
    assert f'id="member-{member.pk}-error"' in response.content.decode()
    member.refresh_from_db()
    assert member.role == Role.MEMBER


def test_leaving_the_team_sends_htmx_to_the_dashboard(tenant, add_member, signed_in):
    admin = add_member(tenant, Role.ADMIN)
    client = signed_in(admin.user, tenant)
    response = client.post(f"/team/members/{admin.pk}/remove/", **HTMX)
    assert response.status_code == 204 and response["HX-Redirect"] == "/"
    assert not Membership.objects.filter(pk=admin.pk).exists()
    assert "not in a team yet" in client.get("/").content.decode()


def test_demoting_yourself_out_of_admin_reloads_the_team_page(tenant, add_member, signed_in):
    admin = add_member(tenant, Role.ADMIN)
    client = signed_in(admin.user, tenant)
    response = client.post(f"/team/members/{admin.pk}/role/", {"role": "viewer"}, **HTMX)
    assert response.status_code == 204 and response["HX-Redirect"] == "/team/"
    page = client.get("/team/").content.decode()
    assert "/role/" not in page and "is now Viewer" in page


def test_signup_with_a_nul_byte_in_the_name_is_400(invite):
    path = invite("nul@example.com")
    response = Client().post(
        path,
        {"full_name": "a\x00b", "password": "long-enough-pass-1", "password_confirm": "long-enough-pass-1"},
    )
    assert response.status_code == 400
    assert 'id="id_full_name_error"' in response.content.decode()
    assert not User.objects.filter(email="nul@example.com").exists()


def test_invitation_email_states_the_expiry_in_utc_whatever_zone_is_active(
    owner, tenant, django_capture_on_commit_callbacks, mailoutbox
):
    """In a request the email goes out on commit while the inviter's zone is active."""
    from zoneinfo import ZoneInfo

    from django.utils import timezone

    from portal.actors import Actor
    from portal.services.invitations import invitation_create

    with timezone.override(ZoneInfo("Asia/Tokyo")), django_capture_on_commit_callbacks(execute=True):
        invitation, _ = invitation_create(
            tenant=tenant, email="tz@example.com", role="member", actor=Actor(user=owner)
        )
    assert f"expires on {invitation.expires_at:%Y-%m-%d %H:%M} UTC" in mailoutbox[-1].body
