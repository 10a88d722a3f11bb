"""``gpupool``: the command line, built on ``gpupool.client``.

Every command takes ``--json`` (the API's objects on stdout, nothing else). A refusal prints the
API's message (and its fields) on stderr and exits 1; a portal that cannot be reached exits 3; a
usage error exits 2 (click's). Waits show a spinner on a terminal and nothing in a pipe.

``core`` holds the root group and what every command shares; each other module adds one domain's
commands to it when imported here.
"""

from __future__ import annotations

from gpupool.cli import (  # noqa: F401  (each registers its commands on the root group)
    account,
    billing,
    catalog,
    completion,
    run,
    storage,
    webhooks,
    workloads,
)
from gpupool.cli.core import cli

__all__ = ["cli", "main"]


def main() -> None:
    cli(prog_name="gpupool")
