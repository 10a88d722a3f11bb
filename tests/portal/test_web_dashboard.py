"""The dashboard frame, its panels and the navigation registry."""

from __future__ import annotations

import re

import pytest
from django.test import RequestFactory

from portal import dashboard
from portal.models import Role
from tests.portal.conftest import HTMX

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _registries_restored():
    """Tests here register and unregister entries, some named like other apps' (the fleet's nav
    entry); whatever they do, the registries are as the apps left them afterwards."""
    nav, panels = dict(dashboard._nav), dict(dashboard._panels)
    yield
    dashboard._nav.clear()
    dashboard._nav.update(nav)
    dashboard._panels.clear()
    dashboard._panels.update(panels)


def _panel_urls(html: str) -> list[str]:
    return re.findall(r'hx-get="([^"]+)" hx-trigger="load"', html)


def test_dashboard_renders_one_card_per_panel_for_an_owner(owner_client):
    html = owner_client.get("/").content.decode()
    urls = _panel_urls(html)
    assert urls == [p.url for p in dashboard.panels_for(_owner_membership(owner_client))]
    assert set(urls) >= {"/panels/getting-started/", "/panels/team/", "/panels/activity/"}


def _owner_membership(client):
    from portal.models import Membership

    return Membership.objects.get(user_id=client.session["_auth_user_id"])


@pytest.mark.parametrize("role", list(Role.values))
def test_every_panel_on_the_dashboard_answers_200_for_that_member(role, tenant, add_member, signed_in):
    member = add_member(tenant, role)
    client = signed_in(member.user, tenant)
    urls = _panel_urls(client.get("/").content.decode())
    assert "/panels/team/" in urls
    assert ("/panels/activity/" in urls) == (role in (Role.OWNER, Role.ADMIN))
    for url in urls:
        partial = client.get(url, **HTMX)
        assert partial.status_code == 200, url
        assert "<html" not in partial.content.decode()


def test_activity_panel_is_403_without_the_admin_scope(tenant, add_member, signed_in):
    member = add_member(tenant, Role.MEMBER)
    response = signed_in(member.user, tenant).get("/panels/activity/", **HTMX)
    assert response.status_code == 403
    assert "admin scope" in response.content.decode()


def test_panel_is_a_partial_for_htmx_and_a_page_otherwise(owner_client):
    partial = owner_client.get("/panels/team/", **HTMX)
    page = owner_client.get("/panels/team/")
    assert "<html" not in partial.content.decode()
    assert "<html" in page.content.decode() and 'class="sidebar"' in page.content.decode()
    assert "member" in partial.content.decode()
    assert "HX-Request" in partial["Vary"] and "HX-Request" in page["Vary"]


def test_activity_panel_lists_audit_events_of_this_tenant_only(owner_client, tenant, make_tenant):
    make_tenant("globex")
    owner_client.post("/tokens/new/", {"name": "deploy-bot", "scopes": ["read"], "expiry": "never"})
    html = owner_client.get("/panels/activity/", **HTMX).content.decode()
    assert "created the API token" in html and "deploy-bot" in html
    assert "Globex" not in html


def test_registered_panel_appears_on_the_dashboard(owner_client):
    dashboard.register_panel("extra", "Extra panel", "portal:panel-team", order=1)
    try:
        html = owner_client.get("/").content.decode()
        assert "Extra panel" in html
        assert _panel_urls(html)[0] == "/panels/team/"  # lowest order first
    finally:
        dashboard.unregister_panel("extra")
    assert "Extra panel" not in owner_client.get("/").content.decode()


def test_panel_with_a_scope_is_hidden_from_members_without_it(tenant, add_member, signed_in):
    dashboard.register_panel("money", "Money", "portal:panel-team", scope="billing")
    try:
        viewer = add_member(tenant, Role.VIEWER)
        billing = add_member(tenant, Role.BILLING)
        assert "Money" not in signed_in(viewer.user, tenant).get("/").content.decode()
        assert "Money" in signed_in(billing.user, tenant).get("/").content.decode()
    finally:
        dashboard.unregister_panel("money")


def test_registry_rejects_bad_entries():
    with pytest.raises(ValueError):
        dashboard.register_panel("x", "X", "portal:panel-team", scope="root")
    with pytest.raises(ValueError):
        dashboard.register_nav("bad name!", "X", "portal:team")
    with pytest.raises(ValueError):
        dashboard.register_nav("x", "X", "portal:team", icon="unicorn")


def test_navigation_follows_role_and_registry(tenant, add_member, signed_in, owner_client):
    owner_html = owner_client.get("/team/").content.decode()
    assert re.search(r'href="/team/" class="nav-link active" aria-current="page"', owner_html)
    assert 'href="/tokens/"' in owner_html
    assert 'href="/admin/"' not in owner_html
    viewer = add_member(tenant, Role.VIEWER)
    viewer_html = signed_in(viewer.user, tenant).get("/").content.decode()
    assert 'href="/team/"' in viewer_html and 'href="/tokens/"' not in viewer_html

    dashboard.register_nav("fleet", "Fleet", "portal:team", order=40, icon="server")
    try:
        html = owner_client.get("/").content.decode()
        labels = re.findall(r'<use href="#i-[a-z]+"></use></svg>([^<]+)</a></li>', html)
        # Other apps add entries of their own (launch, invoices, ...): only the order of these counts.
        ours = ["Dashboard", "Fleet", "Team", "API tokens"]
        assert [label for label in labels if label in ours] == ours
    finally:
        dashboard.unregister_nav("fleet")


def test_staff_see_the_admin_link(owner, tenant, signed_in):
    owner.is_staff = True
    owner.save()
    assert 'href="/admin/"' in signed_in(owner, tenant).get("/").content.decode()


def test_nav_skips_entries_whose_url_is_not_mounted(owner, tenant):
    dashboard.register_nav("ghost", "Ghost", "nowhere:page")
    try:
        request = RequestFactory().get("/")
        request.user = owner
        request.membership = owner.memberships.get(tenant=tenant)
        assert "ghost" not in [link.name for link in dashboard.nav_for(request)]
    finally:
        dashboard.unregister_nav("ghost")
