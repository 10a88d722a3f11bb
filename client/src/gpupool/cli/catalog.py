"""What can be asked for: GPU models with prices and free GPUs, and templates."""

from __future__ import annotations

import click

from gpupool.cli.core import api_client, api_command, cli, money, print_json, print_table


@api_command(cli, "gpus")
@click.option("--region", help="Only this region.")
def gpus(ctx: click.Context, as_json: bool, region: str | None) -> None:
    """The GPU catalog: price per GPU-hour by plan, and free GPUs per region."""
    types = api_client(ctx).gpu_types()
    if region:
        for t in types:
            t.availability = [a for a in t.availability or [] if a["region"] == region]
            t.raw = {**t.raw, "availability": t.availability}
    if as_json:
        print_json(types)
        return
    rows = []
    for t in types:
        for a in t.availability or [{}]:
            prices = a.get("price_per_gpu_hour") or {}
            rows.append((t.name, t.memory_gib, a.get("region", ""), a.get("free_gpus", ""), a.get("total_gpus", ""),
                         *(money(prices.get(p)) for p in ("on_demand", "spot", "reserved"))))  # fmt: skip
    print_table(["MODEL", "GiB", "REGION", "FREE", "TOTAL", "ON-DEMAND/h", "SPOT/h", "RESERVED/h"], rows)


@api_command(cli, "templates")
def templates(ctx: click.Context, as_json: bool) -> None:
    """Templates: the catalog's and the tenant's own."""
    items = list(api_client(ctx).templates())
    if as_json:
        print_json(items)
        return
    print_table(["NAME", "SOURCE", "IMAGE", "DESCRIPTION"],
                [(t.name, "catalog" if t.catalog else "tenant", t.image, t.description) for t in items])  # fmt: skip
