"""``gpupool``: the command line, built on ``gpupool.client``.

Every command takes ``--json`` (the API's objects on stdout, nothing else). A refusal prints the
API's message (and its fields) on stderr and exits 1; a portal that cannot be reached exits 3; a
usage error exits 2 (click's). Waits show a spinner on a terminal and nothing in a pipe.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
import webbrowser
from collections.abc import Callable, Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any

import click
import yaml
from click.shell_completion import get_completion_class
from rich.console import Console
from rich.table import Table

from gpupool import config
from gpupool.client import TERMINAL_STATES, Client
from gpupool.errors import ApiError, ConnectionFailed
from gpupool.models import Model

EXIT_API_ERROR = 1
EXIT_UNREACHABLE = 3

# Messages are whole lines (no wrapping at an imagined 80 columns in a pipe or a log).
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _out() -> Console:
    """stdout as it is now; in a pipe, whole lines (no wrapping at an imagined 80 columns)."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 10_000)


# --- plumbing -------------------------------------------------------------------------------------


def _client(ctx: click.Context) -> Client:
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


def _print_json(value: Any) -> None:
    click.echo(json.dumps(_raw(value), indent=2, default=str))


def _fail(exc: ApiError) -> None:
    err.print(f"[red]error[/red] ({exc.status} {exc.code}): {exc.message}", markup=True)
    for name, problems in (exc.fields or {}).items():
        err.print(
            f"  {name}: {problems if not isinstance(problems, list) else '; '.join(map(str, problems))}"
        )


def api_command(group: click.Group, *args: Any, **kwargs: Any) -> Callable:
    """A command of ``group`` with ``--json``, and the API's errors turned into exit codes."""

    def decorate(fn: Callable) -> click.Command:
        @functools.wraps(fn)
        def run(*a: Any, json_output: bool, **kw: Any) -> None:
            ctx = click.get_current_context()
            as_json = json_output or ctx.find_root().params.get("json_output", False)
            try:
                fn(*a, as_json=as_json, **kw)
            except ApiError as exc:
                _fail(exc)
                ctx.exit(EXIT_API_ERROR)
            except ConnectionFailed as exc:
                err.print(f"error: cannot reach the portal: {exc}")
                ctx.exit(EXIT_UNREACHABLE)

        run = click.option("--json", "json_output", is_flag=True, help="The API's objects as JSON.")(run)
        return group.command(*args, **kwargs)(click.pass_context(run))

    return decorate


