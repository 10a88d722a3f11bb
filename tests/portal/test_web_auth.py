"""Signing in and out, password reset, the tenant switcher, the profile and time zones."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import SESSION_KEY
from django.test import Client
from django.utils import timezone

from portal.middleware import SESSION_TENANT_KEY
from portal.models import Role, User
from tests.portal.conftest import PASSWORD

pytestmark = pytest.mark.django_db


def test_login_page_has_labelled_fields(client):
    response = client.get("/login/")
    assert response.status_code == 200
    html = response.content.decode()
    assert re.search(r'<label for="id_username">Email', html)
    assert re.search(r'<label for="id_password">Password', html)
    assert "<title>Sign in · gpupool</title>" in html


def test_login_then_dashboard(client, owner, tenant):
    response = client.post("/login/", {"username": owner.email, "password": PASSWORD})
    assert response.status_code == 302
    assert response["Location"] == "/"
    page = client.get("/")
    assert page.status_code == 200
    assert tenant.name in page.content.decode()


def test_failed_login_answers_400_with_inline_error(client, owner):
    response = client.post("/login/", {"username": owner.email, "password": "not-the-password"})
    assert response.status_code == 400
    html = response.content.decode()
    assert "do not match an account" in html
    assert 'role="alert"' in html
    assert SESSION_KEY not in client.session


def test_login_with_blank_fields_names_them(client):
    response = client.post("/login/", {"username": "", "password": ""})
    assert response.status_code == 400
    html = response.content.decode()
    assert 'id="id_username_error"' in html and 'id="id_password_error"' in html
    assert 'aria-invalid="true"' in html


def test_logout_is_a_post_and_ends_the_session(owner_client):
    assert owner_client.get("/").status_code == 200
    response = owner_client.post("/logout/")
    assert response.status_code == 302 and response["Location"] == "/login/"
    assert owner_client.get("/")["Location"].startswith("/login/")


@pytest.mark.parametrize("url", ["/", "/team/", "/tokens/", "/account/", "/panels/team/"])
def test_anonymous_is_sent_to_login(client, url):
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"] == f"/login/?next={url}"


def test_password_reset_flow(client, owner, mailoutbox):
    response = client.post("/password-reset/", {"email": owner.email})
    assert response.status_code == 302 and response["Location"] == "/password-reset/sent/"
    assert len(mailoutbox) == 1
    body = mailoutbox[0].body
    link = re.search(r"http://testserver(/password-reset/[^/\s]+/[^/\s]+/)", body).group(1)
    form_page = client.get(link, follow=True)
    assert form_page.status_code == 200
    assert "Choose a new password" in form_page.content.decode()
    set_url = form_page.redirect_chain[-1][0]
    weak = client.post(set_url, {"new_password1": "123", "new_password2": "123"})
    assert weak.status_code == 400
    assert (
        'id="id_new_password1_error"' in weak.content.decode()
        or "id_new_password2_error" in weak.content.decode()
    )
    done = client.post(set_url, {"new_password1": "brand-new-pass-77", "new_password2": "brand-new-pass-77"})
    assert done.status_code == 302 and done["Location"] == "/password-reset/complete/"
    owner.refresh_from_db()
    assert owner.check_password("brand-new-pass-77")
    # the link works once
    assert "no longer works" in client.get(link, follow=True).content.decode()


def test_password_reset_for_unknown_address_sends_nothing(client, mailoutbox):
    response = client.post("/password-reset/", {"email": "nobody@nowhere.test"})
    assert response.status_code == 302
    assert mailoutbox == []


def test_password_reset_with_bad_email_is_400(client, mailoutbox):
    response = client.post("/password-reset/", {"email": "not an email"})
    assert response.status_code == 400
    assert 'id="id_email_error"' in response.content.decode()
    assert mailoutbox == []


def test_tenant_switch_to_own_tenant(signed_in, owner, tenant, make_tenant, add_member):
    other = make_tenant("globex")
    add_member(other, Role.VIEWER, email=owner.email)
    client = signed_in(owner, tenant)
    html = client.get("/").content.decode()
    assert 'name="tenant"' in html and "Globex" in html  # the switcher lists both tenants
    response = client.post("/tenant/switch/", {"tenant": other.pk, "next": "/team/"})
    assert response.status_code == 302 and response["Location"] == "/team/"
    assert client.session[SESSION_TENANT_KEY] == other.pk
    page = client.get("/team/").content.decode()
    assert "Globex" in page and "Switched to Globex" in page


def test_tenant_switch_to_a_foreign_tenant_is_404(owner_client, tenant, make_tenant):
    other = make_tenant("globex")
    response = owner_client.post("/tenant/switch/", {"tenant": other.pk})
    assert response.status_code == 404
    assert owner_client.session[SESSION_TENANT_KEY] == tenant.pk


@pytest.mark.parametrize("value", ["", "abc", "-1", "9" * 40])
def test_tenant_switch_bad_input_is_400(owner_client, tenant, value):
    response = owner_client.post("/tenant/switch/", {"tenant": value})
    assert response.status_code == 400
    assert owner_client.session[SESSION_TENANT_KEY] == tenant.pk


def test_tenant_switch_ignores_an_offsite_next(signed_in, owner, tenant):
    client = signed_in(owner, tenant)
    response = client.post("/tenant/switch/", {"tenant": tenant.pk, "next": "https://evil.example/"})
    assert response["Location"] == "/"


def test_person_without_a_tenant_sees_an_empty_state(signed_in, db):
    user = User.objects.create_user(email="alone@x.test", password=PASSWORD)
    client = signed_in(user)
    response = client.get("/")
    assert response.status_code == 200
    assert "not in a team yet" in response.content.decode()
    assert client.get("/team/").status_code == 403


def test_profile_sets_time_zone_and_times_follow_it(owner_client, owner, make_token, tenant):
    response = owner_client.post("/account/", {"full_name": "Olive Owner", "time_zone": "Asia/Tokyo"})
    assert response.status_code == 302
    owner.refresh_from_db()
    assert (owner.full_name, owner.time_zone) == ("Olive Owner", "Asia/Tokyo")
    make_token(tenant)
    html = owner_client.get("/tokens/").content.decode()
    assert "JST" in html  # token times are shown in the person's zone


def test_profile_rejects_an_unknown_time_zone(owner_client, owner):
    response = owner_client.post("/account/", {"full_name": "X", "time_zone": "Mars/Olympus"})
    assert response.status_code == 400
    assert 'id="id_time_zone_error"' in response.content.decode()
    owner.refresh_from_db()
    assert owner.time_zone == "UTC" and owner.full_name == ""


def test_time_zone_is_not_left_active_after_a_request(owner_client, owner):
    owner.time_zone = "Asia/Tokyo"
    owner.save()
    owner_client.get("/")
    assert timezone.get_current_timezone_name() == "UTC"


def test_anonymous_client_gets_404_page_not_500(db):
    response = Client().get("/no-such-page/")
    assert response.status_code == 404
    assert "Nothing here" in response.content.decode()
