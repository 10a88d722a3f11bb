"""Shell completion scripts."""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

from gpupool.cli.core import cli


@cli.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the completion script: `eval "$(gpupool completion bash)"` (zsh and fish alike)."""
    completer = get_completion_class(shell)
    click.echo(completer(cli, {}, "gpupool", "_GPUPOOL_COMPLETE").source())
