from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError

from nodes.models import Region
from nodes.services.registration import bootstrap_token_create
from portal.actors import Actor


class Command(BaseCommand):
    help = "Make a one-use bootstrap token for registering a node; prints it once."

    def add_arguments(self, parser):
        parser.add_argument("--region", required=True, help="Region code, e.g. us-east-1")
        parser.add_argument("--expires-in-hours", type=float, default=None, help="Default: never")
        parser.add_argument("--note", default="")

    def handle(self, *args, region, expires_in_hours, note, **options):
        region_obj = Region.objects.filter(code=region).first()
        if region_obj is None:
            known = ", ".join(Region.objects.values_list("code", flat=True)) or "none"
            raise CommandError(f"Unknown region {region!r} (known: {known}).")
        if expires_in_hours is not None and expires_in_hours <= 0:
            raise CommandError("--expires-in-hours must be positive.")
        token, plaintext = bootstrap_token_create(
            region=region_obj,
            actor=Actor.system(),
            expires_in=timedelta(hours=expires_in_hours) if expires_in_hours else None,
            note=note or "createnodetoken",
        )
        self.stdout.write(plaintext)
        expiry = f"expires {token.expires_at:%Y-%m-%d %H:%M} UTC" if token.expires_at else "never expires"
        self.stderr.write(f"Bootstrap token for region {region} ({expiry}); it is shown only this once.")
