"""The root group and what every command shares: the API client, ``--json``, the API's errors as
exit codes, and tables."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from decimal import Decimal
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from gpupool import config
from gpupool.client import Client
from gpupool.errors import ApiError, ConnectionFailed
from gpupool.models import Model

EXIT_API_ERROR = 1
EXIT_UNREACHABLE = 3

# Messages are whole lines (no wrapping at an imagined 80 columns in a pipe or a log).
err = Console(stderr=True, highlight=False, soft_wrap=True)


def out() -> Console:
    """stdout as it is now; in a pipe, whole lines (no wrapping at an imagined 80 columns)."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 10_000)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--profile", envvar="GPUPOOL_PROFILE", help="A saved profile (gpupool login --profile NAME).")
@click.option("--json", "json_output", is_flag=True, help="The API's objects as JSON, for every command.")
@click.version_option(package_name="gpupool")
@click.pass_context
def cli(ctx: click.Context, profile: str | None, json_output: bool) -> None:
    """gpupool: GPU instances and jobs from the command line.

    Configure with `gpupool login`, or GPUPOOL_URL and GPUPOOL_TOKEN in the environment."""
    ctx.ensure_object(dict)["profile"] = profile


def api_client(ctx: click.Context) -> Client:
    """The client of the profile (or the environment) in effect, made once per invocation."""
    obj = ctx.ensure_object(dict)
    if "client" not in obj:
        try:
            settings = config.resolve(obj.get("profile"))
        except config.NotConfigured as exc:
            raise click.ClickException(str(exc)) from exc
        obj["client"] = ctx.with_resource(Client(settings.url, settings.token))
    return obj["client"]


def _raw(value: Any) -> Any:
    if isinstance(value, Model):
        return value.raw
    if isinstance(value, list):
        return [_raw(v) for v in value]
    return value


def print_json(value: Any) -> None:
    click.echo(json.dumps(_raw(value), indent=2, default=str))


def _print_api_error(exc: ApiError) -> None:
    err.print(f"[red]error[/red] ({exc.status} {exc.code}): {exc.message}", markup=True)
    for name, problems in (exc.fields or {}).items():
        err.print(
            f"  {name}: {problems if not isinstance(problems, list) else '; '.join(map(str, problems))}"
        )


@contextlib.contextmanager
def api_errors(ctx: click.Context) -> Iterator[None]:
    """The API's refusal on stderr and exit 1; a portal that cannot be reached, exit 3."""
    try:
        yield
    except ApiError as exc:
        _print_api_error(exc)
        ctx.exit(EXIT_API_ERROR)
    except ConnectionFailed as exc:
        err.print(f"error: cannot reach the portal: {exc}")
        ctx.exit(EXIT_UNREACHABLE)


def api_command(group: click.Group, *args: Any, **kwargs: Any) -> Callable:
    """A command of ``group`` with ``--json``, and the API's errors turned into exit codes."""

    def decorate(fn: Callable) -> click.Command:
        @functools.wraps(fn)
        def run(*a: Any, json_output: bool, **kw: Any) -> None:
            ctx = click.get_current_context()
            as_json = json_output or ctx.find_root().params.get("json_output", False)
            with api_errors(ctx):
                fn(*a, as_json=as_json, **kw)

        run = click.option("--json", "json_output", is_flag=True, help="The API's objects as JSON.")(run)
        return group.command(*args, **kwargs)(click.pass_context(run))

    return decorate


def print_secret(as_json: bool, value: Any, message: str, secret: str) -> None:
    """A made object whose secret is shown this once: its JSON, or ``message`` on stderr and the
    secret alone on stdout (so a pipe gets only the secret)."""
    if as_json:
        print_json(value)
    else:
        err.print(message)
        click.echo(secret)


def print_table(columns: Iterable[str], rows: Iterable[Iterable[Any]]) -> None:
    table = Table(*columns, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    out().print(table)


def money(value: Any) -> str:
    """A price or amount for a table: its significant places, at least two (``2.4900000000`` ->
    ``2.49``, ``10`` -> ``10.00``); JSON output keeps the API's text."""
    if value in (None, ""):
        return "-"
    d = Decimal(str(value)).normalize()
    exponent = d.as_tuple().exponent
    return str(d.quantize(Decimal("0.01")) if isinstance(exponent, int) and exponent > -2 else d)


def when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else ""


def listing_group(name: str, help_text: str) -> click.Group:
    """A command group whose bare invocation lists (its ``list`` subcommand), with ``--json``."""

    @cli.group(name, invoke_without_command=True, help=help_text)
    @click.option("--json", "json_output", is_flag=True, help="As JSON.")
    @click.pass_context
    def group(ctx: click.Context, json_output: bool) -> None:
        if not ctx.invoked_subcommand:
            ctx.invoke(group.commands["list"], json_output=json_output)

    return group
