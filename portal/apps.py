from django.apps import AppConfig


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Portal and tenancy"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from portal import checks, metrics  # noqa: F401  (checks: registers system checks)

        metrics.register_collector()
