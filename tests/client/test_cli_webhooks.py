"""``gpupool webhooks`` against the live portal, with a real Celery worker delivering to a real
receiver on loopback that checks each signature with ``gpupool.webhooks.verify``: an endpoint made
from the command line, its secret printed once, the deliveries and their attempts listed, a
redelivery by hand; and the API's refusals as exit codes."""

from __future__ import annotations

import json

import pytest
from django.db import transaction

from portal.events import publish
from tests.conftest import postgres_only
from tests.webhooks.conftest import wait_for
from tests.webhooks.receiver import Receiver
from tests.webhooks.test_delivery_worker import worker
from webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _event(tenant, to="running"):
    with transaction.atomic():
        publish(
            tenant_id=tenant.pk,
            event={"type": "workload.state", "workload_id": 7, "from": "queued", "to": to},
        )


def test_webhooks_from_the_command_line_to_a_verifying_receiver(gp, tenant, settings):
    postgres_only("the worker runs in its own connection")
    settings.WEBHOOK_ALLOW_LOOPBACK = True
    settings.WEBHOOK_TIMEOUT_S = 5.0
    types = {t["name"] for t in gp.json("webhooks", "events")}
    assert {"workload.state", "invoice.paid", "budget.alert", "volume.full"} <= types
    with Receiver() as receiver:
        r = gp("webhooks", "create", receiver.url("/in"), "--event", "workload.state", "--description", "ops")
        secret = r.stdout.strip()  # only the secret on stdout, once
        assert secret.startswith("whsec_") and "shown once" in r.stderr
        receiver.secret = secret
        [listed] = gp.json("webhooks")
        assert (listed["url"], listed["event_types"], listed["enabled"]) == (
            receiver.url("/in"),
            ["workload.state"],
            True,
        )
        assert "secret" not in listed and secret not in gp("webhooks").stdout
        with worker():
            _event(tenant)
            got = receiver.wait(1)[0]
            wait_for(lambda: WebhookDelivery.objects.filter(state="succeeded").exists(), what="success")
            [delivery] = gp.json("webhooks", "deliveries")
            assert (delivery["state"], delivery["attempts"], delivery["last_status"]) == ("succeeded", 1, 200)
            assert delivery["event_id"] == got.event["id"] and got.verified
            redone = gp.json("webhooks", "redeliver", delivery["id"])
            assert redone["state"] == "pending"
            receiver.wait(2)
            wait_for(lambda: WebhookAttempt.objects.count() == 2, what="the second attempt")
            # A new secret, printed once, the old one kept signing beside it for an hour: the
            # receiver, still on the old one, accepts the next delivery.
            r = gp("webhooks", "roll-secret", listed["id"], "--keep-old", "1h")
            rolled = r.stdout.strip()
            assert rolled.startswith("whsec_") and rolled != secret and "old secret signs" in r.stderr
            _event(tenant, to="stopped")
            third = receiver.wait(3)[2]
            wait_for(lambda: WebhookAttempt.objects.count() == 3, what="the third attempt")
            assert third.verified and third.event["data"]["to"] == "stopped"
        detail = gp.json("webhooks", "delivery", delivery["id"])
        assert [(a["number"], a["manual"], a["status"]) for a in detail["attempt_log"]] == [
            (1, False, 200),
            (2, True, 200),
        ]
        assert all(a["latency_ms"] >= 0 for a in detail["attempt_log"])
        assert detail["payload"] == got.event and all(x.verified for x in receiver.received)
        table = gp("webhooks", "delivery", delivery["id"]).stdout
        assert "200" in table and "yes" in table  # the attempt by hand
        assert gp.json("webhooks", "deliveries", "--state", "failed") == []
        assert len(gp.json("webhooks", "deliveries", "--state", "succeeded")) == 2
        again = gp.json("webhooks", "roll-secret", listed["id"])  # the old one stops now
        assert again["secret"] not in (secret, rolled) and again["previous_secret_expires_at"] is None
        assert (
            "--keep-old" in gp("webhooks", "roll-secret", listed["id"], "--keep-old", "soon", code=2).stderr
        )
        assert (
            "expire_previous_in_s"
            in gp("webhooks", "roll-secret", listed["id"], "--keep-old", "8d", code=1).stderr
        )
        off = gp.json("webhooks", "update", listed["id"], "--disable", "--event", "invoice.paid")
        assert (off["enabled"], off["event_types"]) == (False, ["invoice.paid"])
        endpoint = WebhookEndpoint.objects.get(pk=listed["id"])
        assert (endpoint.enabled, endpoint.event_types) == (False, ["invoice.paid"])
        gp("webhooks", "rm", listed["id"])
        assert gp.json("webhooks") == [] and not WebhookDelivery.objects.exists()


def test_webhooks_refusals_exit_1_with_the_apis_message(gp, tenant, make_tenant, make_token, monkeypatch):
    r = gp("webhooks", "create", "https://10.0.0.1/hook", code=1)
    assert "url" in r.stderr and "private address" in r.stderr and r.stdout == ""
    r = gp("webhooks", "create", "https://hooks.example.com/x", "--event", "no.such", code=1)
    assert "event_types" in r.stderr and "no.such" in r.stderr
    assert not WebhookEndpoint.objects.exists()
    assert "Nothing to change" in gp("webhooks", "update", "1", code=2).stderr
    made = json.loads(gp("--json", "webhooks", "create", "https://hooks.example.com/x").stdout)
    assert made["event_types"] == ["*"] and made["secret"].startswith("whsec_")
    # Another team's endpoint does not exist; a token without the admin scope may not look.
    other = WebhookEndpoint.objects.create(tenant=make_tenant("globex"), url="https://a.example.com/",
                                           event_types=["*"], secret_ciphertext="x")  # fmt: skip
    assert gp.json("webhooks", "update", made["id"], "--description", "mine")["description"] == "mine"
    assert "404" in gp("webhooks", "update", other.pk, "--description", "theirs", code=1).stderr
    assert "404" in gp("webhooks", "rm", other.pk, code=1).stderr
    monkeypatch.setenv("GPUPOOL_TOKEN", make_token(tenant, scopes=("read", "write")))
    r = gp("webhooks", code=1)
    assert "403" in r.stderr and r.stdout == ""
