from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "webhooks"
    verbose_name = "Webhooks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from portal.signals import tenant_events
        from webhooks import views  # noqa: F401  (the nav entry)
        from webhooks.services.events import on_tenant_events

        tenant_events.connect(on_tenant_events, dispatch_uid="webhooks.tenant_events")
