"""Delivering recorded events: attempts, retries with exponential backoff, redelivery by hand.

An attempt is three steps so that no lock or transaction is held while the receiver answers:
claim the delivery (locked, skipped when another worker holds it; it must be PENDING and due;
its ``next_attempt_at`` is pushed past the attempt's timeout, so an attempt a dead worker left
is due again later), send it (``webhooks.sender.post``, signed with the endpoint's secret at the
time of sending, and with the previous one too while a roll keeps it), and record the outcome:
a WebhookAttempt row and the delivery's new state. A 2xx answer succeeds. Otherwise the next
attempt is due ``base * 2^(n-1)`` seconds after the n-th (at most ``WEBHOOK_RETRY_MAX_DELAY_S``);
when that would fall after ``retry_until`` (three days after the event) the delivery FAILS.
Redelivery by hand makes it PENDING and due now; for a delivery that had finished, that one
attempt is all (its window is closed).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.actors import Actor
from portal.crypto import InvalidToken
from portal.errors import Conflict
from portal.services.audit import audit_record
from webhooks import sender, signature
from webhooks.locks import lock_delivery, lock_delivery_claim
from webhooks.models import DeliveryState, WebhookAttempt, WebhookDelivery
from webhooks.services.endpoints import endpoint_signing_secrets
from webhooks.services.events import event_body

logger = logging.getLogger(__name__)


def retry_delay_s(attempt: int) -> float:
    """Seconds from the end of failed attempt ``attempt`` (1, 2, ...) to the next."""
    base = settings.WEBHOOK_RETRY_BASE_S
    return min(base * 2 ** min(attempt - 1, 40), settings.WEBHOOK_RETRY_MAX_DELAY_S)


def _claim(delivery_id: int, now: datetime) -> tuple[WebhookDelivery, int, bool] | None:
    with transaction.atomic():
        d = lock_delivery_claim(delivery_id=delivery_id)
        if d is None or d.state != DeliveryState.PENDING or d.next_attempt_at > now:
            return None
        manual = d.manual
        if not d.endpoint.enabled:
            d.state, d.next_attempt_at, d.last_error, d.manual = (
                DeliveryState.FAILED,
                None,
                "endpoint disabled",
                False,
            )
            d.save(update_fields=["state", "next_attempt_at", "last_error", "manual"])
            return None
        d.attempts += 1
        lease = settings.WEBHOOK_TIMEOUT_S + settings.WEBHOOK_CONNECT_TIMEOUT_S + 60
        d.next_attempt_at = now + timedelta(seconds=lease)
        d.manual = False
        d.save(update_fields=["attempts", "next_attempt_at", "manual"])
        return d, d.attempts, manual


def delivery_attempt(*, delivery_id: int) -> WebhookAttempt | None:
    """One attempt of the delivery if it is due; None when it is not (or is gone)."""
    claimed = _claim(delivery_id, timezone.now())
    if claimed is None:
        return None
    d, number, manual = claimed
    body = event_body(d.event)
    try:
        secrets = endpoint_signing_secrets(d.endpoint)
    except InvalidToken:
        outcome = sender.Outcome(
            None, 0, "the endpoint's secret cannot be decrypted with the configured keys", "", ""
        )
    else:
        headers = [
            (signature.HEADER, signature.sign(secrets, body)),
            ("Gpupool-Event-Id", f"evt_{d.event_id}"),
            ("Gpupool-Event-Type", d.event.type),
            ("Gpupool-Delivery-Id", str(d.pk)),
            ("Gpupool-Attempt", str(number)),
        ]
        outcome = sender.post(
            d.endpoint.url,
            body,
            headers,
            allow_loopback=settings.WEBHOOK_ALLOW_LOOPBACK,
            timeout_s=settings.WEBHOOK_TIMEOUT_S,
            connect_timeout_s=settings.WEBHOOK_CONNECT_TIMEOUT_S,
            max_response_bytes=settings.WEBHOOK_MAX_RESPONSE_BYTES,
        )
    done = timezone.now()
    delay = None
    with transaction.atomic():
        d = lock_delivery(delivery_id=delivery_id)
        attempt = WebhookAttempt.objects.create(
            tenant_id=d.tenant_id,
            delivery=d,
            number=number,
            manual=manual,
            at=done,
            status=outcome.status,
            latency_ms=outcome.latency_ms,
            error=outcome.error[:500],
            response_excerpt=outcome.excerpt[:1024],
        )
        d.last_status, d.last_error = outcome.status, outcome.error[:500]
        if d.state != DeliveryState.PENDING:
            pass  # finished meanwhile (deleted endpoint's cascade, or a redelivery's own attempt)
        elif d.manual:
            pass  # a redelivery was asked for during this attempt: it is due as asked
        elif outcome.ok:
            d.state, d.delivered_at, d.next_attempt_at = DeliveryState.SUCCEEDED, done, None
        else:
            delay = retry_delay_s(number)
            due = done + timedelta(seconds=delay)
            if due > d.retry_until:
                d.state, d.next_attempt_at, delay = DeliveryState.FAILED, None, None
            else:
                d.next_attempt_at = due
        d.save(update_fields=["state", "delivered_at", "next_attempt_at", "last_status", "last_error"])
    logger.info(
        "webhook delivery %s attempt %s: %s %s (%d ms)",
        d.pk,
        number,
        outcome.status or "-",
        outcome.error or "ok",
        outcome.latency_ms,
    )
    # Retries this soon are queued with a countdown (no longer than the broker's visibility timeout
    # allows, portal/settings.py); later ones are sent by the sweeper (deliver_due).
    if delay is not None and delay <= settings.GPUPOOL_TASK_LONGEST_COUNTDOWN_S:
        from webhooks.tasks import deliver

        deliver.apply_async(args=[d.pk], countdown=delay)
    return attempt


def delivery_redeliver(*, delivery: WebhookDelivery, actor: Actor) -> WebhookDelivery:
    """Send it again now, by hand. A PENDING one is brought forward (its retries go on after);
    a finished one gets this one attempt."""
    now = timezone.now()
    with transaction.atomic():
        d = lock_delivery(delivery_id=delivery.pk)
        if not d.endpoint.enabled:
            raise Conflict("The endpoint is disabled; enable it to redeliver.", fields={"enabled": ["false"]})
        if d.state != DeliveryState.PENDING:
            d.retry_until = now
        d.state, d.next_attempt_at, d.manual = DeliveryState.PENDING, now, True
        d.save(update_fields=["state", "next_attempt_at", "manual", "retry_until"])
        audit_record(
            tenant=d.endpoint.tenant,
            actor=actor,
            action="webhook.redeliver",
            target=d,
            data={"endpoint": d.endpoint_id, "event": f"evt_{d.event_id}"},
        )
        pk = d.pk

        def enqueue() -> None:
            from webhooks.tasks import deliver

            deliver.delay(pk)

        transaction.on_commit(enqueue)
    return d


def deliveries_due(*, now: datetime | None = None, limit: int = 1000) -> list[int]:
    """Ids of PENDING deliveries that are due (retries past the countdown range, attempts a dead
    worker left claimed, first attempts whose queueing was lost), oldest first."""
    now = now or timezone.now()
    return list(
        WebhookDelivery.objects.filter(state=DeliveryState.PENDING, next_attempt_at__lte=now)
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:limit]
    )


def webhooks_purge(*, now: datetime | None = None) -> int:
    """Delete events older than the retention with no delivery still PENDING (their deliveries and
    attempts go with them). Returns how many events went."""
    from webhooks.models import WebhookEvent

    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.WEBHOOK_RETENTION_DAYS)
    old = WebhookEvent.objects.filter(created_at__lt=cutoff).exclude(deliveries__state=DeliveryState.PENDING)
    _, per_model = WebhookEvent.objects.filter(pk__in=list(old.values_list("pk", flat=True)[:10000])).delete()
    return per_model.get(WebhookEvent._meta.label, 0)
