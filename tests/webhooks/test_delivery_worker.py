"""Deliveries by a real Celery worker to a real HTTP receiver on loopback that checks each
signature with the client's ``gpupool.webhooks.verify`` (answering 400 when it fails): success, a
rolled secret, retries with growing delays, the window closing, refusal of loopback when it is
not allowed, redirects not followed, timeouts, the answer size limit, redelivery by hand and the
sweeper finishing an attempt a dead worker left."""

from __future__ import annotations

import itertools
import json
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from portal.events import publish
from tests.conftest import postgres_only
from tests.webhooks.conftest import wait_for
from tests.webhooks.receiver import Answer, Receiver
from webhooks.models import WebhookAttempt, WebhookDelivery

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture(autouse=True)
def _postgres_only():
    postgres_only("the worker runs in its own connection")


@contextmanager
def worker():
    from celery.contrib.testing.worker import start_worker

    from portal.celery import app

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        yield


def _event(tenant, **data):
    with transaction.atomic():
        publish(
            tenant_id=tenant.pk,
            event={"type": "workload.state", "workload_id": 7, "from": "queued", "to": "running", **data},
        )


def _attempts(delivery):
    return list(WebhookAttempt.objects.filter(delivery=delivery).order_by("number"))


def test_an_event_arrives_signed_and_its_attempt_is_logged(tenant, make_endpoint, receiver):
    endpoint, _secret = make_endpoint(tenant, receiver.url("/in"), ["workload.state"], receiver=receiver)
    with worker():
        _event(tenant, reason="started")
        got = receiver.wait(1)[0]
        delivery = wait_for(
            lambda: WebhookDelivery.objects.filter(endpoint=endpoint, state="succeeded").first(),
            what="success",
        )
    assert got.verified, got.verify_error
    assert got.path == "/in" and got.headers["Content-Type"] == "application/json"
    body = json.loads(got.body)
    assert got.event == body  # what the client's verify() answered the receiver
    assert body["type"] == "workload.state" and body["id"] == f"evt_{delivery.event_id}"
    assert body["data"] == {"workload_id": 7, "from": "queued", "to": "running", "reason": "started"}
    assert got.headers["Gpupool-Event-Id"] == body["id"] and got.headers["Gpupool-Attempt"] == "1"
    [attempt] = _attempts(delivery)
    assert attempt.status == 200 and attempt.error == "" and attempt.manual is False
    assert 0 < attempt.latency_ms < 5000 and attempt.response_excerpt == "ok"
    assert delivery.delivered_at is not None and delivery.next_attempt_at is None


def test_an_endpoint_gets_only_the_types_it_asked_for(tenant, make_endpoint, receiver):
    _endpoint, _ = make_endpoint(tenant, receiver.url(), ["budget.alert"], receiver=receiver)
    _event(tenant)
    with transaction.atomic():
        publish(tenant_id=tenant.pk, event={"type": "not.in.catalog"})
    assert not WebhookDelivery.objects.exists()


def test_failures_are_retried_with_growing_delays_until_one_succeeds(
    tenant, make_endpoint, receiver, settings
):
    settings.WEBHOOK_RETRY_BASE_S = 0.6
    _endpoint, _ = make_endpoint(tenant, receiver.url(), receiver=receiver)
    receiver.answers = [Answer(status=500, body=b"boom"), Answer(status=503)]
    with worker():
        _event(tenant)
        got = receiver.wait(3)
        delivery = wait_for(lambda: WebhookDelivery.objects.filter(state="succeeded").first(), what="success")
    assert all(r.verified for r in got)
    assert len({json.loads(r.body)["id"] for r in got}) == 1  # one event, three attempts
    assert [r.headers["Gpupool-Attempt"] for r in got] == ["1", "2", "3"]
    gaps = [b.at - a.at for a, b in itertools.pairwise(got)]
    assert gaps[0] >= 0.6 and gaps[1] >= 1.2, gaps  # base, then twice the base
    attempts = _attempts(delivery)
    assert [(a.status, a.error) for a in attempts] == [(500, "HTTP 500"), (503, "HTTP 503"), (200, "")]
    assert attempts[0].response_excerpt == "boom"
    assert delivery.attempts == 3 and delivery.last_status == 200


def test_a_delivery_fails_when_the_retry_window_closes(tenant, make_endpoint, receiver, settings):
    settings.WEBHOOK_RETRY_BASE_S = 0.5
    settings.WEBHOOK_RETRY_WINDOW_S = 2.0
    make_endpoint(tenant, receiver.url(), receiver=receiver)
    receiver.default = Answer(status=500)
    with worker():
        _event(tenant)
        delivery = wait_for(lambda: WebhookDelivery.objects.filter(state="failed").first(), what="failure")
        count = len(receiver.received)
        time.sleep(1.5)
    # 0, +0.5, +1.0 (1.5 s after the event); the next (+2.0) would pass the 2 s window.
    assert count == 3 and len(receiver.received) == 3
    assert delivery.next_attempt_at is None and delivery.last_error == "HTTP 500"
    assert [a.status for a in _attempts(delivery)] == [500, 500, 500]


