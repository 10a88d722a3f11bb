"""Prometheus metrics of metering: Stripe webhooks (a per-process counter: the web tier receives
them), the invoice run's last success and failure (stored by the Celery task, read at scrape time),
open billing alerts and revenue month-to-date (read at scrape time, cached for a minute). ``register_collector`` runs
in ``MeteringConfig.ready``."""

from __future__ import annotations

import time
from contextlib import contextmanager
from decimal import Decimal

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from portal.metrics import StoredCollector, StoredMetric, TtlCache, metrics_store_safely, register_once

# result: ok (processed, ignored or a redelivery), failed (processing raised; Stripe retries),
# bad_signature (refused before reading it: signature, timestamp tolerance or payload).
STRIPE_WEBHOOKS = Counter(
    "gpupool_stripe_webhooks",
    "Stripe webhook deliveries received, by event type and result.",
    ["event_type", "result"],
)

# --- stored by the invoice run (a Celery task), read by the web tier -----------------------------

INVOICE_RUN_LAST_SUCCESS = StoredMetric(
    "gpupool_invoice_run_last_success_timestamp_seconds",
    "Unix time of the last invoice run that finished (0: never).",
    "gauge",
)
INVOICE_RUN_LAST_FAILURE = StoredMetric(
    "gpupool_invoice_run_last_failure_timestamp_seconds",
    "Unix time of the last invoice run that failed (0: never).",
    "gauge",
)
REVENUE_CACHE_S = 60
_cache = TtlCache(REVENUE_CACHE_S)


@contextmanager
def invoice_run_recorded():
    """Stores the time of the block's (one invoice run's) success or failure; an exception
    propagates."""
    try:
        yield
    except Exception:
        metrics_store_safely(INVOICE_RUN_LAST_FAILURE.set(time.time()))
        raise
    metrics_store_safely(INVOICE_RUN_LAST_SUCCESS.set(time.time()))


def revenue_month_to_date() -> dict[tuple[str, str], Decimal]:
    """(currency, plan) -> rated usage of the current UTC month (usage records, unrounded)."""
    from django.db.models import F, Sum
    from django.utils import timezone

    from metering.models import UsageRecord

    month = timezone.now().date().replace(day=1)
    rows = (
        UsageRecord.objects.filter(period_start=month)
        .values("plan", currency=F("version__rate_card__currency"))
        .annotate(total=Sum("amount"))
        .order_by()
    )
    return {(r["currency"], r["plan"]): r["total"] for r in rows}


def billing_alerts_open() -> dict[str, int]:
    """Open billing alerts (metering.BillingAlert) by kind, every kind present (0 when none)."""
    from django.db.models import Count

    from metering.models import BillingAlert

    counts = dict.fromkeys(BillingAlert.Kind.values, 0)
    rows = (
        BillingAlert.objects.filter(resolved_at__isnull=True)
        .values("kind")
        .annotate(n=Count("id"))
        .order_by()
    )
    counts.update({r["kind"]: r["n"] for r in rows})
    return counts


def _live():
    alerts = GaugeMetricFamily(
        "gpupool_billing_alerts_open",
        "Billing alerts staff have not resolved (the admin's Billing alerts), by kind.",
        labels=["kind"],
    )
    for kind, n in sorted(_cache.get("billing_alerts", billing_alerts_open).items()):
        alerts.add_metric([kind], n)
    yield alerts
    revenue = GaugeMetricFamily(
        "gpupool_revenue_month_to_date",
        "Rated usage of the current UTC month, in currency units, by currency and plan.",
        labels=["currency", "plan"],
    )
    for (currency, plan), total in sorted(_cache.get("revenue", revenue_month_to_date).items()):
        revenue.add_metric([currency, plan], float(total))
    yield revenue


def register_collector() -> None:
    register_once(
        "metering", StoredCollector([INVOICE_RUN_LAST_SUCCESS, INVOICE_RUN_LAST_FAILURE], live=_live)
    )
