from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from scheduling import receivers, views  # noqa: F401  (views: the nav entries and panel)

        receivers.connect()
        from portal.signals import seed_demo_requested
        from scheduling import demo

        seed_demo_requested.connect(demo.on_seed_demo_requested, dispatch_uid="scheduling.seed_demo")
        from nodes.services.logs import log_sink_register
        from scheduling.services.logs import workload_logs_ingest

        log_sink_register(workload_logs_ingest)
        from scheduling.metrics import register_collector

        register_collector()
        from nodes.agent_ssh import register_ssh_keys_source
        from scheduling.selectors.access import ssh_authorized_keys

        register_ssh_keys_source(ssh_authorized_keys)
        from nodes.services.rollouts import rollout_drain_register
        from scheduling.services.drain import node_work_counts, node_work_notice

        rollout_drain_register(work=node_work_counts, notice=node_work_notice)
