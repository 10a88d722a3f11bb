"""Logging in, saved profiles, and API tokens."""

from __future__ import annotations

import click

from gpupool import config
from gpupool.cli.core import (
    api_client,
    api_command,
    api_errors,
    cli,
    err,
    listing_group,
    out,
    print_json,
    print_secret,
    print_table,
    when,
)
from gpupool.client import Client


@cli.command()
@click.option("--url", prompt="Portal URL", help="e.g. https://gpupool.example.com")
@click.option(
    "--token", prompt="API token", hide_input=True, help="An API token (gpp_...); prompted when not given."
)
@click.option(
    "--profile", "name", default=None, help="Profile name (default: the global --profile, else 'default')."
)
@click.option("--default/--no-default", "make_default", default=True, help="Make it the default profile.")
@click.option("--json", "json_output", is_flag=True, help="Who the token is (the API's /me/) as JSON.")
@click.pass_context
def login(
    ctx: click.Context, url: str, token: str, name: str | None, make_default: bool, json_output: bool
) -> None:
    """Check a portal URL and token, and save them as a profile."""
    name = name or ctx.obj.get("profile") or "default"
    with api_errors(ctx), Client(url, token) as c:
        me = c.me()
    where = config.save_profile(name, url, token, make_default=make_default)
    tenant = (me.tenant or {}).get("name", "?")
    err.print(f"Logged in to {url} as {tenant} (profile {name!r}; token in {where}).")
    if json_output or ctx.find_root().params.get("json_output"):
        print_json(me)


@cli.group(invoke_without_command=True)
@click.option("--json", "json_output", is_flag=True, help="As JSON.")
@click.pass_context
def profiles(ctx: click.Context, json_output: bool) -> None:
    """Saved profiles (the default marked *); `profiles rm NAME` forgets one."""
    if ctx.invoked_subcommand:
        return
    data = config.load_profiles()
    if json_output or ctx.find_root().params.get("json_output"):
        print_json({"default": data.get("default"), "profiles": data.get("profiles", {})})
        return
    rows = [
        ("*" if n == data.get("default") else "", n, p["url"]) for n, p in data.get("profiles", {}).items()
    ]
    print_table(["", "PROFILE", "URL"], rows)


@profiles.command("rm")
@click.argument("name")
def profiles_rm(name: str) -> None:
    """Forget a profile and its token."""
    if not config.remove_profile(name):
        raise click.ClickException(f"No profile named {name!r}.")


tokens = listing_group(
    "tokens", """API tokens (list); `tokens create NAME --scope read`, `tokens revoke ID`."""
)


@api_command(tokens, "list")
def tokens_list(ctx: click.Context, as_json: bool) -> None:
    """The tenant's API tokens."""
    items = list(api_client(ctx).tokens())
    if as_json:
        print_json(items)
        return
    print_table(["ID", "NAME", "PREFIX", "SCOPES", "STATUS", "EXPIRES", "LAST USED"],
                [(t.id, t.name, t.prefix, ",".join(t.scopes or []), t.status, when(t.expires_at), when(t.last_used_at))
                 for t in items])  # fmt: skip


@api_command(tokens, "create")
@click.argument("name")
@click.option(
    "--scope", "scopes", multiple=True, required=True, help="read, write, billing or admin (repeatable)."
)
@click.option("--expires-at", help="ISO 8601 time.")
def tokens_create(
    ctx: click.Context, as_json: bool, name: str, scopes: tuple[str, ...], expires_at: str | None
) -> None:
    """Make a token; its secret is printed this once."""
    t = api_client(ctx).create_token(name=name, scopes=list(scopes), expires_at=expires_at)
    print_secret(as_json, t, f"token {t.id} ({t.name}); the secret is shown once:", t.token)


@api_command(tokens, "revoke")
@click.argument("id", type=int)
def tokens_revoke(ctx: click.Context, as_json: bool, id: int) -> None:
    """Revoke a token."""
    t = api_client(ctx).revoke_token(id)
    print_json(t) if as_json else out().print(f"{t.id}\t{t.status}")
