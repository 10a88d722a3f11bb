from django.core.management.base import BaseCommand, CommandError

from portal.actors import Actor
from portal.errors import DomainError
from portal.services.tenants import tenant_create


class Command(BaseCommand):
    help = "Create a tenant and its owner (the owner is created without a password if new)."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--name", required=True)
        parser.add_argument("--owner-email", required=True)
        parser.add_argument("--billing-email")
        parser.add_argument("--currency", default="USD")

    def handle(self, *args, slug, name, owner_email, billing_email, currency, **options):
        try:
            tenant = tenant_create(
                slug=slug,
                name=name,
                owner_email=owner_email,
                billing_email=billing_email,
                currency=currency,
                actor=Actor.system(),
            )
        except DomainError as exc:
            details = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.fields.items())
            raise CommandError(f"{exc.message} {details}".strip()) from exc
        self.stdout.write(
            self.style.SUCCESS(f"Created tenant {tenant.slug} (id {tenant.pk}), owner {owner_email}.")
        )
