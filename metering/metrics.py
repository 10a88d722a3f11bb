"""Prometheus metrics of metering (registered on import; the web tier imports this module through
the webhook view, so ``/metrics`` exports them)."""

from __future__ import annotations

from prometheus_client import Counter

# result: ok (processed, ignored or a redelivery), failed (processing raised; Stripe retries),
# bad_signature (refused before reading it: signature, timestamp tolerance or payload).
STRIPE_WEBHOOKS = Counter(
    "gpupool_stripe_webhooks",
    "Stripe webhook deliveries received, by event type and result.",
    ["event_type", "result"],
)
