import json

from django.core.management.base import BaseCommand, CommandError

from nodes.services.slurm import region_slurm_set
from portal.actors import Actor
from portal.errors import DomainError


class Command(BaseCommand):
    help = (
        "Connect a Slurm cluster as a region (or change its configuration): the configuration is a "
        "JSON file (docs/slurm.md lists its keys); the cluster's inventory is read once to check it."
    )

    def add_arguments(self, parser):
        parser.add_argument("code", help="Region code, e.g. hpc-1")
        parser.add_argument("--name", required=True, help="Display name")
        parser.add_argument("--config", required=True, help="Path of the JSON configuration")
        parser.add_argument("--no-check", action="store_true", help="Save without asking Slurm")

    def handle(self, *args, code, name, config, no_check, **options):
        try:
            with open(config, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read {config}: {exc}") from exc
        try:
            region, inventory = region_slurm_set(
                code=code, name=name, slurm=data, actor=Actor.system(), check=not no_check
            )
        except DomainError as exc:
            raise CommandError(f"{exc.message} {exc.fields or ''}".strip()) from exc
        self.stdout.write(f"Region {region.code} is a Slurm region.")
        if inventory is not None:
            self.stdout.write(f"Slurm lists {inventory.nodes} node(s) with {inventory.gpus} GPU(s).")
