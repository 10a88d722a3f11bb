from django.apps import AppConfig


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Portal and tenancy"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from portal import checks, metrics, receivers  # noqa: F401  (checks, receivers: register)

        metrics.register_collector()
