"""The Content-Security-Policy in a real browser (Debian's Chromium, headless, driven by Playwright):
the main pages, the Django admin and the API docs load and run with no violation of the policy.

A violation shows twice, and both are caught: Chromium logs it to the console, and the page fires a
``securitypolicyviolation`` event, which an init script logs too. A positive control makes one.
"""

from __future__ import annotations

import pytest

from portal.actors import Actor
from portal.models import Membership, Role
from scheduling.services.submission import workload_submit
from tests.browser import chromium_page
from tests.portal.conftest import PASSWORD, eight_h100_node

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

REPORT = """document.addEventListener('securitypolicyviolation', e =>
  console.error('securitypolicyviolation: ' + e.violatedDirective + ' ' + (e.blockedURI || 'inline')
                + ' at ' + e.sourceFile + ':' + e.lineNumber));"""


def is_violation(text: str) -> bool:
    return "securitypolicyviolation" in text or "Content Security Policy" in text


@pytest.fixture
def workload(settings, make_tenant):
    """A tenant whose owner is also staff (the admin), with a small fleet and one instance."""
    settings.SCHEDULING_TRIGGER_CYCLES = False
    h100 = eight_h100_node()
    tenant = make_tenant("acme", name="Acme Research")
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
    owner.is_staff = owner.is_superuser = True
    owner.save(update_fields=["is_staff", "is_superuser"])
    spec = {"image": "ghcr.io/acme/notebook:1", "gpu_models": [h100.name], "name": "notebook"}
    return workload_submit(tenant=tenant, kind="instance", spec=spec, actor=Actor.system())


def test_the_main_pages_run_under_the_policy(monkeypatch, live_server, workload):
    from playwright.sync_api import expect

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    owner = Membership.objects.get(tenant=workload.tenant, role=Role.OWNER).user
    with chromium_page(width=1360, height=900) as page:
        console: list[str] = []
        page.on("console", lambda message: console.append(message.text))
        page.add_init_script(REPORT)

        def violations() -> list[str]:
            found = [text for text in console if is_violation(text)]
            console.clear()
            return found

        page.goto(f"{live_server.url}/login/")
        page.get_by_label("Email").fill(owner.email)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        expect(page).to_have_url(f"{live_server.url}/")
        assert violations() == [], "/login/"

        # The dashboard's panels load through htmx; their bars get their width from script.
        expect(page.locator(".panel-body[aria-busy]")).to_have_count(0)
        bar = page.locator("#panel-getting-started [data-bar]")
        expect(bar).to_have_attribute("style", f"width: {bar.get_attribute('data-bar')}%;")
        assert violations() == [], "/"

        for path in (
            "/workloads/",
            f"/workloads/{workload.pk}/",
            "/launch/",
            "/fleet/",
            "/billing/invoices/",
            "/billing/usage/",
            "/billing/reservations/",
            "/billing/budget/",
            "/team/",
            "/tokens/",
            "/account/",
            "/admin/",
            "/admin/portal/tenant/",
            f"/admin/portal/tenant/{workload.tenant_id}/change/",
            "/admin/password_change/",
        ):
            response = page.goto(f"{live_server.url}{path}")
            assert response.status == 200, path
            assert "frame-ancestors 'none'" in response.headers["content-security-policy"], path
            page.wait_for_load_state("networkidle")
            assert violations() == [], path

        page.goto(f"{live_server.url}/api/docs/")
        expect(page.locator("#swagger-ui .info")).to_contain_text("gpupool API")
        expect(page.locator("#swagger-ui .opblock").first).to_be_visible()
        page.wait_for_load_state("networkidle")
        assert violations() == [], "/api/docs/"

        # Positive control: markup with an inline style and an inline script is refused and seen.
        page.goto(f"{live_server.url}/")
        page.evaluate(
            """() => { const box = document.createElement('div');
                       box.innerHTML = '<img src="/static/img/favicon.svg" style="width:1px">';
                       document.body.appendChild(box);
                       const s = document.createElement('script'); s.textContent = 'window.__ran = 1';
                       document.body.appendChild(s); }"""
        )
        page.wait_for_timeout(300)
        found = violations()
        assert any("style-src" in text for text in found), found
        assert any("script-src" in text for text in found), found
        assert page.evaluate("window.__ran") is None
