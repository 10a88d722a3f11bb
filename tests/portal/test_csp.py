"""The Content-Security-Policy header: strict on every page (no inline script or style, no plugins,
no framing), what Swagger UI needs on the API docs only, and templates that need no more.

The browser proves the pages run under it: ``tests/portal/test_browser_csp.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client

from portal.models import User

pytestmark = pytest.mark.django_db

STRICT = {
    "default-src": {"'self'"},
    "script-src": {"'self'"},
    "style-src": {"'self'"},
    "connect-src": {"'self'"},
    "object-src": {"'none'"},
    "base-uri": {"'self'"},
    "form-action": {"'self'"},
    "frame-ancestors": {"'none'"},
}


def policy(response) -> dict[str, set[str]]:
    assert "Content-Security-Policy" in response, f"no CSP header on {response.request['PATH_INFO']}"
    directives = {}
    for part in response["Content-Security-Policy"].split(";"):
        name, *sources = part.split()
        directives[name] = set(sources)
    return directives


def assert_strict(response) -> None:
    got = policy(response)
    for name, sources in STRICT.items():
        assert got.get(name) == sources, (response.request["PATH_INFO"], name, got.get(name))
    assert not any("'unsafe-" in s for v in got.values() for s in v), got


def test_every_page_has_the_strict_policy(client, owner_client, make_token, tenant, api):
    assert client.get("/login/").status_code == 200
    assert_strict(client.get("/login/"))
    for url in ("/", "/workloads/", "/billing/invoices/", "/billing/usage/", "/tokens/", "/team/"):
        response = owner_client.get(url)
        assert response.status_code == 200, url
        assert_strict(response)
    # htmx partials are documents too (an error page rendered in place must not run script).
    assert_strict(owner_client.get("/panels/workloads/", HTTP_HX_REQUEST="true"))
    # The JSON API carries the same policy: a response opened in a browser runs nothing.
    response = api(make_token(tenant)).get("/api/v1/me/")
    assert response.status_code == 200 and response["Content-Type"].startswith("application/json")
    assert_strict(response)


def test_the_admin_has_the_strict_policy():
    staff = User.objects.create_superuser(email="root@gpupool.test", password="pw-for-tests-1")
    client = Client()
    client.force_login(staff)
    for url in ("/admin/", "/admin/portal/tenant/", "/admin/password_change/"):
        response = client.get(url)
        assert response.status_code == 200, url
        assert_strict(response)


def test_the_api_docs_allow_only_what_swagger_ui_needs(owner_client):
    response = owner_client.get("/api/docs/")
    assert response.status_code == 200
    got = policy(response)
    # Swagger UI's init script runs by this response's nonce, its icons are data: SVG images.
    nonce = next(s for s in got["script-src"] if s.startswith("'nonce-"))
    assert got["script-src"] == {"'self'", nonce}
    assert got["img-src"] == {"'self'", "data:"}
    page = policy(owner_client.get("/"))
    assert {k: v for k, v in got.items() if k not in ("script-src", "img-src")} == {
        k: v for k, v in page.items() if k not in ("script-src", "img-src")
    }
    html = response.content.decode()
    inline = re.findall(r"<script(?![^>]*\bsrc=)([^>]*)>", html)
    assert inline == [f' nonce="{nonce[7:-1]}"'], inline
    assert "<style" not in html
    # Another request, another nonce.
    assert policy(owner_client.get("/api/docs/"))["script-src"] != got["script-src"]


# The project's templates and each app's.
TEMPLATE_DIRS = [Path(settings.BASE_DIR) / "templates", *Path(settings.BASE_DIR).glob("*/templates")]
# Rendered to a PDF by WeasyPrint, never served as a page.
NOT_PAGES = {"metering/invoice_pdf.html"}
# Its inline script carries the request's nonce (test_the_api_docs_allow_only_what_swagger_ui_needs).
NONCED = {"portal/swagger_ui.html"}


def test_no_template_needs_inline_script_or_style():
    offences = []
    for root in TEMPLATE_DIRS:
        for path in root.rglob("*.html"):
            if str(path.relative_to(root)) in NOT_PAGES | NONCED:
                continue
            text = path.read_text()
            for pattern in (
                r"<script(?![^>]*\bsrc=)[^>]*>",  # an inline script
                r"<style\b",
                r"\sstyle=",
                r"\son[a-z]+=",  # an event handler attribute
                r"javascript:",
                r"hx-on",
            ):
                offences += [f"{path.relative_to(root)}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert offences == []


def test_htmx_injects_no_indicator_style():
    base = (Path(settings.BASE_DIR) / "templates" / "base.html").read_text()
    config = re.search(r"<meta name=\"htmx-config\" content='([^']*)'>", base).group(1)
    assert json.loads(config)["includeIndicatorStyles"] is False
