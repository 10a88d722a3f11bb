from django.core.management.base import BaseCommand

from portal.demo import DEMO_LOGINS, DEMO_PASSWORD, demo_seed
from portal.signals import seed_demo_requested


class Command(BaseCommand):
    help = "Create the demo tenant, people, catalog and simulated fleet (idempotent)."

    def handle(self, *args, **options):
        tenant = demo_seed()
        seed_demo_requested.send(sender=self.__class__, tenant=tenant, stdout=self.stdout)
        self.stdout.write(self.style.SUCCESS(f"Demo data ready (tenant {tenant.slug!r})."))
        self.stdout.write(f"Demo logins (password for all: {DEMO_PASSWORD}):")
        for login in DEMO_LOGINS:
            self.stdout.write(f"  {login.email:<28} {login.role}")
