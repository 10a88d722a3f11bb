from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from scheduling import receivers, views  # noqa: F401  (views: the nav entries and panel)

        receivers.connect()
        from scheduling.metrics import register_collector

        register_collector()
