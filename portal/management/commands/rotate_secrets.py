"""Re-encrypt every tenant secret (and what other apps register: webhook signing secrets) under
the first key of SECRETS_ENCRYPTION_KEYS (key rotation)."""

from django.core.management.base import BaseCommand, CommandError

from portal.crypto import reencrypters
from portal.services.secrets import secrets_reencrypt


class Command(BaseCommand):
    help = (
        "Re-encrypt all tenant secrets under the first key of SECRETS_ENCRYPTION_KEYS. Rotation: put "
        "the new key first, run this, then remove the old key."
    )

    def handle(self, *args, **options):
        rotated, unreadable = secrets_reencrypt()
        self.stdout.write(f"Re-encrypted {rotated} secret(s) under the first key.")
        for what, reencrypt in reencrypters().items():  # other apps' values (webhook secrets)
            done, bad = reencrypt()
            self.stdout.write(f"Re-encrypted {done} {what} under the first key.")
            unreadable += bad
        if unreadable:
            raise CommandError(
                f"{unreadable} secret(s) could not be decrypted with any configured key: keep the key "
                "that encrypted them in SECRETS_ENCRYPTION_KEYS and run this again."
            )
