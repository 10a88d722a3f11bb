from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from portal.actors import Actor
from portal.errors import DomainError
from portal.models import StaffScope, User
from portal.staff_tokens import staff_token_create


class Command(BaseCommand):
    help = "Create a staff token (staff API only) for a staff person and print it once (it is stored hashed)."

    def add_arguments(self, parser):
        parser.add_argument("user", help="email of the staff person the token acts for")
        parser.add_argument("--name", required=True)
        parser.add_argument(
            "--scope",
            action="append",
            dest="scopes",
            choices=StaffScope.values,
            required=True,
            help="repeat for several scopes",
        )
        parser.add_argument("--expires-in-days", type=int)

    def handle(self, *args, user, name, scopes, expires_in_days, **options):
        person = User.objects.filter(email__iexact=user).first()
        if person is None:
            raise CommandError(f"No person with email {user!r}.")
        if expires_in_days is not None and expires_in_days <= 0:
            raise CommandError("--expires-in-days must be positive.")
        expires_at = timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None
        try:
            token, plaintext = staff_token_create(
                user=person, name=name, scopes=scopes, expires_at=expires_at, actor=Actor.system()
            )
        except DomainError as exc:
            raise CommandError(exc.message) from exc
        self.stderr.write(
            f"Staff token {token.display_prefix} for {person.email}, scopes {', '.join(token.scopes)}."
        )
        self.stderr.write("Store it now: it cannot be shown again.")
        self.stdout.write(plaintext)