def _table(columns: Iterable[str], rows: Iterable[Iterable[Any]]) -> None:
    table = Table(*columns, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    _out().print(table)


def _money(value: Any) -> str:
    """A price or amount for a table: its significant places, at least two (``2.4900000000`` ->
    ``2.49``, ``10`` -> ``10.00``); JSON output keeps the API's text."""
    if value in (None, ""):
        return "-"
    d = Decimal(str(value)).normalize()
    exponent = d.as_tuple().exponent
    return str(d.quantize(Decimal("0.01")) if isinstance(exponent, int) and exponent > -2 else d)


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else ""


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


# --- the group ------------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--profile", envvar="GPUPOOL_PROFILE", help="A saved profile (gpupool login --profile NAME).")
@click.option("--json", "json_output", is_flag=True, help="The API's objects as JSON, for every command.")
@click.version_option(package_name="gpupool")
@click.pass_context
def cli(ctx: click.Context, profile: str | None, json_output: bool) -> None:
    """gpupool: GPU instances and jobs from the command line.

    Configure with `gpupool login`, or GPUPOOL_URL and GPUPOOL_TOKEN in the environment."""
    ctx.ensure_object(dict)["profile"] = profile


def main() -> None:
    cli(prog_name="gpupool")


# --- login and profiles -----------------------------------------------------------------------------


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
    try:
        with Client(url, token) as c:
            me = c.me()
    except ApiError as exc:
        _fail(exc)
        ctx.exit(EXIT_API_ERROR)
    except ConnectionFailed as exc:
        err.print(f"error: cannot reach the portal: {exc}")
        ctx.exit(EXIT_UNREACHABLE)
    where = config.save_profile(name, url, token, make_default=make_default)
    tenant = (me.tenant or {}).get("name", "?")
    err.print(f"Logged in to {url} as {tenant} (profile {name!r}; token in {where}).")
    if json_output or ctx.find_root().params.get("json_output"):
        _print_json(me)


@cli.group(invoke_without_command=True)
@click.option("--json", "json_output", is_flag=True, help="As JSON.")
@click.pass_context
def profiles(ctx: click.Context, json_output: bool) -> None:
    """Saved profiles (the default marked *); `profiles rm NAME` forgets one."""
    if ctx.invoked_subcommand:
        return
    data = config.load_profiles()
    if json_output or ctx.find_root().params.get("json_output"):
        _print_json({"default": data.get("default"), "profiles": data.get("profiles", {})})
        return
    rows = [
        ("*" if n == data.get("default") else "", n, p["url"]) for n, p in data.get("profiles", {}).items()
    ]
    _table(["", "PROFILE", "URL"], rows)


@profiles.command("rm")
@click.argument("name")
def profiles_rm(name: str) -> None:
    """Forget a profile and its token."""
    if not config.remove_profile(name):
        raise click.ClickException(f"No profile named {name!r}.")


# --- catalog ----------------------------------------------------------------------------------------


@api_command(cli, "gpus")
@click.option("--region", help="Only this region.")
def gpus(ctx: click.Context, as_json: bool, region: str | None) -> None:
    """The GPU catalog: price per GPU-hour by plan, and free GPUs per region."""
    types = _client(ctx).gpu_types()
    if region:
        for t in types:
            t.availability = [a for a in t.availability or [] if a["region"] == region]
            t.raw = {**t.raw, "availability": t.availability}
    if as_json:
        _print_json(types)
        return
    rows = []
    for t in types:
        for a in t.availability or [{}]:
            prices = a.get("price_per_gpu_hour") or {}
            rows.append((t.name, t.memory_gib, a.get("region", ""), a.get("free_gpus", ""), a.get("total_gpus", ""),
                         *(_money(prices.get(p)) for p in ("on_demand", "spot", "reserved"))))  # fmt: skip
    _table(["MODEL", "GiB", "REGION", "FREE", "TOTAL", "ON-DEMAND/h", "SPOT/h", "RESERVED/h"], rows)


# --- run ---------------------------------------------------------------------------------------------


def _pairs(values: Iterable[str], option: str) -> dict[str, str]:
    result = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{value!r}: expected NAME=VALUE", param_hint=option)
        result[name] = rest
    return result


def _volume(value: str) -> dict:
    parts = value.split(":")
    if len(parts) not in (2, 3) or not parts[0].isdigit() or not parts[1].startswith("/"):
        raise click.BadParameter(f"{value!r}: expected VOLUME_ID:/mount/path[:shared]", param_hint="--volume")
    if len(parts) == 3 and parts[2] != "shared":
        raise click.BadParameter(f"{value!r}: the third part can only be 'shared'", param_hint="--volume")
    return {"volume": int(parts[0]), "mount_path": parts[1], "shared": len(parts) == 3}


def _port(value: str) -> Any:
    number, _, protocol = value.partition("/")
    if not number.isdigit():
        raise click.BadParameter(f"{value!r}: expected PORT or PORT/tcp", param_hint="--port")
    return int(number) if not protocol else {"port": int(number), "protocol": protocol}


def _array(value: str) -> dict:
    count, _, parallelism = value.partition(":")
    if not count.isdigit() or (parallelism and not parallelism.isdigit()):
        raise click.BadParameter(f"{value!r}: expected COUNT or COUNT:PARALLELISM", param_hint="--array")
    return {"count": int(count), **({"parallelism": int(parallelism)} if parallelism else {})}


def _spread(value: str) -> dict:
    key, _, skew = value.partition(":")
    if not key or (skew and not skew.isdigit()):
        raise click.BadParameter(f"{value!r}: expected LABEL or LABEL:MAX_SKEW", param_hint="--spread")
    return {"topology_key": key, **({"max_skew": int(skew)} if skew else {})}


def _term(option: str):
    def convert(value: str) -> dict:
        ids, _, key = value.partition(":")
        parts = ids.split(",")
        if not all(p.isdigit() for p in parts):
            raise click.BadParameter(f"{value!r}: expected ID[,ID...][:node|LABEL]", param_hint=option)
        return {"workloads": [int(p) for p in parts], "topology_key": key or "node"}

    return convert


def _elastic(value: str) -> dict:
    low, sep, rest = value.partition(":")
    high, _, mode = rest.partition(":")
    if not (sep and low.isdigit() and high.isdigit()) or mode not in ("", "signal", "restart"):
        raise click.BadParameter(
            f"{value!r}: expected MIN_GPUS:MAX_GPUS[:signal|restart]", param_hint="--elastic"
        )
    return {"min_gpus": int(low), "max_gpus": int(high)} | ({"on_resize": mode} if mode else {})


def _depends(value: str) -> dict:
    job, _, condition = value.partition(":")
    if not job.isdigit():
        raise click.BadParameter(
            f"{value!r}: expected JOB_ID[:succeeded|finished]", param_hint="--depends-on"
        )
    return {"job": int(job), "condition": condition or "succeeded"}


def _spec_file(path: str) -> dict:
    try:
        spec = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise click.BadParameter(str(exc), param_hint="--spec") from exc
    if not isinstance(spec, dict):
        raise click.BadParameter("the spec must be a mapping of the API's fields", param_hint="--spec")
    return spec


def _manifest_file(path: str) -> dict:
    """A Kubernetes Job manifest, sent as JSON: the API translates it (and checks it) as it would
    the YAML."""
    try:
        manifest = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise click.BadParameter(str(exc), param_hint="--manifest") from exc
    if not isinstance(manifest, dict) or "apiVersion" not in manifest or "kind" not in manifest:
        raise click.BadParameter("not a Kubernetes manifest (apiVersion and kind)", param_hint="--manifest")
    return manifest


def _wait(c: Client, kind: str, workload: Any, until: str) -> Any:
    """Polls until the workload runs (``running``) or ends (``finished``); a spinner on a terminal."""
    done = (lambda w: w.state in TERMINAL_STATES) if until == "finished" else (
        lambda w: w.state == "running" or w.state in TERMINAL_STATES)  # fmt: skip
    status = err.status(f"{kind} {workload.id}: {workload.state}") if err.is_terminal else None
    if status is not None:
        status.start()
    try:
        while not done(workload):
            time.sleep(float(os.environ.get("GPUPOOL_WAIT_POLL_S", "2")))
            workload = c.workload(kind, workload.id)
            if status is not None:
                reason = (
                    (workload.pending or {}).get("message") or (workload.pending or {}).get("reason") or ""
                )
                status.update(f"{kind} {workload.id}: {workload.state} {reason}".rstrip())
    finally:
        if status is not None:
            status.stop()
    return workload


@api_command(cli, "run", context_settings={"allow_interspersed_args": False})
@click.argument("command", nargs=-1)
@click.option(
    "--instance", "kind", flag_value="instance", help="An instance (long-running) instead of a job."
)
@click.option(
    "--job", "kind", flag_value="job", default=True, help="A job (runs to completion; the default)."
)
@click.option(
    "--spec",
    "spec_path",
    type=click.Path(exists=True, dir_okay=False),
    help="A YAML file of the API's fields; flags override it.",
)
@click.option(
    "--manifest",
    "manifest_path",
    type=click.Path(exists=True, dir_okay=False),
    help="A Kubernetes batch/v1 Job manifest (YAML) to run as a job; no other spec flags with it.",
)
@click.option("--name")
@click.option("--image")
@click.option("--template", help="A template's name: fills the image, command, ports and env left unset.")
@click.option("--gpus", "gpu_count", type=int, help="How many GPUs.")
@click.option("--model", "gpu_models", multiple=True, help="A GPU model (repeat for alternatives).")
@click.option("--plan", type=click.Choice(["on_demand", "spot", "reserved"]))
@click.option("--region")
@click.option("--min-driver", "min_driver", help="Only nodes with at least this GPU driver (e.g. 550.54).")
@click.option(
    "--min-cuda", "min_cuda", help="Only nodes whose driver supports at least this CUDA (e.g. 12.4)."
)
@click.option("--min-rocm", "min_rocm", help="Only nodes with at least this ROCm (e.g. 6.1).")
@click.option("--env", "env", multiple=True, help="NAME=VALUE (repeatable).")
@click.option(
    "--secret", "secret_env", multiple=True, help="NAME=SECRET: the tenant secret SECRET as env NAME."
)
@click.option("--volume", "volumes", multiple=True, help="VOLUME_ID:/mount/path[:shared] (repeatable).")
@click.option("--port", "ports", multiple=True, help="Instances: PORT (HTTP) or PORT/tcp (repeatable).")
@click.option("--ssh-key", help="Instances: a public key, or a file holding one.")
@click.option("--max-runtime", "max_runtime_s", type=int, help="Seconds.")
@click.option("--array", "array", help="COUNT[:PARALLELISM]: a job array.")
@click.option("--gang", is_flag=True, default=None, help="All GPUs at once across nodes, or none.")
@click.option(
    "--elastic",
    help="MIN_GPUS:MAX_GPUS[:signal|restart]: an elastic job (--gpus is its starting size, default MIN); "
    "a resize reaches it as GPUPOOL_RESIZE_FILE and SIGUSR1, or as a restart from its checkpoint.",
)
@click.option(
    "--node-selector", "node_selector", multiple=True, help="LABEL=VALUE a node must have (repeatable)."
)
@click.option(
    "--prefer",
    "preference",
    type=click.Choice(["fastest", "cheapest"]),
    help="With several --model: the fastest, or the most compute per price.",
)
@click.option("--spread", "spread", help="LABEL[:MAX_SKEW]: spread an array's tasks or a gang's nodes.")
@click.option("--affinity", "affinity", help="ID[,ID...][:node|LABEL]: near these workloads of yours.")
@click.option("--anti-affinity", "anti_affinity", help="ID[,ID...][:node|LABEL]: away from these workloads.")
@click.option("--depends-on", "depends_on", multiple=True, help="JOB_ID[:succeeded|finished] (repeatable).")
@click.option("--idempotency-key", help="Makes a retried `run` create one workload (default: a new UUID).")
@click.option(
    "--wait", "wait", type=click.Choice(["running", "finished"]), help="Wait until it runs, or ends."
)
def run(ctx: click.Context, as_json: bool, command: tuple[str, ...], kind: str, spec_path: str | None,
        manifest_path: str | None, wait: str | None, idempotency_key: str | None,
        **flags: Any) -> None:  # fmt: skip
    """Start a job (or --instance): `gpupool run --gpus 1 --model H100 --image IMG -- python train.py`,
    or a Kubernetes Job: `gpupool run --manifest job.yaml`."""
    if manifest_path:
        given = [n for n, v in flags.items() if v not in (None, ())]
        if spec_path or command or kind != "job" or given:
            raise click.UsageError(
                "--manifest is the whole request: no --spec, --instance, command or spec flags."
            )
        spec = _manifest_file(manifest_path)
    else:
        spec = _spec_file(spec_path) if spec_path else {}
        kind = spec.pop("kind", None) or kind
    if command:
        spec["command"] = list(command)
    env = dict(spec.get("env") or {})
    env.update(_pairs(flags.pop("env"), "--env"))
    env.update({k: {"secret": v} for k, v in _pairs(flags.pop("secret_env"), "--secret").items()})
    if env:
        spec["env"] = env
    converters = {"volumes": lambda vs: [_volume(v) for v in vs], "ports": lambda ps: [_port(p) for p in ps],
                  "array": _array, "elastic": _elastic, "depends_on": lambda ds: [_depends(d) for d in ds],
                  "gpu_models": list, "node_selector": lambda v: _pairs(v, "--node-selector"),
                  "spread": _spread, "affinity": _term("--affinity"),
                  "anti_affinity": _term("--anti-affinity")}  # fmt: skip
    ssh_key = flags.pop("ssh_key")
    if ssh_key:
        spec["ssh_public_key"] = Path(ssh_key).read_text().strip() if Path(ssh_key).is_file() else ssh_key
    for name, value in flags.items():
        if value is None or value == ():
            continue
        spec[name] = converters[name](value) if name in converters else value
    c = _client(ctx)
    workload = c.create_workload(kind, spec, idempotency_key=idempotency_key)
    if not as_json:
        err.print(f"{kind} {workload.id} submitted ({workload.state})")
        for warning in workload.raw.get("warnings") or []:  # a manifest's fields not applied
            err.print(f"warning: {warning}", markup=False)
    if wait:
        workload = _wait(c, kind, workload, wait)
    if as_json:
        _print_json(workload)
    else:
        _out().print(f"{workload.id}\t{workload.state}")
    failed = workload.state == "failed" or (
        wait == "running" and workload.state != "running" and kind == "instance"
    )
    if wait and failed:
        err.print(f"{kind} {workload.id} {workload.state}: {workload.state_reason}")
        ctx.exit(EXIT_API_ERROR)


# --- watching and stopping ---------------------------------------------------------------------------


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
    c = _client(ctx)
    filters: dict[str, Any] = {"state": list(state) or None, "active": None if show_all or state else "true"}
    rows = []
    for k in [kind] if kind else ["job", "instance"]:
        for i, w in enumerate(c.workloads(k, **filters)):
            if limit and i >= limit:
                break
            rows.append(w)
    rows.sort(key=lambda w: w.id, reverse=True)
    if as_json:
        _print_json(rows)
        return
    _table(["ID", "KIND", "NAME", "STATE", "GPUS", "MODEL", "PLAN", "REGION", "SUBMITTED"],
           [(w.id, w.kind, w.name, w.state, w.gpu_count, ",".join(w.gpu_models or []), w.plan, w.region,
             _when(w.submitted_at)) for w in rows])  # fmt: skip


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
    _, w = _find_workload(_client(ctx), id, kind)
    if as_json:
        _print_json(w)
        return
    pending = w.pending or {}
    rows = [("id", w.id), ("kind", w.kind), ("name", w.name), ("state", w.state), ("reason", w.state_reason),
            ("waiting for", pending.get("message") or pending.get("reason")), ("image", w.image),
            ("command", " ".join(map(str, w.command or []))), ("gpus", f"{w.gpu_count} x {', '.join(w.gpu_models or [])}"),
            ("elastic", _elastic_text(w.elastic)),
            ("plan", w.plan), ("region", w.region), ("submitted", _when(w.submitted_at)),
            ("started", _when(w.started_at)), ("finished", _when(w.finished_at)), ("exit code", w.exit_code)]  # fmt: skip
    for p in w.placement or []:
        rows.append(("placement", f"{p['node']} ({p['region']}) GPU {p['gpu_index']} {p['gpu_model']}"))
    access = w.access or {}
    if access.get("ssh"):
        rows.append(("ssh", access["ssh"]["command"]))
    for port in access.get("ports") or []:
        rows.append((f"port {port['port']}", port.get("url") or port.get("note") or ""))
    _table(["FIELD", "VALUE"], [r for r in rows if r[1] not in (None, "")])


@api_command(cli, "logs")
@click.argument("id", type=int)
@kind_option
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until it ends.")
@click.option("--tail", type=int, default=100, show_default=True, help="The last N lines.")
def logs(ctx: click.Context, as_json: bool, id: int, kind: str | None, follow: bool, tail: int) -> None:
    """A workload's output (stdout and stderr)."""
    c = _client(ctx)
    kind, _ = _find_workload(c, id, kind)
    if follow:
        lines: Iterable[dict] = c.follow_logs(kind, id)
    else:
        page = c.logs(kind, id, tail=tail)
        if as_json:
            _print_json(page)
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
    _, w = _find_workload(_client(ctx), id, None)
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
        _print_json({"ssh": info, "argv": argv})
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
    _, w = _find_workload(_client(ctx), id, "instance")
    ports = [p for p in (w.access or {}).get("ports") or [] if p["port"] == port]
    if not ports:
        raise ApiError(404, "not_found", f"Instance {id} does not publish port {port}.")
    entry = ports[0]
    if as_json:
        _print_json(entry)
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
    c = _client(ctx)
    stopped = []
    for id in ids:
        k, _ = _find_workload(c, id, kind)
        stopped.append(c.stop_workload(k, id))
    if as_json:
        _print_json(stopped)
    else:
        for w in stopped:
            _out().print(f"{w.id}\t{w.state}")


@api_command(cli, "resize")
@click.argument("id", type=int)
@click.option(
    "--gpus", "gpu_count", type=int, required=True, help="The GPUs it should hold (within its bounds)."
)
def resize(ctx: click.Context, as_json: bool, id: int, gpu_count: int) -> None:
    """Resize a running elastic job: a shrink is at once, a growth as GPUs of its node free up."""
    w = _client(ctx).resize_job(id, gpu_count)
    if as_json:
        _print_json(w)
    else:
        target = (w.elastic or {}).get("target_gpus")
        _out().print(f"{w.id}\t{w.state}\t{w.gpu_count} GPU(s) held, {target} asked for")


def _listing_group(name: str, help_text: str) -> click.Group:
    """A command group whose bare invocation lists (its ``list`` subcommand), with ``--json``."""

    @cli.group(name, invoke_without_command=True, help=help_text)
    @click.option("--json", "json_output", is_flag=True, help="As JSON.")
    @click.pass_context
    def group(ctx: click.Context, json_output: bool) -> None:
        if not ctx.invoked_subcommand:
            ctx.invoke(group.commands["list"], json_output=json_output)

    return group


# --- volumes, secrets, templates ------------------------------------------------------------------------


volumes = _listing_group(
    "volumes", """Volumes (list); `volumes create NAME --region R --size GiB`, `volumes rm ID`."""
)


@api_command(volumes, "list")
def volumes_list(ctx: click.Context, as_json: bool) -> None:
    """The tenant's volumes."""
    vols = list(_client(ctx).volumes())
    if as_json:
        _print_json(vols)
        return
    _table(["ID", "NAME", "REGION", "SIZE GiB", "USED", "STATE", "IN USE BY"],
           [(v.id, v.name, v.region, v.size_gib, v.used_bytes, v.state, ",".join(map(str, v.in_use_by or [])))
            for v in vols])  # fmt: skip


@api_command(volumes, "create")
@click.argument("name")
@click.option("--region", required=True)
@click.option("--size", "size_gib", type=int, required=True, help="GiB.")
def volumes_create(ctx: click.Context, as_json: bool, name: str, region: str, size_gib: int) -> None:
    """Make a volume."""
    v = _client(ctx).create_volume(name=name, region=region, size_gib=size_gib)
    _print_json(v) if as_json else _out().print(f"{v.id}\t{v.name}")


@api_command(volumes, "rm")
@click.argument("id", type=int)
def volumes_rm(ctx: click.Context, as_json: bool, id: int) -> None:
    """Delete a volume (and its data)."""
    _client(ctx).delete_volume(id)
    if as_json:
        _print_json({"deleted": id})


secrets = _listing_group(
    "secrets",
    """Secrets (names only); `secrets set NAME` (value from stdin or a prompt), `secrets rm NAME`.""",
)


@api_command(secrets, "list")
def secrets_list(ctx: click.Context, as_json: bool) -> None:
    """The tenant's secrets, by name."""
    items = list(_client(ctx).secrets())
    if as_json:
        _print_json(items)
        return
    _table(
        ["NAME", "CREATED", "UPDATED"], [(s.name, _when(s.created_at), _when(s.updated_at)) for s in items]
    )


@api_command(secrets, "set")
@click.argument("name")
def secrets_set(ctx: click.Context, as_json: bool, name: str) -> None:
    """Make a secret; its value is read from stdin (or prompted for on a terminal)."""
    if sys.stdin.isatty():
        value = click.prompt("Value", hide_input=True)
    else:
        value = sys.stdin.read().removesuffix("\n")
    s = _client(ctx).create_secret(name=name, value=value)
    _print_json(s) if as_json else err.print(f"secret {s.name} saved")


@api_command(secrets, "rm")
@click.argument("name")
def secrets_rm(ctx: click.Context, as_json: bool, name: str) -> None:
    """Delete a secret."""
    _client(ctx).delete_secret(name)
    if as_json:
        _print_json({"deleted": name})


@api_command(cli, "templates")
def templates(ctx: click.Context, as_json: bool) -> None:
    """Templates: the catalog's and the tenant's own."""
    items = list(_client(ctx).templates())
    if as_json:
        _print_json(items)
        return
    _table(["NAME", "SOURCE", "IMAGE", "DESCRIPTION"],
           [(t.name, "catalog" if t.catalog else "tenant", t.image, t.description) for t in items])  # fmt: skip


# --- money ------------------------------------------------------------------------------------------------


@api_command(cli, "usage")
@click.option("--workload", type=int, help="Only this workload's.")
@click.option("--limit", type=int, default=100, show_default=True, help="At most this many records (0: all).")
def usage(ctx: click.Context, as_json: bool, workload: int | None, limit: int) -> None:
    """Usage records, newest first, with their amounts."""
    records = []
    for i, r in enumerate(_client(ctx).usage(workload=workload)):
        if limit and i >= limit:
            break
        records.append(r)
    if as_json:
        _print_json(records)
        return
    _table(["ID", "WORKLOAD", "MODEL", "PLAN", "START", "END", "GPU-s", "AMOUNT"],
           [(r.id, r.workload, r.gpu_model, r.plan, _when(r.start), _when(r.end), r.gpu_seconds, r.amount)
            for r in records])  # fmt: skip
    total = sum((r.amount or Decimal(0) for r in records), Decimal(0))
    err.print(f"{len(records)} records, total {total}")


invoices = _listing_group("invoices", """Invoices (list); `invoices pdf ID [-o FILE]` downloads one.""")


@api_command(invoices, "list")
def invoices_list(ctx: click.Context, as_json: bool) -> None:
    """The tenant's invoices."""
    items = list(_client(ctx).invoices())
    if as_json:
        _print_json(items)
        return
    _table(["ID", "PERIOD", "STATUS", "TOTAL", "CURRENCY"],
           [(i.id, f"{i.period_start} .. {i.period_end}", i.status, i.total, i.currency) for i in items])  # fmt: skip


@api_command(invoices, "pdf")
@click.argument("id", type=int)
@click.option(
    "--output", "-o", type=click.Path(dir_okay=False, writable=True), help="Default: invoice-ID.pdf."
)
def invoices_pdf(ctx: click.Context, as_json: bool, id: int, output: str | None) -> None:
    """Download an invoice's PDF."""
    data = _client(ctx).invoice_pdf(id)
    path = Path(output or f"invoice-{id}.pdf")
    path.write_bytes(data)
    if as_json:
        _print_json({"invoice": id, "path": str(path), "bytes": len(data)})
    else:
        err.print(f"saved {path} ({len(data)} bytes)")


@api_command(cli, "budget")
@click.option("--set", "monthly_limit", help="The monthly limit, in the tenant's currency.")
@click.option("--hard/--soft", "hard_limit", default=None, help="Hard: no new work past the limit.")
@click.option("--alerts", help="Alert thresholds in percent, e.g. 50,80,100.")
def budget(ctx: click.Context, as_json: bool, monthly_limit: str | None, hard_limit: bool | None,
           alerts: str | None) -> None:  # fmt: skip
    """This month's spend against the budget; --set, --hard/--soft and --alerts change it."""
    c = _client(ctx)
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
        _print_json(b)
        return
    _table(["FIELD", "VALUE"], [("period", b.period_start), ("spent", f"{b.amount} {b.currency}"),
                                ("limit", b.monthly_limit if b.monthly_limit is not None else "none"),
                                ("used", f"{b.percent}%" if b.percent is not None else ""),
                                ("hard limit", b.hard_limit), ("alerts at", ", ".join(map(str, b.alert_thresholds or [])))])  # fmt: skip


# --- tokens -------------------------------------------------------------------------------------------------


tokens = _listing_group(
    "tokens", """API tokens (list); `tokens create NAME --scope read`, `tokens revoke ID`."""
)


@api_command(tokens, "list")
def tokens_list(ctx: click.Context, as_json: bool) -> None:
    """The tenant's API tokens."""
    items = list(_client(ctx).tokens())
    if as_json:
        _print_json(items)
        return
    _table(["ID", "NAME", "PREFIX", "SCOPES", "STATUS", "EXPIRES", "LAST USED"],
           [(t.id, t.name, t.prefix, ",".join(t.scopes or []), t.status, _when(t.expires_at), _when(t.last_used_at))
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
    t = _client(ctx).create_token(name=name, scopes=list(scopes), expires_at=expires_at)
    if as_json:
        _print_json(t)
    else:
        err.print(f"token {t.id} ({t.name}); the secret is shown once:")
        click.echo(t.token)


@api_command(tokens, "revoke")
@click.argument("id", type=int)
def tokens_revoke(ctx: click.Context, as_json: bool, id: int) -> None:
    """Revoke a token."""
    t = _client(ctx).revoke_token(id)
    _print_json(t) if as_json else _out().print(f"{t.id}\t{t.status}")


# --- webhooks -----------------------------------------------------------------------------------------------


webhooks = _listing_group(
    "webhooks",
    """Webhook endpoints (list); `webhooks create URL --event TYPE`, `update`, `rm`, `roll-secret`,
    `events` (the types), `deliveries`, `delivery ID` (its attempts), `redeliver ID`. Receivers check
    each delivery with gpupool.webhooks.verify.""",
)


@api_command(webhooks, "list")
def webhooks_list(ctx: click.Context, as_json: bool) -> None:
    """The team's webhook endpoints."""
    items = list(_client(ctx).webhooks())
    if as_json:
        _print_json(items)
        return
    _table(["ID", "URL", "EVENTS", "ENABLED", "DESCRIPTION"],
           [(e.id, e.url, ",".join(e.event_types or []), "yes" if e.enabled else "no", e.description)
            for e in items])  # fmt: skip


def _print_secret(as_json: bool, e: Any, what: str) -> None:
    if as_json:
        _print_json(e)
    else:
        err.print(f"webhook {e.id} {what}; its signing secret is shown once:")
        click.echo(e.secret)


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
    e = _client(ctx).create_webhook(url=url, event_types=list(events) or ["*"], description=description,
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
    e = _client(ctx).update_webhook(id, **changes)
    _print_json(e) if as_json else _out().print(f"{e.id}\t{e.url}\t{'enabled' if e.enabled else 'disabled'}")


@api_command(webhooks, "rm")
@click.argument("id", type=int)
def webhooks_rm(ctx: click.Context, as_json: bool, id: int) -> None:
    """Delete an endpoint with its delivery log (pending deliveries are never sent)."""
    _client(ctx).delete_webhook(id)
    if as_json:
        _print_json({"deleted": id})


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
    e = _client(ctx).roll_webhook_secret(id, expire_previous_in_s=_duration(keep_old))
    _print_secret(as_json, e, "has a new secret")
    if not as_json and e.previous_secret_expires_at:
        err.print(
            f"The old secret signs deliveries too until {e.previous_secret_expires_at:%Y-%m-%d %H:%M %Z}."
        )


@api_command(webhooks, "events")
def webhooks_events(ctx: click.Context, as_json: bool) -> None:
    """The event types an endpoint may ask for."""
    items = _client(ctx).webhook_event_types()
    if as_json:
        _print_json(items)
        return
    _table(["EVENT", "WHAT"], [(t.name, t.description) for t in items])


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
    for i, d in enumerate(_client(ctx).webhook_deliveries(endpoint=endpoint, state=state)):
        if limit and i >= limit:
            break
        items.append(d)
    if as_json:
        _print_json(items)
        return
    _table(["ID", "ENDPOINT", "EVENT", "TYPE", "STATE", "ATTEMPTS", "LAST", "NEXT ATTEMPT"],
           [(d.id, d.endpoint, d.event_id, d.event_type, d.state, d.attempts,
             d.last_status or d.last_error, _when(d.next_attempt_at)) for d in items])  # fmt: skip


@api_command(webhooks, "delivery")
@click.argument("id", type=int)
def webhooks_delivery(ctx: click.Context, as_json: bool, id: int) -> None:
    """One delivery: its state and every attempt (status, latency, error)."""
    d = _client(ctx).webhook_delivery(id)
    if as_json:
        _print_json(d)
        return
    err.print(f"delivery {d.id} of {d.event_id} ({d.event_type}) to endpoint {d.endpoint}: {d.state}")
    _table(["#", "AT", "STATUS", "LATENCY ms", "ERROR", "BY HAND"],
           [(a["number"], a["at"], a["status"], a["latency_ms"], a["error"], "yes" if a["manual"] else "")
            for a in d.attempt_log or []])  # fmt: skip


@api_command(webhooks, "redeliver")
@click.argument("id", type=int)
def webhooks_redeliver(ctx: click.Context, as_json: bool, id: int) -> None:
    """Send a delivery again now."""
    d = _client(ctx).redeliver_webhook(id)
    _print_json(d) if as_json else _out().print(f"{d.id}\t{d.state}")


# --- shell completion ---------------------------------------------------------------------------------------


@cli.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the completion script: `eval "$(gpupool completion bash)"` (zsh and fish alike)."""
    completer = get_completion_class(shell)
    click.echo(completer(cli, {}, "gpupool", "_GPUPOOL_COMPLETE").source())
