"""At delivery time the endpoint's host name is resolved once and every address checked: a name that
points at a private or loopback address (set when the endpoint was saved, or rebound since) is
refused before anything is sent, and the connection goes to the address that was checked, not to
a second lookup. Through the delivery service, with the resolver answering as a hostile DNS would.
And the retry schedule with the production settings: exponential, capped, for three days."""

from __future__ import annotations

import itertools
import socket
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.actors import Actor
from webhooks.models import WebhookAttempt, WebhookDelivery
from webhooks.services.deliveries import delivery_attempt, retry_delay_s
from webhooks.services.endpoints import endpoint_create
from webhooks.services.events import events_record

pytestmark = pytest.mark.django_db

NAME = "hooks.example.com"


@pytest.fixture
def dns(monkeypatch):
    """``answers[NAME]``: the addresses the resolver gives for NAME; ``asked``: names looked up."""
    answers: dict[str, list[str]] = {}
    asked: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        asked.append(host)
        if host not in answers:
            return real(host, port, *args, **kwargs)
        return [
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, port, 0, 0))
            if ":" in a
            else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
            for a in answers[host]
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answers, asked


def _deliver_once(tenant, endpoint) -> WebhookAttempt:
    [delivery] = events_record(
        events=[(tenant.pk, {"type": "workload.state", "workload_id": 1, "to": "running"})]
    )
    assert delivery.endpoint_id == endpoint.pk
    return delivery_attempt(delivery_id=delivery.pk)


def test_a_name_resolving_to_a_private_address_is_refused_and_nothing_is_sent(
    tenant, loopback, receiver, dns, settings
):
    settings.WEBHOOK_RETRY_BASE_S = 3600  # no retry queued during the test
    answers, asked = dns
    endpoint, secret = endpoint_create(tenant=tenant, url=f"http://{NAME}:{receiver.port}/in",
                                       event_types=["*"], actor=Actor.system())  # fmt: skip
    receiver.secret = secret
    # The positive control: the name resolves to loopback, allowed here, and the delivery arrives
    # at the address checked, with the URL's name as its Host (one lookup, then a pinned connect).
    answers[NAME] = ["127.0.0.1"]
    ok = _deliver_once(tenant, endpoint)
    assert ok.status == 200 and ok.error == "", ok.error
    [got] = receiver.wait(1)
    assert got.verified and got.headers["Host"] == f"{NAME}:{receiver.port}"
    assert asked.count(NAME) == 1
    for addresses, why in [
        (["10.1.2.3"], "10.1.2.3 is a private address"),
        (["169.254.169.254"], "169.254.169.254 is a link-local address"),
        (["::ffff:192.168.0.7"], "192.168.0.7 is a private address"),
        (["127.0.0.1", "10.9.9.9"], "10.9.9.9 is a private address"),  # one bad address: all refused
    ]:
        answers[NAME] = addresses
        attempt = _deliver_once(tenant, endpoint)
        assert attempt.status is None and attempt.error.startswith("refused"), attempt.error
        assert f"{NAME} resolves to" in attempt.error and why in attempt.error, attempt.error
    # Loopback by name, where it is not allowed (production).
    settings.WEBHOOK_ALLOW_LOOPBACK = False
    endpoint.url = f"https://{NAME}/in"
    endpoint.save(update_fields=["url"])
    answers[NAME] = ["127.0.0.1"]
    attempt = _deliver_once(tenant, endpoint)
    assert "127.0.0.1 is a loopback address" in attempt.error
    assert len(receiver.received) == 1  # only the positive control arrived
    assert WebhookDelivery.objects.filter(state="pending").count() == 5  # refused attempts are retried


def test_the_retry_schedule_backs_off_exponentially_for_three_days(tenant, settings):
    # The production defaults (portal/settings.py).
    assert settings.WEBHOOK_RETRY_BASE_S == 30 and settings.WEBHOOK_RETRY_MAX_DELAY_S == 6 * 3600
    assert settings.WEBHOOK_RETRY_WINDOW_S == 3 * 86400
    delays = [retry_delay_s(n) for n in range(1, 16)]
    assert delays[:6] == [30, 60, 120, 240, 480, 960]
    assert all(b == min(2 * a, 6 * 3600) for a, b in itertools.pairwise(delays))
    assert delays[-1] == 6 * 3600 and retry_delay_s(10_000) == 6 * 3600
    # How many automatic attempts three days hold (the attempts' own time aside).
    elapsed, attempts = 0.0, 1
    while elapsed + retry_delay_s(attempts) <= 3 * 86400:
        elapsed += retry_delay_s(attempts)
        attempts += 1
    # 30 s doubling to 4 h 16 min (10 retries, 8.5 h), then every 6 h: 21 attempts in all.
    assert attempts == 21, attempts
    endpoint_create(tenant=tenant, url="https://hooks.example.com/in", event_types=["*"],
                    actor=Actor.system())  # fmt: skip
    before = timezone.now()
    [delivery] = events_record(events=[(tenant.pk, {"type": "budget.alert", "threshold": 80})])
    window = delivery.retry_until - delivery.created_at
    assert window == timedelta(days=3) and delivery.created_at >= before
