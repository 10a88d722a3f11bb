"""Watching and steering workloads: ps, show, logs, ssh, open, stop, resize."""

from __future__ import annotations

import json
import os
import shutil
import sys
import webbrowser
from collections.abc import Iterable
from typing import Any

import click

from gpupool import config
from gpupool.cli.core import api_client, api_command, cli, out, print_json, print_table, when
from gpupool.client import Client
from gpupool.errors import ApiError


def _find_workload(c: Client, id: int, kind: str | None):
    """Ids are unique across instances and jobs: try the kind given, else jobs, then instances."""
    kinds = [kind] if kind else ["job", "instance"]
    for i, k in enumerate(kinds):
        try:
            return k, c.workload(k, id)
        except ApiError as exc:
            if exc.status != 404 or i == len(kinds) - 1:
                raise
    raise AssertionError("unreachable")


kind_option = click.option(
    "--kind", type=click.Choice(["job", "instance"]), help="Job or instance (found by id otherwise)."
)


@api_command(cli, "ps")
@click.option("--all", "-a", "show_all", is_flag=True, help="Finished ones too.")
@click.option("--kind", type=click.Choice(["job", "instance"]), help="Only jobs or only instances.")
@click.option("--state", multiple=True, help="Only these states (repeatable).")
@click.option(
    "--limit", type=int, default=50, show_default=True, help="At most this many of each kind (0: all)."
)
def ps(
    ctx: click.Context, as_json: bool, show_all: bool, kind: str | None, state: tuple[str, ...], limit: int
) -> None:
    """Your jobs and instances, newest first (the active ones unless --all)."""
    c = api_client(ctx)
    filters: dict[str, Any] = {"state": list(state) or None, "active": None if show_all or state else "true"}
    rows = []
    for k in [kind] if kind else ["job", "instance"]:
        for i, w in enumerate(c.workloads(k, **filters)):
            if limit and i >= limit:
                break
            rows.append(w)
    rows.sort(key=lambda w: w.id, reverse=True)
    if as_json:
        print_json(rows)
        return
    print_table(["ID", "KIND", "NAME", "STATE", "GPUS", "MODEL", "PLAN", "REGION", "SUBMITTED"],
                [(w.id, w.kind, w.name, w.state, w.gpu_count, ",".join(w.gpu_models or []), w.plan, w.region,
                  when(w.submitted_at)) for w in rows])  # fmt: skip


def _elastic_text(elastic: dict | None) -> str | None:
    if not elastic:
        return None
    return (f"{elastic['min_gpus']}-{elastic['max_gpus']} GPUs, asked for {elastic['target_gpus']}, "
            f"on resize: {elastic['on_resize']}")  # fmt: skip


@api_command(cli, "show")
@click.argument("id", type=int)
@kind_option
def show(ctx: click.Context, as_json: bool, id: int, kind: str | None) -> None:
    """One job or instance: state, placement, access."""
    _, w = _find_workload(api_client(ctx), id, kind)
    if as_json:
        print_json(w)
        return
    pending = w.pending or {}
    rows = [("id", w.id), ("kind", w.kind), ("name", w.name), ("state", w.state), ("reason", w.state_reason),
            ("waiting for", pending.get("message") or pending.get("reason")), ("image", w.image),
            ("command", " ".join(map(str, w.command or []))), ("gpus", f"{w.gpu_count} x {', '.join(w.gpu_models or [])}"),
            ("elastic", _elastic_text(w.elastic)),
            ("plan", w.plan), ("region", w.region), ("submitted", when(w.submitted_at)),
            ("started", when(w.started_at)), ("finished", when(w.finished_at)), ("exit code", w.exit_code)]  # fmt: skip
    for p in w.placement or []:
        rows.append(("placement", f"{p['node']} ({p['region']}) GPU {p['gpu_index']} {p['gpu_model']}"))
    access = w.access or {}
    if access.get("ssh"):
        rows.append(("ssh", access["ssh"]["command"]))
    for port in access.get("ports") or []:
        rows.append((f"port {port['port']}", port.get("url") or port.get("note") or ""))
    print_table(["FIELD", "VALUE"], [r for r in rows if r[1] not in (None, "")])


