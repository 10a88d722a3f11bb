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
        from portal.crypto import reencrypt_register
        from webhooks.services.endpoints import endpoints_reencrypt

        reencrypt_register("webhook secret(s)", endpoints_reencrypt)
