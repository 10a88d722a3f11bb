"""The web shell in a real browser: Debian's Chromium, headless, driven by Playwright.

Needs /usr/bin/chromium (``scripts/install-system-deps`` installs it; ``make test`` runs that).
Screenshots of the dashboard and the tokens page land in ``var/screenshots/``.
"""

from __future__ import annotations

import re

import pytest
from django.core import mail

from portal.models import ApiToken, Invitation, Membership, Role, hash_secret
from tests.browser import SCREENSHOTS, chromium_page
from tests.portal.conftest import PASSWORD

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def page(monkeypatch):
    # Playwright's sync API runs an event loop in this thread; the ORM calls the test makes
    # between browser steps are still plain synchronous code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with chromium_page(width=1360, height=900) as page:
        yield page


def test_owner_creates_and_revokes_a_token_and_invites_someone(page, live_server, make_tenant):
    from playwright.sync_api import expect

    tenant = make_tenant("acme", name="Acme Research")
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    # sign in (a wrong password first: the error shows next to the form)
    page.goto(f"{live_server.url}/login/")
    page.get_by_label("Email").fill(owner.email)
    page.get_by_label("Password").fill("wrong-password")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("do not match")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(f"{live_server.url}/")

    # the dashboard's panels load through htmx
    expect(page.locator(".panel-body[aria-busy]")).to_have_count(0)
    expect(page.locator("#panel-team")).to_contain_text("member")
    expect(page.locator("#panel-getting-started")).to_contain_text("Create an API token")
    page.screenshot(path=str(SCREENSHOTS / "dashboard.png"), full_page=True)

    # create a token: the secret appears once, in place, without leaving the page
    page.get_by_role("link", name="API tokens").click()
    expect(page.get_by_role("heading", name="API tokens")).to_be_visible()
    page.evaluate("window.__noReload = true")
    page.get_by_label("Name").fill("CI pipeline")
    page.get_by_label("Write").check()
    page.get_by_role("button", name="Create token").click()
    secret_box = page.locator("#token-secret")
    expect(secret_box).to_be_visible()
    secret = secret_box.input_value()
    assert re.fullmatch(r"gpp_[0-9a-f]{12}_[A-Za-z0-9_-]{20,}", secret)
    token = ApiToken.objects.get(name="CI pipeline")
    assert token.token_hash == hash_secret(secret)
    assert token.scopes == ["read", "write"]
    assert page.evaluate("window.__noReload") is True
    expect(page.locator(f"#token-{token.pk} [data-status]")).to_have_text("Active")
    page.screenshot(path=str(SCREENSHOTS / "tokens.png"), full_page=True)

    # revoke it: confirm, and the row's status changes without a full reload
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator(f"#token-{token.pk}").get_by_role("button", name="Revoke").click()
    expect(page.locator(f"#token-{token.pk} [data-status]")).to_have_text("Revoked")
    assert page.evaluate("window.__noReload") is True
    token.refresh_from_db()
    assert token.revoked_at is not None

    # the secret is gone after a reload
    page.reload()
    expect(page.locator("#tokens")).to_contain_text("CI pipeline")
    assert secret not in page.content()

    # invite someone: a bad address is refused inline, a good one is listed and emailed
    page.get_by_role("link", name="Team").click()
    invite = page.locator("#invite-card")
    invite.get_by_label("Email").fill("not-an-email")
    invite.get_by_role("button", name="Send invitation").click()
    expect(page.locator("#id_email_error")).to_be_visible()
    expect(page.locator("#id_email")).to_have_attribute("aria-invalid", "true")
    page.locator("#invite-card").get_by_label("Email").fill("grace@example.com")
    page.locator("#invite-card").get_by_label("Role").select_option("admin")
    page.locator("#invite-card").get_by_role("button", name="Send invitation").click()
    expect(page.locator("#invitations")).to_contain_text("grace@example.com")
    expect(page.locator("#messages")).to_contain_text("Invitation sent to grace@example.com")
    assert Invitation.objects.get(tenant=tenant, email="grace@example.com").role == Role.ADMIN
    assert any("grace@example.com" in m.to for m in mail.outbox)
