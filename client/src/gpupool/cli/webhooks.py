"""Webhook endpoints, their event types and deliveries."""

from __future__ import annotations

from typing import Any

import click

from gpupool.cli.core import (
    api_client,
    api_command,
    err,
    listing_group,
    out,
    print_json,
    print_secret,
    print_table,
    when,
)

webhooks = listing_group(
    "webhooks",
    """Webhook endpoints (list); `webhooks create URL --event TYPE`, `update`, `rm`, `roll-secret`,
    `events` (the types), `deliveries`, `delivery ID` (its attempts), `redeliver ID`. Receivers check
    each delivery with gpupool.webhooks.verify.""",
)


@api_command(webhooks, "list")
def webhooks_list(ctx: click.Context, as_json: bool) -> None:
    """The team's webhook endpoints."""
    items = list(api_client(ctx).webhooks())
    if as_json:
        print_json(items)
        return
    print_table(["ID", "URL", "EVENTS", "ENABLED", "DESCRIPTION"],
                [(e.id, e.url, ",".join(e.event_types or []), "yes" if e.enabled else "no", e.description)
                 for e in items])  # fmt: skip


def _print_secret(as_json: bool, e: Any, what: str) -> None:
    print_secret(as_json, e, f"webhook {e.id} {what}; its signing secret is shown once:", e.secret)


@api_command(webhooks, "create")
@click.argument("url")
@click.option(
    "--event", "events", multiple=True, help="An event type (repeatable; default: every type, '*')."
)
@click.option("--description", help="A note for the team.")
@click.option("--disabled", is_flag=True, help="Made, but sent nothing until enabled.")
def webhooks_create(ctx: click.Context, as_json: bool, url: str, events: tuple[str, ...],
                    description: str | None, disabled: bool) -> None:  # fmt: skip
    """Send the team's events to URL (https, on a public address); prints the signing secret once."""
    e = api_client(ctx).create_webhook(url=url, event_types=list(events) or ["*"], description=description,
                                    enabled=False if disabled else None)  # fmt: skip
    _print_secret(as_json, e, "made")


@api_command(webhooks, "update")
@click.argument("id", type=int)
@click.option("--url")
@click.option("--event", "events", multiple=True, help="The event types, all of them (repeatable).")
@click.option("--description")
@click.option("--enable/--disable", "enabled", default=None, help="Send deliveries, or stop.")
def webhooks_update(ctx: click.Context, as_json: bool, id: int, url: str | None, events: tuple[str, ...],
                    description: str | None, enabled: bool | None) -> None:  # fmt: skip
    """Change an endpoint's URL, event types, description, or enable or disable it."""
    changes = {
        "url": url,
        "event_types": list(events) or None,
        "description": description,
        "enabled": enabled,
    }
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        raise click.UsageError("Nothing to change: give --url, --event, --description or --enable/--disable.")
    e = api_client(ctx).update_webhook(id, **changes)
    print_json(e) if as_json else out().print(f"{e.id}\t{e.url}\t{'enabled' if e.enabled else 'disabled'}")


@api_command(webhooks, "rm")
@click.argument("id", type=int)
def webhooks_rm(ctx: click.Context, as_json: bool, id: int) -> None:
    """Delete an endpoint with its delivery log (pending deliveries are never sent)."""
    api_client(ctx).delete_webhook(id)
    if as_json:
        print_json({"deleted": id})


def _duration(value: str) -> int:
    """Seconds from ``90``, ``90s``, ``30m``, ``24h`` or ``7d``."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (value[:-1], value[-1]) if value[-1:] in units else (value, "s")
    if not number.isdigit():
        raise click.BadParameter(
            f"{value!r}: expected seconds, or a number with s, m, h or d", param_hint="--keep-old"
        )
    return int(number) * units[unit]


@api_command(webhooks, "roll-secret")
@click.argument("id", type=int)
@click.option(
    "--keep-old",
    "keep_old",
    default="0",
    show_default=True,
    help="How long the old secret keeps signing deliveries beside the new one (e.g. 24h; at most 7d).",
)
def webhooks_roll_secret(ctx: click.Context, as_json: bool, id: int, keep_old: str) -> None:
    """A new signing secret, printed once; deliveries from now on are signed with it, and for
    --keep-old with the old one too, so the receiver can take the new one meanwhile."""
    e = api_client(ctx).roll_webhook_secret(id, expire_previous_in_s=_duration(keep_old))
    _print_secret(as_json, e, "has a new secret")
    if not as_json and e.previous_secret_expires_at:
        err.print(
            f"The old secret signs deliveries too until {e.previous_secret_expires_at:%Y-%m-%d %H:%M %Z}."
        )


@api_command(webhooks, "events")
def webhooks_events(ctx: click.Context, as_json: bool) -> None:
    """The event types an endpoint may ask for."""
    items = api_client(ctx).webhook_event_types()
    if as_json:
        print_json(items)
        return
    print_table(["EVENT", "WHAT"], [(t.name, t.description) for t in items])


@api_command(webhooks, "deliveries")
@click.option("--endpoint", type=int, help="Only this endpoint's.")
@click.option(
    "--state", type=click.Choice(["pending", "succeeded", "failed"]), help="Only deliveries in this state."
)
@click.option("--limit", type=int, default=50, show_default=True, help="At most this many (0: all).")
def webhooks_deliveries(ctx: click.Context, as_json: bool, endpoint: int | None, state: str | None,
                        limit: int) -> None:  # fmt: skip
    """Each event sent to each endpoint, newest first."""
    items = []
    for i, d in enumerate(api_client(ctx).webhook_deliveries(endpoint=endpoint, state=state)):
        if limit and i >= limit:
            break
        items.append(d)
    if as_json:
        print_json(items)
        return
    print_table(["ID", "ENDPOINT", "EVENT", "TYPE", "STATE", "ATTEMPTS", "LAST", "NEXT ATTEMPT"],
                [(d.id, d.endpoint, d.event_id, d.event_type, d.state, d.attempts,
                  d.last_status or d.last_error, when(d.next_attempt_at)) for d in items])  # fmt: skip


@api_command(webhooks, "delivery")
@click.argument("id", type=int)
def webhooks_delivery(ctx: click.Context, as_json: bool, id: int) -> None:
    """One delivery: its state and every attempt (status, latency, error)."""
    d = api_client(ctx).webhook_delivery(id)
    if as_json:
        print_json(d)
        return
    err.print(f"delivery {d.id} of {d.event_id} ({d.event_type}) to endpoint {d.endpoint}: {d.state}")
    print_table(["#", "AT", "STATUS", "LATENCY ms", "ERROR", "BY HAND"],
                [(a["number"], a["at"], a["status"], a["latency_ms"], a["error"], "yes" if a["manual"] else "")
                 for a in d.attempt_log or []])  # fmt: skip


@api_command(webhooks, "redeliver")
@click.argument("id", type=int)
def webhooks_redeliver(ctx: click.Context, as_json: bool, id: int) -> None:
    """Send a delivery again now."""
    d = api_client(ctx).redeliver_webhook(id)
    print_json(d) if as_json else out().print(f"{d.id}\t{d.state}")
