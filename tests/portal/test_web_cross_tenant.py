"""Objects of another tenant do not exist for the web pages: every id-taking URL answers 404."""

from __future__ import annotations

import pytest

from portal.actors import Actor
from portal.models import ApiToken, Invitation, Membership, Role
from portal.services import invitation_create
from tests.portal.conftest import HTMX

pytestmark = pytest.mark.django_db


@pytest.fixture
def foreign(make_tenant, make_token, add_member):
    """Tenant A's membership, token and open invitation."""
    a = make_tenant("alpha")
    member = add_member(a, Role.MEMBER)
    make_token(a, name="alpha-token")
    invitation, _ = invitation_create(
        tenant=a, email="guest@alpha.test", role=Role.VIEWER, actor=Actor.system()
    )
    return {"member": member, "token": ApiToken.objects.get(name="alpha-token"), "invitation": invitation}


@pytest.fixture
def b_owner_client(make_tenant, signed_in):
    b = make_tenant("bravo")
    return signed_in(Membership.objects.get(tenant=b, role=Role.OWNER).user, b)


@pytest.mark.parametrize("htmx", [False, True])
def test_member_of_b_gets_404_on_a_ids(foreign, b_owner_client, htmx):
    headers = HTMX if htmx else {}
    m, t, i = foreign["member"].pk, foreign["token"].pk, foreign["invitation"].pk
    attempts = {
        f"/team/members/{m}/role/": {"role": "viewer"},
        f"/team/members/{m}/remove/": {},
        f"/tokens/{t}/revoke/": {},
        f"/team/invitations/{i}/revoke/": {},
        f"/team/invitations/{i}/resend/": {},
    }
    for url, data in attempts.items():
        assert b_owner_client.post(url, data, **headers).status_code == 404, url
    foreign["member"].refresh_from_db()
    foreign["token"].refresh_from_db()
    assert foreign["member"].role == Role.MEMBER
    assert foreign["token"].revoked_at is None
    assert Invitation.objects.filter(pk=i).exists()


def test_pages_of_b_show_nothing_of_a(foreign, b_owner_client):
    team = b_owner_client.get("/team/").content.decode()
    tokens = b_owner_client.get("/tokens/").content.decode()
    assert foreign["member"].user.email not in team
    assert "guest@alpha.test" not in team
    assert "alpha-token" not in tokens
    for url in ("/panels/team/", "/panels/activity/", "/panels/getting-started/"):
        html = b_owner_client.get(url, **HTMX).content.decode()
        assert "alpha" not in html.lower(), url
