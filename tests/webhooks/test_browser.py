"""The webhooks pages in a real browser (Debian's Chromium) under the strict CSP: add an endpoint,
copy its secret, open it, redeliver a delivery (htmx swaps the row)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from portal.models import Membership, Role
from tests.browser import chromium_page
from tests.portal.conftest import PASSWORD
from tests.portal.test_browser_csp import REPORT, is_violation
from webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_add_an_endpoint_and_redeliver_in_the_browser(monkeypatch, live_server, make_tenant, settings):
    from playwright.sync_api import expect

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    settings.SCHEDULING_TRIGGER_CYCLES = False
    tenant = make_tenant("acme", name="Acme Research")
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
    with chromium_page(width=1360, height=900) as page:
        console: list[str] = []
        page.on("console", lambda message: console.append(message.text))
        page.add_init_script(REPORT)
        page.goto(f"{live_server.url}/login/")
        page.get_by_label("Email").fill(owner.email)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        expect(page).to_have_url(f"{live_server.url}/")

        page.get_by_role("link", name="Webhooks").click()
        expect(page).to_have_url(f"{live_server.url}/webhooks/")
        page.get_by_label("URL").fill("https://10.0.0.7/hook")
        page.get_by_label("workload.state").check()
        page.get_by_role("button", name="Add endpoint").click()
        expect(page.locator(".field-error").first).to_contain_text("private address")
        page.get_by_label("URL").fill("https://hooks.example.com/gpupool")
        page.get_by_label("workload.state").check()
        page.get_by_label("invoice.paid").check()
        page.get_by_role("button", name="Add endpoint").click()
        secret = page.locator("#webhook-secret-value").inner_text()
        assert secret.startswith("whsec_")
        endpoint = WebhookEndpoint.objects.get()
        assert endpoint.event_types == ["invoice.paid", "workload.state"]

        event = WebhookEvent.objects.create(tenant=tenant, type="invoice.paid", payload={"invoice_id": 1})
        delivery = WebhookDelivery.objects.create(
            tenant=tenant,
            endpoint=endpoint,
            event=event,
            state="failed",
            retry_until=timezone.now(),
            attempts=1,
        )
        WebhookAttempt.objects.create(
            tenant=tenant, delivery=delivery, number=1, status=500, error="HTTP 500"
        )
        page.get_by_role("link", name="https://hooks.example.com/gpupool").first.click()
        row = page.locator(f"#delivery-{delivery.pk}")
        expect(row).to_contain_text("HTTP 500")
        expect(row).to_have_attribute("data-state", "failed")
        row.get_by_role("button", name="Redeliver").click()
        expect(page.locator(f"#delivery-{delivery.pk}")).to_contain_text("queued again")
        expect(page.locator(f"#delivery-{delivery.pk}")).to_have_attribute("data-state", "pending")
        assert page.url == f"{live_server.url}/webhooks/{endpoint.pk}/"  # swapped in place
        delivery.refresh_from_db()
        assert delivery.manual is True
        page.wait_for_load_state("networkidle")
        assert [text for text in console if is_violation(text)] == []
