"""Money: usage records, invoices and the budget."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import click

from gpupool.cli.core import api_client, api_command, cli, err, listing_group, print_json, print_table, when


@api_command(cli, "usage")
@click.option("--workload", type=int, help="Only this workload's.")
@click.option("--limit", type=int, default=100, show_default=True, help="At most this many records (0: all).")
def usage(ctx: click.Context, as_json: bool, workload: int | None, limit: int) -> None:
    """Usage records, newest first, with their amounts."""
    records = []
    for i, r in enumerate(api_client(ctx).usage(workload=workload)):
        if limit and i >= limit:
            break
        records.append(r)
    if as_json:
        print_json(records)
        return
    print_table(["ID", "WORKLOAD", "MODEL", "PLAN", "START", "END", "GPU-s", "AMOUNT"],
                [(r.id, r.workload, r.gpu_model, r.plan, when(r.start), when(r.end), r.gpu_seconds, r.amount)
                 for r in records])  # fmt: skip
    total = sum((r.amount or Decimal(0) for r in records), Decimal(0))
    err.print(f"{len(records)} records, total {total}")


invoices = listing_group("invoices", """Invoices (list); `invoices pdf ID [-o FILE]` downloads one.""")


@api_command(invoices, "list")
def invoices_list(ctx: click.Context, as_json: bool) -> None:
    """The tenant's invoices."""
    items = list(api_client(ctx).invoices())
    if as_json:
        print_json(items)
        return
    print_table(["ID", "PERIOD", "STATUS", "TOTAL", "CURRENCY"],
                [(i.id, f"{i.period_start} .. {i.period_end}", i.status, i.total, i.currency) for i in items])  # fmt: skip


@api_command(invoices, "pdf")
@click.argument("id", type=int)
@click.option(
    "--output", "-o", type=click.Path(dir_okay=False, writable=True), help="Default: invoice-ID.pdf."
)
def invoices_pdf(ctx: click.Context, as_json: bool, id: int, output: str | None) -> None:
    """Download an invoice's PDF."""
    data = api_client(ctx).invoice_pdf(id)
    path = Path(output or f"invoice-{id}.pdf")
    path.write_bytes(data)
    if as_json:
        print_json({"invoice": id, "path": str(path), "bytes": len(data)})
    else:
        err.print(f"saved {path} ({len(data)} bytes)")


@api_command(cli, "budget")
@click.option("--set", "monthly_limit", help="The monthly limit, in the tenant's currency.")
@click.option("--hard/--soft", "hard_limit", default=None, help="Hard: no new work past the limit.")
@click.option("--alerts", help="Alert thresholds in percent, e.g. 50,80,100.")
def budget(ctx: click.Context, as_json: bool, monthly_limit: str | None, hard_limit: bool | None,
           alerts: str | None) -> None:  # fmt: skip
    """This month's spend against the budget; --set, --hard/--soft and --alerts change it."""
    c = api_client(ctx)
    changes: dict[str, Any] = {}
    if monthly_limit is not None:
        changes["monthly_limit"] = monthly_limit
    if hard_limit is not None:
        changes["hard_limit"] = hard_limit
    if alerts is not None:
        try:
            changes["alert_thresholds"] = [int(a) for a in alerts.split(",") if a.strip()]
        except ValueError as exc:
            raise click.BadParameter(
                f"{alerts!r}: expected percents like 50,80,100", param_hint="--alerts"
            ) from exc
    if changes:
        current = c.budget()
        body = {"monthly_limit": current.monthly_limit, "hard_limit": current.hard_limit, **changes}
        if current.alert_thresholds and "alert_thresholds" not in body:
            body["alert_thresholds"] = current.alert_thresholds
        if body["monthly_limit"] is None:
            raise click.UsageError("There is no budget yet: give its limit with --set AMOUNT.")
        b = c.set_budget(**body)
    else:
        b = c.budget()
    if as_json:
        print_json(b)
        return
    print_table(["FIELD", "VALUE"], [("period", b.period_start), ("spent", f"{b.amount} {b.currency}"),
                                     ("limit", b.monthly_limit if b.monthly_limit is not None else "none"),
                                     ("used", f"{b.percent}%" if b.percent is not None else ""),
                                     ("hard limit", b.hard_limit), ("alerts at", ", ".join(map(str, b.alert_thresholds or [])))])  # fmt: skip
