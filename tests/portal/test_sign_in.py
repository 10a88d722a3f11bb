"""Signing in: every password form (the site's and the Django admin's) behind one attempt limiter
that parallel attempts cannot overshoot, the client's address only from trusted proxies, audit
events for sign-ins, failures, lockouts and password resets, and staff sessions that expire when
idle."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.conf import settings as django_settings
from django.core import mail
from django.db import connections
from django.test import Client, RequestFactory

from portal.models import AuditEvent, User
from portal.ratelimit import client_ip
from tests.conftest import postgres_only

PASSWORD = "pw-for-tests-1"


@pytest.fixture
def staff(db) -> User:
    return User.objects.create_user(email="ops@gpupool.test", password=PASSWORD, is_staff=True)


def actions() -> list[str]:
    return list(AuditEvent.objects.order_by("id").values_list("action", flat=True))


@pytest.mark.django_db
def test_the_admin_sign_in_is_limited_as_the_site_one_is(staff, settings):
    # Positive control: the right password signs in at first.
    assert Client().post("/admin/login/", {"username": staff.email, "password": PASSWORD}).status_code == 302
    client = Client()
    codes = [
        client.post("/admin/login/", {"username": staff.email, "password": f"wrong-{i}"}).status_code
        for i in range(25)
    ]
    limit = settings.GPUPOOL_LOGIN_FAILURE_LIMIT
    assert codes == [200] * limit + [429] * (25 - limit)  # the admin shows its form again: 200
    blocked = client.post("/admin/login/", {"username": staff.email, "password": PASSWORD})
    assert blocked.status_code == 429
    assert int(blocked["Retry-After"]) > 0
    assert "Too many attempts" in blocked.content.decode()
    assert "_auth_user_id" not in client.session
    # The site's form counts the same attempts: the account is locked there too.
    site = Client().post("/login/", {"username": staff.email, "password": PASSWORD})
    assert site.status_code == 429
    assert actions().count("account.sign_in_failed") == limit
    assert actions().count("account.sign_in_locked") == 25 - limit + 2


@pytest.mark.django_db(transaction=True)
def test_parallel_sign_in_attempts_get_no_more_tries_than_the_limit(settings):
    """Thirty wrong passwords at once: exactly the limit of them are checked, the rest refused (the
    old counter was read, then written: every parallel attempt saw an empty count)."""
    postgres_only("thirty threads writing audit events at once")
    User.objects.create_user(email="target@gpupool.test", password=PASSWORD)
    limit, tries = settings.GPUPOOL_LOGIN_FAILURE_LIMIT, 30
    barrier = threading.Barrier(tries)

    def attempt(i: int) -> int:
        try:
            client = Client(REMOTE_ADDR=f"198.51.100.{i}")  # many addresses, one account
            barrier.wait()
            return client.post("/login/", {"username": "target@gpupool.test", "password": "x"}).status_code
        finally:
            connections.close_all()

    with ThreadPoolExecutor(tries) as pool:
        codes = sorted(pool.map(attempt, range(tries)))
    assert codes == [400] * limit + [429] * (tries - limit)


def test_the_client_address_comes_only_from_trusted_proxies(settings):
    settings.TRUSTED_PROXIES = ["10.0.0.0/8", "192.0.2.1"]
    rf = RequestFactory()

    def ip(peer: str, forwarded: str | None = None) -> str:
        extra = {"HTTP_X_FORWARDED_FOR": forwarded} if forwarded is not None else {}
        return client_ip(rf.get("/", REMOTE_ADDR=peer, **extra))

    # A client that is no proxy says what it likes: its own address is taken.
    assert ip("203.0.113.5", "1.2.3.4") == "203.0.113.5"
    # Through trusted proxies: the nearest hop that is not one of them.
    assert ip("10.1.2.3", "198.51.100.7") == "198.51.100.7"
    assert ip("10.1.2.3", "6.6.6.6, 198.51.100.7, 192.0.2.1") == "198.51.100.7"
    assert ip("10.1.2.3") == "10.1.2.3"
    settings.TRUSTED_PROXIES = []
    assert ip("10.1.2.3", "198.51.100.7") == "10.1.2.3"


@pytest.mark.django_db
def test_sign_ins_failures_and_password_resets_are_audited(staff):
    client = Client(REMOTE_ADDR="203.0.113.9")
    assert client.post("/login/", {"username": staff.email, "password": "wrong"}).status_code == 400
    assert client.post("/login/", {"username": staff.email, "password": PASSWORD}).status_code == 302
    failed, signed_in = AuditEvent.objects.order_by("id")
    assert (failed.action, failed.data) == (
        "account.sign_in_failed",
        {"email": staff.email, "ip": "203.0.113.9"},
    )
    assert (signed_in.action, signed_in.actor_user, signed_in.data["ip"]) == (
        "account.signed_in",
        staff,
        "203.0.113.9",
    )
    anonymous = Client(REMOTE_ADDR="203.0.113.9")
    assert anonymous.post("/password-reset/", {"email": staff.email}).status_code == 302
    link = re.search(r"https?://[^/]+(/password-reset/\S+/)", mail.outbox[-1].body).group(1)
    form = anonymous.get(link, follow=True)
    new = "a-new-Passw0rd-for-tests"
    done = anonymous.post(form.redirect_chain[-1][0], {"new_password1": new, "new_password2": new})
    assert done.status_code == 302
    assert actions()[-2:] == ["account.password_reset_requested", "account.password_changed"]
    assert AuditEvent.objects.get(action="account.password_changed").target_id == str(staff.pk)


@pytest.mark.django_db
def test_staff_sessions_end_after_the_idle_time(staff, settings):
    settings.STAFF_SESSION_IDLE_S = 600
    client = Client()
    client.force_login(staff)
    assert client.get("/staff/finance/").status_code == 200  # positive control
    session = client.session
    session["staff_last_seen"] = int(time.time()) - 601
    session.save()
    response = client.get("/staff/finance/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert client.get("/staff/finance/").status_code == 302  # signed out for good
    # Active within the idle time: still signed in.
    client.force_login(staff)
    session = client.session
    session["staff_last_seen"] = int(time.time()) - 590
    session.save()
    assert client.get("/staff/finance/").status_code == 200


def change_password(client: Client, old: str, new: str = "a-new-Passw0rd-for-tests"):
    return client.post(
        "/admin/password_change/",
        {"old_password": old, "new_password1": new, "new_password2": new},
    )


@pytest.mark.django_db
def test_the_admin_password_change_is_limited_as_sign_in_is(staff, settings):
    """A stolen staff session cannot guess the old password without end: the admin's change form
    checks it with ``check_password``, which the sign-in backend never sees."""
    client = Client(REMOTE_ADDR="203.0.113.20")
    client.force_login(staff)
    assert client.get("/admin/password_change/").status_code == 200  # positive control
    limit, tries = settings.GPUPOOL_LOGIN_FAILURE_LIMIT, settings.GPUPOOL_LOGIN_FAILURE_LIMIT + 3
    codes = [change_password(client, f"wrong-{i}").status_code for i in range(tries)]
    assert codes == [200] * limit + [429] * (tries - limit)  # the admin shows its form again: 200
    blocked = change_password(client, PASSWORD)
    assert blocked.status_code == 429
    assert int(blocked["Retry-After"]) > 0
    assert "Too many attempts" in blocked.content.decode()
    staff.refresh_from_db()
    assert staff.check_password(PASSWORD)  # not changed
    assert actions().count("account.password_change_failed") == limit
    assert actions().count("account.password_change_locked") == tries - limit + 1
    failed = AuditEvent.objects.filter(action="account.password_change_failed").first()
    assert (failed.actor_user, failed.target_id, failed.data) == (
        staff,
        str(staff.pk),
        {"ip": "203.0.113.20"},
    )
    # The account's count is the sign-in's: signing in again is locked too.
    assert Client().post("/login/", {"username": staff.email, "password": PASSWORD}).status_code == 429


@pytest.mark.django_db
def test_the_right_old_password_changes_it_and_starts_the_count_again(staff, settings):
    client = Client()
    client.force_login(staff)
    for i in range(settings.GPUPOOL_LOGIN_FAILURE_LIMIT - 1):
        assert change_password(client, f"wrong-{i}").status_code == 200
    done = change_password(client, PASSWORD, "a-new-Passw0rd-for-tests")
    assert done.status_code == 302 and done["Location"] == "/admin/password_change/done/"
    staff.refresh_from_db()
    assert staff.check_password("a-new-Passw0rd-for-tests")
    # A success clears the account's count: a typo afterwards is an ordinary wrong password.
    assert change_password(client, "wrong-again").status_code == 200
    assert "account.password_changed" in actions()


@pytest.mark.django_db(transaction=True)
def test_parallel_password_change_attempts_get_no_more_tries_than_the_limit(settings):
    """Thirty wrong old passwords at once from one stolen session: exactly the limit are checked."""
    postgres_only("thirty threads writing audit events at once")
    user = User.objects.create_user(email="ops2@gpupool.test", password=PASSWORD, is_staff=True)
    limit, tries = settings.GPUPOOL_LOGIN_FAILURE_LIMIT, 30
    barrier = threading.Barrier(tries)
    session = Client()
    session.force_login(user)
    cookie = session.cookies[django_settings.SESSION_COOKIE_NAME].value

    def attempt(i: int) -> int:
        try:
            client = Client(REMOTE_ADDR=f"198.51.100.{i}")  # many addresses, one account
            client.cookies[django_settings.SESSION_COOKIE_NAME] = cookie
            barrier.wait()
            return change_password(client, "x").status_code
        finally:
            connections.close_all()

    with ThreadPoolExecutor(tries) as pool:
        codes = sorted(pool.map(attempt, range(tries)))
    assert codes == [200] * limit + [429] * (tries - limit)
    user.refresh_from_db()
    assert user.check_password(PASSWORD)
