"""Sign-in and password-reset attempts are limited (429 with Retry-After), per address and email."""

from __future__ import annotations

import pytest

from portal import signin
from portal.views import accounts

pytestmark = pytest.mark.django_db


@pytest.fixture
def low_limits(monkeypatch):
    monkeypatch.setattr(signin.email_limiter, "limit", 3)
    monkeypatch.setattr(accounts.reset_limiter, "limit", 2)


def test_failed_sign_ins_are_limited(client, owner, low_limits):
    for _ in range(3):
        assert client.post("/login/", {"username": owner.email, "password": "wrong"}).status_code == 400
    blocked = client.post("/login/", {"username": owner.email, "password": "pw-for-tests-1"})
    assert blocked.status_code == 429
    assert int(blocked["Retry-After"]) > 0
    assert "Too many attempts" in blocked.content.decode()
    # the right password does not get through while blocked, from another address either
    other = client.post(
        "/login/", {"username": owner.email, "password": "pw-for-tests-1"}, REMOTE_ADDR="10.9.9.9"
    )
    assert other.status_code == 429


def test_a_successful_sign_in_clears_the_email_counter(client, owner, low_limits):
    for _ in range(2):
        client.post("/login/", {"username": owner.email, "password": "wrong"}, REMOTE_ADDR="10.0.0.1")
    ok = client.post(
        "/login/", {"username": owner.email, "password": "pw-for-tests-1"}, REMOTE_ADDR="10.0.0.2"
    )
    assert ok.status_code == 302
    client.logout()
    for _ in range(2):
        assert (
            client.post(
                "/login/", {"username": owner.email, "password": "x"}, REMOTE_ADDR="10.0.0.3"
            ).status_code
            == 400
        )


def test_password_reset_requests_are_limited(client, owner, low_limits, mailoutbox):
    for _ in range(2):
        assert client.post("/password-reset/", {"email": owner.email}).status_code == 302
    blocked = client.post("/password-reset/", {"email": owner.email})
    assert blocked.status_code == 429
    assert len(mailoutbox) == 2
