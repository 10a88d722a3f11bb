from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from portal.actors import Actor
from portal.errors import DomainError
from portal.models import Scope, Tenant, User
from portal.services.tokens import api_token_create


class Command(BaseCommand):
    help = "Create an API token for a tenant and print it once (it is stored hashed)."

    def add_arguments(self, parser):
        parser.add_argument("tenant", help="tenant slug")
        parser.add_argument("--name", required=True)
        parser.add_argument(
            "--scope",
            action="append",
            dest="scopes",
            choices=Scope.values,
            help="repeat for several scopes (default: read)",
        )
        parser.add_argument("--expires-in-days", type=int)
        parser.add_argument("--user", help="email of the member the token acts for (audit)")

    def handle(self, *args, tenant, name, scopes, expires_in_days, user, **options):
        tenant_obj = Tenant.objects.filter(slug=tenant).first()
        if tenant_obj is None:
            raise CommandError(f"No tenant with slug {tenant!r}.")
        actor = Actor.system()
        if user:
            person = User.objects.filter(email__iexact=user).first()
            if person is None or not person.memberships.filter(tenant=tenant_obj).exists():
                raise CommandError(f"{user} is not a member of {tenant}.")
            actor = Actor(user=person)
        if expires_in_days is not None and expires_in_days <= 0:
            raise CommandError("--expires-in-days must be positive.")
        expires_at = timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None
        try:
            token, plaintext = api_token_create(
                tenant=tenant_obj,
                name=name,
                scopes=scopes or [Scope.READ],
                expires_at=expires_at,
                actor=actor,
            )
        except DomainError as exc:
            raise CommandError(exc.message) from exc
        self.stderr.write(
            f"Token {token.display_prefix} for {tenant_obj.slug}, scopes {', '.join(token.scopes)}."
        )
        self.stderr.write("Store it now: it cannot be shown again.")
        self.stdout.write(plaintext)
