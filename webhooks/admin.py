"""Staff pages for webhooks: read-only views of tenants' endpoints, their events, deliveries and
attempts (support looks here when a team says a delivery never came). Endpoints change through the
tenant's API and page, where the services check the address and audit the change; the signing
secret is never shown."""

from __future__ import annotations

from django.contrib import admin

from portal.admin_actions import RecordAdmin
from webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(RecordAdmin):
    list_display = ["id", "tenant", "url", "enabled", "created_at"]
    list_filter = ["enabled"]
    search_fields = ["url", "tenant__slug"]
    list_select_related = ["tenant"]
    exclude = ["secret_ciphertext", "previous_secret_ciphertext"]


@admin.register(WebhookEvent)
class WebhookEventAdmin(RecordAdmin):
    list_display = ["id", "tenant", "type", "created_at"]
    list_filter = ["type"]
    search_fields = ["tenant__slug"]
    list_select_related = ["tenant"]


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(RecordAdmin):
    list_display = [
        "id",
        "tenant",
        "endpoint",
        "event",
        "state",
        "attempts",
        "last_status",
        "next_attempt_at",
    ]
    list_filter = ["state"]
    search_fields = ["tenant__slug", "endpoint__url"]
    list_select_related = ["tenant", "endpoint", "event"]


@admin.register(WebhookAttempt)
class WebhookAttemptAdmin(RecordAdmin):
    list_display = ["delivery", "number", "manual", "at", "status", "latency_ms", "error"]
    list_filter = ["manual"]
    search_fields = ["delivery__endpoint__url", "tenant__slug"]
    list_select_related = ["delivery__endpoint"]
