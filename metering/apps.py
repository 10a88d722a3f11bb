from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "metering"
    verbose_name = "Metering and billing"
    default_auto_field = "django.db.models.BigAutoField"
