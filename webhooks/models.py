"""Webhook endpoints, the events recorded for them, one delivery per (event, endpoint), and every
attempt of a delivery. The rules are in ``webhooks.services``."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone

from portal.tenancy import TenantOwnedModel


class WebhookEndpoint(TenantOwnedModel):
    """A tenant's receiver: a URL, the event types it wants, and the secret deliveries are signed
    with (encrypted at rest like tenant secrets; shown once, when made or rolled). A roll may keep
    the previous secret until ``previous_secret_expires_at``: until then deliveries carry a
    signature under each, so a receiver can switch without refusing any."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="webhook_endpoints")
    url = models.CharField(max_length=2000)
    description = models.CharField(max_length=200, blank=True, default="")
    event_types = models.JSONField(default=list, help_text='Event type names, or ["*"] for every type.')
    secret_ciphertext = models.TextField()
    # After a roll that keeps the old secret a while, deliveries are signed with both until then.
    previous_secret_ciphertext = models.TextField(blank=True, default="")
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["tenant", "enabled"], name="webhook_endpoint_tenant")]

    def __str__(self) -> str:
        return f"webhook {self.pk} ({self.url[:80]})"

    def wants(self, event_type: str) -> bool:
        return "*" in self.event_types or event_type in self.event_types


class WebhookEvent(TenantOwnedModel):
    """What happened, as delivered: ``payload`` is the whole JSON body every delivery sends."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    type = models.CharField(max_length=64)
    payload = models.JSONField()
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"event {self.pk} ({self.type})"


class DeliveryState(models.TextChoices):
    PENDING = "pending", "Pending"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


class WebhookDelivery(TenantOwnedModel):
    """One event to one endpoint. PENDING while attempts remain: ``next_attempt_at`` is when the
    next is due (a claimed attempt pushes it past the attempt's timeout, so a worker that dies
    mid-attempt leaves it due again). SUCCEEDED at the first 2xx; FAILED when the retry window
    closes. A redelivery by hand makes it PENDING and due now again."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    event = models.ForeignKey(WebhookEvent, on_delete=models.CASCADE, related_name="deliveries")
    state = models.CharField(max_length=16, choices=DeliveryState.choices, default=DeliveryState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    retry_until = models.DateTimeField(help_text="Automatic attempts stop here.")
    last_status = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    manual = models.BooleanField(default=False, help_text="The next attempt was asked for by hand.")

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["event", "endpoint"], name="webhook_delivery_once"),
            models.CheckConstraint(
                condition=~Q(state="pending") | Q(next_attempt_at__isnull=False),
                name="webhook_delivery_pending_is_due",
            ),
        ]
        indexes = [
            models.Index(
                fields=["next_attempt_at"], condition=Q(state="pending"), name="webhook_delivery_due"
            ),
            models.Index(fields=["endpoint", "-id"], name="webhook_delivery_endpoint"),
        ]

    def __str__(self) -> str:
        return f"delivery {self.pk} ({self.state})"


class WebhookAttempt(TenantOwnedModel):
    """One try: when, what came back (status or error), how long it took."""

    tenant = models.ForeignKey("portal.Tenant", on_delete=models.CASCADE, related_name="+")
    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    manual = models.BooleanField(default=False, help_text="A redelivery asked for by hand.")
    at = models.DateTimeField(default=timezone.now)
    status = models.PositiveIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(default=0)
    error = models.CharField(max_length=500, blank=True, default="")
    response_excerpt = models.CharField(max_length=1024, blank=True, default="")

    class Meta:
        ordering = ["delivery", "number"]
        constraints = [
            models.UniqueConstraint(fields=["delivery", "number"], name="webhook_attempt_number"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of delivery {self.delivery_id}"
