from django.core.management.base import BaseCommand

from nodes.catalog import catalog_seed


class Command(BaseCommand):
    help = "Create or update the GPU model catalog from public specifications (idempotent)."

    def handle(self, *args, **options):
        created, updated = catalog_seed()
        self.stdout.write(self.style.SUCCESS(f"GPU catalog: {created} created, {updated} updated."))
