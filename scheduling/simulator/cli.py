"""Command line of the trace simulator, shared by ``manage.py simulate`` and ``python -m
scheduling.simulator`` (which needs no Django)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from scheduling.engine.policies import DEFAULT_POLICY, POLICIES
from scheduling.engine.queueing import QueuePolicy

from .inflation import arrivals_from_file, run_inflation, write_log
from .replay import plot, run_replay
from .trace import TraceError, load_nodes, load_pods


def add_arguments(parser: argparse.ArgumentParser, subparser_kwargs: dict | None = None) -> None:
    sub = parser.add_subparsers(dest="mode", required=True, **(subparser_kwargs or {}))
    inf = sub.add_parser("inflation", help="the ATC'23 protocol: arrivals never leave")
    rep = sub.add_parser("replay", help="time-ordered arrivals and departures with a queue")
    for p in (inf, rep):
        p.add_argument("--nodes", required=True, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
        p.add_argument("--pods", required=True, help="pod list CSV (cluster-trace-gpu-v2023 format)")
        p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES))
        p.add_argument("--seed", type=int, default=42)
        p.add_argument("--json", action="store_true", help="print one JSON object")
    inf.add_argument("--tune", type=float, default=1.3, help="GPU requested / capacity to stop at")
    inf.add_argument("--arrivals", help="file with the arrival sequence, one pod name a line")
    inf.add_argument("--log", help="write one CSV row per arrival here")
    rep.add_argument(
        "--queue-policy",
        default=None,
        choices=[p.value for p in QueuePolicy],
        help="order the queue as a region with this policy would (default: the live default order)",
    )
    rep.add_argument("--plot", default="simulate-replay.png", help="PNG file for the plot")


def run(opts: argparse.Namespace | dict, out: TextIO) -> int:
    o = opts if isinstance(opts, dict) else vars(opts)
    nodes, catalog = load_nodes(o["nodes"])
    pods = load_pods(o["pods"])
    if not pods:
        raise TraceError(f"{o['pods']}: no pods")
    if o["mode"] == "inflation":
        arrivals = arrivals_from_file(o["arrivals"], pods) if o.get("arrivals") else None
        res = run_inflation(
            nodes,
            catalog,
            pods,
            policy=o["policy"],
            seed=o["seed"],
            tune=o["tune"],
            arrivals=arrivals,
            keep_rows=bool(o.get("log")),
        )
        if o.get("log"):
            write_log(o["log"], res)
        if o.get("json"):
            out.write(json.dumps(res.as_json()) + "\n")
        else:
            ratio = res.allocation_ratio
            out.write(
                f"policy {res.policy}: {res.arrivals} arrivals, {res.failed} failed, "
                f"capacity {res.capacity_gpu_milli / 1000:g} GPUs\n"
            )
            for x, v in ratio.items():
                out.write(f"  allocation ratio at {x:>3} %: {'-' if v is None else f'{v:.2f} %'}\n")
            out.write(f"  {res.decisions_per_s:,.0f} decisions/s\n")
        return 0
    res = run_replay(
        nodes, catalog, pods, policy=o["policy"], seed=o["seed"], queue_policy=o.get("queue_policy")
    )
    try:
        plot(res, o["plot"])
        plotted = o["plot"]
    except ImportError:
        plotted = None  # matplotlib is a dev dependency; the figures stand without the picture
    if o.get("json"):
        data = res.as_json()
        data["plot"] = plotted
        out.write(json.dumps(data) + "\n")
    else:
        d = res.delay
        out.write(f"policy {res.policy}: {res.placed}/{res.pods} pods placed, {res.cycles} cycles\n")
        out.write(f"  queueing delay s: mean {d['mean']} p50 {d['p50']} p95 {d['p95']} p99 {d['p99']}\n")
        out.write(
            f"  GPU utilisation: mean {res.utilisation_mean:.2f} %, peak {res.utilisation_peak:.2f} %; "
            f"fragmentation mean {res.fragmentation_mean:.2f} % of capacity\n"
        )
        out.write(f"  plot: {plotted or 'not drawn (matplotlib is not installed)'}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="simulate", description=__doc__)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv), sys.stdout)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
