from datetime import timedelta

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from nodes.models import Node, Region
from nodes.services.registration import bootstrap_token_create, node_rekey_token_create
from portal.actors import Actor

NEVER_WARNING = (
    "WARNING: this token never expires. Until it is used, anyone who reads it can register a "
    "node; prefer an expiry (the default is {hours} h)."
)


class Command(BaseCommand):
    help = (
        "Make a one-use bootstrap token for registering a new node (--region), or for re-keying an "
        "existing node whose server was reinstalled (--rekey HOSTNAME); prints it once."
    )

    def add_arguments(self, parser):
        target = parser.add_mutually_exclusive_group(required=True)
        target.add_argument("--region", help="Region code of a new node, e.g. us-east-1")
        target.add_argument(
            "--rekey",
            metavar="HOSTNAME",
            help="An existing node: the token registers this hostname only and replaces its credential",
        )
        expiry = parser.add_mutually_exclusive_group()
        expiry.add_argument(
            "--expires-in-hours",
            type=float,
            default=None,
            help=f"Default: {settings.NODE_BOOTSTRAP_TOKEN_TTL_H} (NODE_BOOTSTRAP_TOKEN_TTL_H)",
        )
        expiry.add_argument(
            "--expires", choices=["never"], help="'never': a token that does not expire (with a warning)"
        )
        parser.add_argument("--note", default="")

    def handle(self, *args, region, rekey, expires_in_hours, expires, note, **options):
        if expires_in_hours is not None and expires_in_hours <= 0:
            raise CommandError("--expires-in-hours must be positive.")
        expires_in = timedelta(hours=expires_in_hours) if expires_in_hours else None
        never = expires == "never"
        if rekey:
            node = Node.objects.filter(hostname=rekey).first()
            if node is None:
                raise CommandError(f"No node is registered as {rekey!r}.")
            if never:
                raise CommandError("A re-key token must expire: leave out --expires never.")
            token, plaintext = node_rekey_token_create(node=node, actor=Actor.system(), expires_in=expires_in)
            what = f"re-keys node {node.hostname} only"
        else:
            region_obj = Region.objects.filter(code=region).first()
            if region_obj is None:
                known = ", ".join(Region.objects.values_list("code", flat=True)) or "none"
                raise CommandError(f"Unknown region {region!r} (known: {known}).")
            token, plaintext = bootstrap_token_create(
                region=region_obj,
                actor=Actor.system(),
                expires_in=expires_in,
                never_expires=never,
                note=note or "createnodetoken",
            )
            what = f"registers a new node in region {region}"
        self.stdout.write(plaintext)
        expiry = f"expires {token.expires_at:%Y-%m-%d %H:%M} UTC" if token.expires_at else "never expires"
        self.stderr.write(f"Bootstrap token: {what} ({expiry}); it is shown only this once.")
        if token.expires_at is None:
            self.stderr.write(NEVER_WARNING.format(hours=settings.NODE_BOOTSTRAP_TOKEN_TTL_H))
