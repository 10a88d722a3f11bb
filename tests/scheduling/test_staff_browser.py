"""The quota and queue pages in a real browser (Debian's Chromium driven by Playwright): staff filter
the tenants, change one tenant's quota in its form and see the warning and the audit trail, bulk
change two tenants, and open the queue. Screenshots land in ``var/screenshots/staff-*.png``."""

from __future__ import annotations

import pytest

from portal.models import AuditEvent, User
from scheduling.models import Quota
from tests.browser import SCREENSHOTS, chromium_page
from tests.scheduling.conftest import H100

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

EMAIL, PASSWORD = "ops@gpupool.test", "staff-browser-pw-1"


@pytest.fixture
def data(make_tenant, make_node, submit, cycle):
    make_node(H100, gpus=8)
    acme, bravo = make_tenant("acme"), make_tenant("bravo")
    make_tenant("charlie")
    submit(acme, gpu_count=8)
    cycle()
    submit(acme, gpu_count=4)
    submit(bravo, gpu_count=2)
    cycle()
    User.objects.create_user(email=EMAIL, password=PASSWORD, is_staff=True)
    return {"acme": acme, "bravo": bravo}


def test_staff_manage_quotas_and_watch_the_queue(live_server, data):
    from playwright.sync_api import expect

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with chromium_page(width=1400, height=1000) as page:
        page.goto(f"{live_server.url}/login/")
        page.get_by_label("Email").fill(EMAIL)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        page.get_by_role("link", name="Quotas").click()
        acme_row = page.locator(f"#quota-{data['acme'].pk}")
        expect(acme_row.locator('[data-quota="max_gpus_total"] [data-use]')).to_have_text("12")
        page.screenshot(path=str(SCREENSHOTS / "staff-quotas.png"), full_page=True)

        page.get_by_placeholder("Search tenant").fill("brav")
        expect(page.locator(f"#quota-{data['acme'].pk}")).to_have_count(0)
        expect(page.locator(f"#quota-{data['bravo'].pk}")).to_have_count(1)
        page.get_by_placeholder("Search tenant").fill("")
        expect(page.locator(f"#quota-{data['acme'].pk}")).to_have_count(1)

        page.locator(f"#quota-{data['acme'].pk}").get_by_role("link", name="Edit").click()
        page.get_by_label("GPUs in total").fill("-1")
        page.get_by_role("button", name="Save quota").click()
        expect(page.locator("#id_max_gpus_total_error")).to_have_text("Must not be negative.")
        page.get_by_label("GPUs in total").fill("10")
        page.get_by_role("button", name="Save quota").click()
        expect(page.locator("#messages")).to_contain_text("below the 12 in use now")
        expect(page.locator("#quota-audit")).to_contain_text(EMAIL)
        expect(acme_row.locator('[data-quota="max_gpus_total"]')).to_contain_text("over")

        page.get_by_label(f"Select {data['acme'].name}").check()
        page.get_by_label(f"Select {data['bravo'].name}").check()
        page.get_by_label("Limit", exact=True).select_option("max_spot_gpus")
        page.get_by_label("New value").fill("3")
        page.get_by_role("button", name="Apply to selected").click()
        expect(page.locator("#messages")).to_contain_text("Spot GPUs set for 2 tenant(s); 2 changed.")
        page.screenshot(path=str(SCREENSHOTS / "staff-quotas-changed.png"), full_page=True)

        page.get_by_role("link", name="Queue").click()
        expect(page.locator('[data-count="waiting"]')).to_have_text("2")
        expect(page.locator("#queue-fair-share")).to_contain_text("Acme")
        page.screenshot(path=str(SCREENSHOTS / "staff-queue.png"), full_page=True)

    assert dict(Quota.objects.values_list("tenant__slug", "max_spot_gpus")) == {"acme": 3, "bravo": 3}
    assert AuditEvent.objects.filter(action="quota.update").count() == 3


def test_staff_choose_a_regions_queue_policy_in_the_browser(live_server, regions):
    from playwright.sync_api import expect

    from nodes.models import Region

    User.objects.create_user(email=EMAIL, password=PASSWORD, is_staff=True)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with chromium_page(width=1400, height=1000) as page:
        page.goto(f"{live_server.url}/login/")
        page.get_by_label("Email").fill(EMAIL)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        page.goto(f"{live_server.url}/staff/queue/")
        page.get_by_role("link", name="Queue policy per region").click()
        row = page.locator("#region-us-east-1")
        row.get_by_label("Queue policy of us-east-1").select_option("sjf")
        row.get_by_label("Spot").select_option("priority_aging")
        row.get_by_role("button", name="Save").click()
        expect(page.locator("#messages")).to_contain_text(
            "Queue policy of us-east-1 set to Shortest job first"
        )
        expect(page.get_by_label("Queue policy of us-east-1")).to_have_value("sjf")
        expect(page.locator(".audit-row").first).to_contain_text(EMAIL)
        page.screenshot(path=str(SCREENSHOTS / "staff-queue-policy.png"), full_page=True)
    region = Region.objects.get(code="us-east-1")
    assert (region.queue_policy, region.queue_policy_by_plan) == ("sjf", {"spot": "priority_aging"})
    assert AuditEvent.objects.filter(action="region.queue_policy").count() == 1
