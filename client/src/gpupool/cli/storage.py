"""Volumes and secrets."""

from __future__ import annotations

import sys

import click

from gpupool.cli.core import api_client, api_command, err, listing_group, out, print_json, print_table, when

volumes = listing_group(
    "volumes", """Volumes (list); `volumes create NAME --region R --size GiB`, `volumes rm ID`."""
)


@api_command(volumes, "list")
def volumes_list(ctx: click.Context, as_json: bool) -> None:
    """The tenant's volumes."""
    vols = list(api_client(ctx).volumes())
    if as_json:
        print_json(vols)
        return
    print_table(["ID", "NAME", "REGION", "SIZE GiB", "USED", "STATE", "IN USE BY"],
                [(v.id, v.name, v.region, v.size_gib, v.used_bytes, v.state, ",".join(map(str, v.in_use_by or [])))
                 for v in vols])  # fmt: skip


@api_command(volumes, "create")
@click.argument("name")
@click.option("--region", required=True)
@click.option("--size", "size_gib", type=int, required=True, help="GiB.")
def volumes_create(ctx: click.Context, as_json: bool, name: str, region: str, size_gib: int) -> None:
    """Make a volume."""
    v = api_client(ctx).create_volume(name=name, region=region, size_gib=size_gib)
    print_json(v) if as_json else out().print(f"{v.id}\t{v.name}")


@api_command(volumes, "rm")
@click.argument("id", type=int)
def volumes_rm(ctx: click.Context, as_json: bool, id: int) -> None:
    """Delete a volume (and its data)."""
    api_client(ctx).delete_volume(id)
    if as_json:
        print_json({"deleted": id})


secrets = listing_group(
    "secrets",
    """Secrets (names only); `secrets set NAME` (value from stdin or a prompt), `secrets rm NAME`.""",
)


@api_command(secrets, "list")
def secrets_list(ctx: click.Context, as_json: bool) -> None:
    """The tenant's secrets, by name."""
    items = list(api_client(ctx).secrets())
    if as_json:
        print_json(items)
        return
    print_table(
        ["NAME", "CREATED", "UPDATED"], [(s.name, when(s.created_at), when(s.updated_at)) for s in items]
    )


@api_command(secrets, "set")
@click.argument("name")
def secrets_set(ctx: click.Context, as_json: bool, name: str) -> None:
    """Make a secret; its value is read from stdin (or prompted for on a terminal)."""
    if sys.stdin.isatty():
        value = click.prompt("Value", hide_input=True)
    else:
        value = sys.stdin.read().removesuffix("\n")
    s = api_client(ctx).create_secret(name=name, value=value)
    print_json(s) if as_json else err.print(f"secret {s.name} saved")


@api_command(secrets, "rm")
@click.argument("name")
def secrets_rm(ctx: click.Context, as_json: bool, name: str) -> None:
    """Delete a secret."""
    api_client(ctx).delete_secret(name)
    if as_json:
        print_json({"deleted": name})
