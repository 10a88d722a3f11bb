"""The tenant pages' quality in a real browser (Debian's Chromium, headless, driven by Playwright):
every control has a label, the launch form works from the keyboard alone, and every main page fits a
phone's screen (390 x 844) without scrolling sideways. Screenshots of the narrow pages land in
``var/screenshots/narrow-*.png``.
"""

from __future__ import annotations

import itertools
import re

import pytest

from portal.models import Membership, Role
from tests.browser import SCREENSHOTS, chromium_page
from tests.portal.conftest import PASSWORD, eight_h100_node

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PAGES = (
    "/",
    "/launch/",
    "/workloads/",
    "/billing/usage/",
    "/billing/invoices/",
    "/billing/reservations/",
    "/billing/budget/",
    "/team/",
    "/tokens/",
)

# Visible form controls in <main> that no label names: neither <label for>, a wrapping <label>,
# aria-label nor aria-labelledby.
UNLABELLED = """() => [...document.querySelectorAll('main input, main select, main textarea')]
  .filter(el => el.type !== 'hidden' && el.offsetParent !== null)
  .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                && !el.getAttribute('aria-labelledby'))
  .map(el => el.outerHTML.slice(0, 120))"""

# How far the page runs past the screen, and the boxes that do (for the message): those no scrolling
# box (a wide table's wrapper, the nav bar) contains, and absolutely placed ones, which escape one
# unless it is their containing block.
OVERFLOW = """() => {
  const width = window.innerWidth;
  const contained = el => {
    for (let up = el.parentElement; up && up !== document.body; up = up.parentElement)
      if (getComputedStyle(up).overflowX !== 'visible') return true;
    return false;
  };
  const wide = [...document.querySelectorAll('body *')]
    .filter(el => el.getBoundingClientRect().right > width + 1)
    .filter(el => !contained(el) || getComputedStyle(el).position === 'absolute')
    .slice(0, 8)
    .map(el => `<${el.tagName.toLowerCase()} class="${el.className}"> ends at ${Math.round(el.getBoundingClientRect().right)} px`);
  // and form controls cut off by their card (a card clips what runs past it)
  const cut = [...document.querySelectorAll('main input, main select, main textarea, main button')]
    .filter(el => el.offsetParent !== null && el.closest('.card') && !el.closest('.table-wrap'))
    .filter(el => el.getBoundingClientRect().right > el.closest('.card').getBoundingClientRect().right + 1)
    .map(el => el.outerHTML.slice(0, 100));
  return {over: document.documentElement.scrollWidth - width, wide, cut};
}"""


@pytest.fixture
def owner_page(monkeypatch, live_server, make_tenant):
    """A signed-in owner of a tenant, with a small fleet so that the launch form can be sent."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    eight_h100_node()
    tenant = make_tenant("acme", name="Acme Research")
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user

    def open_page(width: int, height: int):
        cm = chromium_page(width=width, height=height)
        page = cm.__enter__()
        page.goto(f"{live_server.url}/login/")
        page.get_by_label("Email").fill(owner.email)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(f"{live_server.url}/")
        return cm, page

    opened = []

    def make(width: int = 1360, height: int = 900):
        cm, page = open_page(width, height)
        opened.append(cm)
        return page

    yield live_server.url, make
    for cm in opened:
        cm.__exit__(None, None, None)


def test_every_control_on_the_main_pages_has_a_label(owner_page):
    base, make = owner_page
    page = make()
    for path in PAGES:
        page.goto(f"{base}{path}")
        page.wait_for_load_state("networkidle")
        assert page.evaluate(UNLABELLED) == [], f"{path}: controls without a label"


def test_the_launch_form_is_reached_and_sent_with_the_keyboard(owner_page):
    from playwright.sync_api import expect

    base, make = owner_page
    page = make()
    page.goto(f"{base}/launch/")
    page.wait_for_load_state("networkidle")
    page.locator("#content").focus()
    for _ in itertools.repeat(None, 60):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "launch-submit":
            break
    else:
        pytest.fail("Tab from the top of the page never reached the launch button")
    # the defaults (first model, one GPU, on-demand) plus the image the form asks for
    page.get_by_label("Image").fill("ghcr.io/acme/notebook:1")
    page.locator("#launch-submit").focus()
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(r"/workloads/\d+/$"))


def test_the_main_pages_fit_a_phone_screen(owner_page):
    base, make = owner_page
    page = make(width=390, height=844)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for path in PAGES:
        page.goto(f"{base}{path}")
        page.wait_for_load_state("networkidle")
        name = path.strip("/").replace("/", "-") or "dashboard"
        page.screenshot(path=str(SCREENSHOTS / f"narrow-{name}.png"), full_page=True)
        found = page.evaluate(OVERFLOW)
        assert found["over"] <= 1, f"{path} runs {found['over']} px past a 390 px screen: {found['wide']}"
        assert found["cut"] == [], f"{path}: controls cut off by their card at 390 px"
