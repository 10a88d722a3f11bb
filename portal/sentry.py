"""Optional error reporting to Sentry (``SENTRY_DSN``): Django and Celery integrations, no personal
data, traces only when ``SENTRY_TRACES_SAMPLE_RATE`` is above 0. Settings call ``sentry_init`` only
when the DSN is set, so without it the SDK is never initialised (and never imported). Events carry
the log context's ids (request, task, workload, tenant) as tags, so an event and its log lines
can be found from each other."""

from __future__ import annotations

TAGGED = ("request_id", "task_id", "task_name", "workload_id", "tenant_id")


def _tag_with_log_context(event, hint):
    from portal.logging import log_context_get

    tags = event.setdefault("tags", {})
    for key, value in log_context_get().items():
        if key in TAGGED:
            tags.setdefault(key, str(value))
    return event


def sentry_init(*, dsn: str, environment: str, release: str | None, traces_sample_rate: float) -> None:
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration
    from sentry_sdk.integrations.django import DjangoIntegration
    from sentry_sdk.integrations.logging import LoggingIntegration

    sentry_sdk.init(
        dsn=dsn,
        environment=environment,
        release=release,
        traces_sample_rate=traces_sample_rate,
        send_default_pii=False,
        before_send=_tag_with_log_context,
        integrations=[DjangoIntegration(), CeleryIntegration(), LoggingIntegration()],
    )