@api_command(cli, "logs")
@click.argument("id", type=int)
@kind_option
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until it ends.")
@click.option("--tail", type=int, default=100, show_default=True, help="The last N lines.")
def logs(ctx: click.Context, as_json: bool, id: int, kind: str | None, follow: bool, tail: int) -> None:
    """A workload's output (stdout and stderr)."""
    c = api_client(ctx)
    kind, _ = _find_workload(c, id, kind)
    if follow:
        lines: Iterable[dict] = c.follow_logs(kind, id)
    else:
        page = c.logs(kind, id, tail=tail)
        if as_json:
            print_json(page)
            return
        lines = page.lines or []
    for line in lines:
        if as_json:
            click.echo(json.dumps(line))  # one object a line while following
        else:
            click.echo(line["text"], err=line.get("stream") == "stderr")
        sys.stdout.flush()


@api_command(cli, "ssh")
@click.argument("id", type=int)
@click.argument("ssh_args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--identity", "-i", type=click.Path(exists=True, dir_okay=False), help="A private key file for ssh."
)
@click.option(
    "--option", "-o", "options", multiple=True, help="An ssh -o option, e.g. -o BatchMode=yes (repeatable)."
)
@click.option("--print", "print_only", is_flag=True, help="Print the ssh command instead of running it.")
def ssh(ctx: click.Context, as_json: bool, id: int, ssh_args: tuple[str, ...], identity: str | None,
        options: tuple[str, ...], print_only: bool) -> None:  # fmt: skip
    """A shell in a running workload through its node's agent (runs the real ssh); after `--`, a
    command to run there instead."""
    _, w = _find_workload(api_client(ctx), id, None)
    if ssh_args[:1] == ("--",):
        ssh_args = ssh_args[1:]
    access = w.access or {}
    info = access.get("ssh")
    if not info:
        raise ApiError(
            409, "ssh_unavailable", access.get("ssh_unavailable_reason") or "No SSH access to this workload."
        )
    # The endpoint's host key, as the portal vouches for it, in a file of ours (never ~/.ssh/).
    known_hosts = config.config_dir() / "known_hosts.d" / str(int(w.id))
    known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    known_hosts.write_text(info["known_hosts"] + "\n")
    keys = ["-i", identity, "-o", "IdentitiesOnly=yes"] if identity else []
    keys += [arg for option in options for arg in ("-o", option)]
    argv = ["ssh", "-p", str(info["port"]), *keys, "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", "StrictHostKeyChecking=yes", f"{info['user']}@{info['host']}", *ssh_args]  # fmt: skip
    if as_json:
        print_json({"ssh": info, "argv": argv})
        return
    if print_only:
        click.echo(" ".join(argv))
        return
    program = shutil.which(argv[0])
    if program is None:
        raise click.ClickException(f"{argv[0]} not found: install OpenSSH's client.")
    sys.stdout.flush()
    os.execv(program, argv)


@api_command(cli, "open")
@click.argument("id", type=int)
@click.argument("port", type=int)
@click.option("--browser", is_flag=True, help="Open it in the browser too.")
def open_port(ctx: click.Context, as_json: bool, id: int, port: int, browser: bool) -> None:
    """The proxy URL of an instance's HTTP PORT (printed; --browser opens it)."""
    _, w = _find_workload(api_client(ctx), id, "instance")
    ports = [p for p in (w.access or {}).get("ports") or [] if p["port"] == port]
    if not ports:
        raise ApiError(404, "not_found", f"Instance {id} does not publish port {port}.")
    entry = ports[0]
    if as_json:
        print_json(entry)
        return
    url = entry.get("url")
    if not url:
        raise ApiError(409, "port_unavailable", entry.get("note") or f"Port {port} has no URL yet.")
    click.echo(url)
    if browser:
        webbrowser.open(url)


@api_command(cli, "stop")
@click.argument("ids", type=int, nargs=-1, required=True)
@kind_option
def stop(ctx: click.Context, as_json: bool, ids: tuple[int, ...], kind: str | None) -> None:
    """Stop jobs or instances."""
    c = api_client(ctx)
    stopped = []
    for id in ids:
        k, _ = _find_workload(c, id, kind)
        stopped.append(c.stop_workload(k, id))
    if as_json:
        print_json(stopped)
    else:
        for w in stopped:
            out().print(f"{w.id}\t{w.state}")


@api_command(cli, "resize")
@click.argument("id", type=int)
@click.option(
    "--gpus", "gpu_count", type=int, required=True, help="The GPUs it should hold (within its bounds)."
)
def resize(ctx: click.Context, as_json: bool, id: int, gpu_count: int) -> None:
    """Resize a running elastic job: a shrink is at once, a growth as GPUs of its node free up."""
    w = api_client(ctx).resize_job(id, gpu_count)
    if as_json:
        print_json(w)
    else:
        target = (w.elastic or {}).get("target_gpus")
        out().print(f"{w.id}\t{w.state}\t{w.gpu_count} GPU(s) held, {target} asked for")
