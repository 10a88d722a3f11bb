from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "metering"
    verbose_name = "Metering and billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from metering import panels, views  # noqa: F401  (the dashboard panels, the sidebar entries)
        from metering.admission import budget_hard_limit_check, suspended_tenant_check
        from metering.pricing import provider
        from metering.services.payments import workloads_stop_on_suspension
        from portal.signals import tenant_suspended
        from scheduling.admission import register_admission_check
        from scheduling.pricing import register_price_provider

        tenant_suspended.connect(workloads_stop_on_suspension, dispatch_uid="metering-stop-on-suspension")
        from metering import demo
        from portal.signals import seed_demo_requested

        # After nodes' (the catalog and regions): apps' ready() run in INSTALLED_APPS order.
        seed_demo_requested.connect(demo.on_seed_demo_requested, dispatch_uid="metering.seed_demo")
        register_admission_check(suspended_tenant_check)
        register_admission_check(budget_hard_limit_check)
        register_price_provider(provider)
        from metering.metrics import register_collector

        register_collector()
