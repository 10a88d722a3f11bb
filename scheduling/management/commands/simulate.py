"""``manage.py simulate inflation|replay ...``: the trace simulator on the same engine as the live
scheduler (no database). See ``scheduling/simulator``."""

from django.core.management.base import BaseCommand, CommandError

from scheduling.simulator.cli import add_arguments, run
from scheduling.simulator.trace import TraceError


class Command(BaseCommand):
    help = "Run the scheduling engine on an Alibaba cluster-trace-gpu-v2023 trace (inflation or replay)."
    requires_system_checks: list = []

    def add_arguments(self, parser):
        add_arguments(parser)

    def handle(self, *args, **options):
        try:
            run(options, self.stdout)
        except (TraceError, OSError) as e:
            raise CommandError(str(e)) from e
