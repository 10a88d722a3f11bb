from django.apps import AppConfig
from django.db.models.signals import post_migrate


def _on_command_finished(sender, command, state, result, **kwargs) -> None:
    from nodes.models import CommandKind
    from nodes.services.mig import gpu_mig_on_command_finished

    if command.kind == CommandKind.CONFIGURE_MIG:
        gpu_mig_on_command_finished(command=command, state=state, result=result or {})


def _seed_catalog(sender, using="default", **kwargs) -> None:
    # After every migrate (and test database set-up): the catalog is there before any node registers.
    from nodes.catalog import catalog_seed

    catalog_seed(using=using)


class NodesConfig(AppConfig):
    name = "nodes"
    verbose_name = "Fleet"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from nodes import demo, live, metrics, signals, views  # noqa: F401  (live: staff events; views: the nav entry)
        from portal.signals import seed_demo_requested

        metrics.register_collector()
        seed_demo_requested.connect(demo.on_seed_demo_requested, dispatch_uid="nodes.seed_demo")
        post_migrate.connect(_seed_catalog, sender=self, dispatch_uid="nodes.seed_catalog")
        signals.command_finished.connect(_on_command_finished, dispatch_uid="nodes.mig_configured")
