from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "nodes"
    verbose_name = "Fleet"
    default_auto_field = "django.db.models.BigAutoField"