def test_loopback_is_refused_when_not_allowed_and_nothing_is_sent(tenant, make_endpoint, receiver, settings):
    make_endpoint(tenant, receiver.url(), receiver=receiver)  # saved while loopback was allowed
    settings.WEBHOOK_ALLOW_LOOPBACK = False
    settings.WEBHOOK_RETRY_BASE_S = 3600
    with worker():
        _event(tenant)
        attempt = wait_for(lambda: WebhookAttempt.objects.first(), what="an attempt")
    assert attempt.status is None and "127.0.0.1 is a loopback address" in attempt.error
    assert attempt.error.startswith("refused")
    assert receiver.received == []
    delivery = WebhookDelivery.objects.get()
    assert delivery.state == "pending" and delivery.next_attempt_at > timezone.now() + timedelta(minutes=50)


def test_redirects_are_not_followed(tenant, make_endpoint, receiver, settings):
    settings.WEBHOOK_RETRY_BASE_S = 3600
    with Receiver() as elsewhere:
        make_endpoint(tenant, receiver.url(), receiver=receiver)
        receiver.default = Answer(status=307, headers={"Location": elsewhere.url("/stolen")})
        with worker():
            _event(tenant)
            attempt = wait_for(lambda: WebhookAttempt.objects.first(), what="an attempt")
        time.sleep(0.5)
        assert elsewhere.received == []
    assert attempt.status == 307 and "not followed" in attempt.error and "/stolen" in attempt.error
    assert WebhookDelivery.objects.get().state == "pending"


def test_a_slow_receiver_times_out_and_a_large_answer_is_cut(tenant, make_endpoint, receiver, settings):
    settings.WEBHOOK_RETRY_BASE_S = 0.3
    settings.WEBHOOK_TIMEOUT_S = 1.0
    settings.WEBHOOK_MAX_RESPONSE_BYTES = 10_000
    make_endpoint(tenant, receiver.url(), receiver=receiver)
    receiver.answers = [Answer(delay_s=3.0)]
    receiver.default = Answer(status=200, body=b"x" * 5_000_000)
    with worker():
        _event(tenant)
        delivery = wait_for(lambda: WebhookDelivery.objects.filter(state="succeeded").first(), what="success")
    slow, big = _attempts(delivery)
    assert slow.status is None and slow.error.startswith("timeout") and 900 <= slow.latency_ms < 2500
    assert big.status == 200 and big.error == "" and len(big.response_excerpt) == 1024


def test_redelivery_by_hand_sends_the_same_event_again(tenant, make_endpoint, receiver, api, make_token):
    _endpoint, _ = make_endpoint(tenant, receiver.url(), receiver=receiver)
    client = api(make_token(tenant))
    with worker():
        _event(tenant)
        delivery = wait_for(lambda: WebhookDelivery.objects.filter(state="succeeded").first(), what="success")
        r = client.post(f"/api/v1/webhook-deliveries/{delivery.pk}/redeliver/")
        assert r.status_code == 200, r.content
        got = receiver.wait(2)
        wait_for(lambda: WebhookAttempt.objects.filter(delivery=delivery).count() == 2, what="second attempt")
    assert got[0].body == got[1].body and all(r.verified for r in got)
    first, second = _attempts(delivery)
    assert (first.manual, second.manual) == (False, True) and second.status == 200
    detail = client.get(f"/api/v1/webhook-deliveries/{delivery.pk}/").json()
    assert [a["manual"] for a in detail["attempt_log"]] == [False, True] and detail["state"] == "succeeded"


def test_the_sweeper_sends_an_attempt_a_dead_worker_left(tenant, make_endpoint, receiver):
    make_endpoint(tenant, receiver.url(), receiver=receiver)
    _event(tenant)  # no worker: the first attempt's task waits in the broker
    from portal.celery import app

    app.control.purge()  # ... and is lost
    delivery = WebhookDelivery.objects.get()
    # A worker claimed it and died: one attempt counted, due again once its lease ran out.
    WebhookDelivery.objects.filter(pk=delivery.pk).update(attempts=1, next_attempt_at=timezone.now())
    from webhooks.tasks import deliver_due

    with worker():
        deliver_due.delay()
        got = receiver.wait(1)
        wait_for(lambda: WebhookDelivery.objects.filter(state="succeeded").exists(), what="success")
    assert got[0].verified and got[0].headers["Gpupool-Attempt"] == "2"


def test_a_rolled_secret_is_refused_by_a_receiver_without_it_until_it_has_both(
    tenant, make_endpoint, receiver, api, make_token, settings
):
    settings.WEBHOOK_RETRY_BASE_S = 3600  # no automatic retry in this test: only by hand
    endpoint, old = make_endpoint(tenant, receiver.url(), receiver=receiver)
    client = api(make_token(tenant))
    r = client.post(f"/api/v1/webhooks/{endpoint.pk}/roll-secret/")
    assert r.status_code == 200, r.content
    new = r.json()["secret"]
    assert new.startswith("whsec_") and new != old
    with worker():
        _event(tenant)  # signed with the new secret; the receiver knows only the old one
        refused = receiver.wait(1)[0]
        attempt = wait_for(lambda: WebhookAttempt.objects.first(), what="an attempt")
        assert not refused.verified and "No signature matches" in refused.verify_error
        assert attempt.status == 400 and "No signature matches" in attempt.response_excerpt
        delivery = WebhookDelivery.objects.get()
        assert delivery.state == "pending"
        receiver.secret = [new, old]  # the receiver takes the new secret, keeping the old a while
        assert client.post(f"/api/v1/webhook-deliveries/{delivery.pk}/redeliver/").status_code == 200
        accepted = receiver.wait(2)[1]
        wait_for(lambda: WebhookDelivery.objects.filter(state="succeeded").exists(), what="success")
    assert accepted.verified and accepted.body == refused.body
    assert [a.status for a in _attempts(delivery)] == [400, 200]
