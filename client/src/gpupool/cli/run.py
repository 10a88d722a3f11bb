"""`gpupool run`: a job or instance from flags, a YAML spec or a Kubernetes Job manifest."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click
import yaml

from gpupool.cli.core import EXIT_API_ERROR, api_client, api_command, cli, err, out, print_json
from gpupool.client import TERMINAL_STATES, Client


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
    c = api_client(ctx)
    workload = c.create_workload(kind, spec, idempotency_key=idempotency_key)
    if not as_json:
        err.print(f"{kind} {workload.id} submitted ({workload.state})")
        for warning in workload.raw.get("warnings") or []:  # a manifest's fields not applied
            err.print(f"warning: {warning}", markup=False)
    if wait:
        workload = _wait(c, kind, workload, wait)
    if as_json:
        print_json(workload)
    else:
        out().print(f"{workload.id}\t{workload.state}")
    failed = workload.state == "failed" or (
        wait == "running" and workload.state != "running" and kind == "instance"
    )
    if wait and failed:
        err.print(f"{kind} {workload.id} {workload.state}: {workload.state_reason}")
        ctx.exit(EXIT_API_ERROR)
