"""A time-ordered replay of the openb trace with a mix the trace itself lacks: gangs split over
nodes, job arrays and elastic jobs, synthesised from its pods deterministically (``--seed``).

* split: that share of the multi-GPU pods [0.3] ask for twice their GPUs (at most 16), which may
  come as pieces of 1, 2, 4 or 8 GPUs over several nodes (all or nothing);
* array: that share of the one-GPU pods [0.02] become an array of 8 tasks of their shape, all
  submitted at the pod's creation time;
* elastic: that share of the whole-GPU pods of 1-4 GPUs [0.2] become elastic jobs with their size
  as minimum and twice it (at most 8) as maximum: grown into idle GPUs of their node, shrunk toward
  the minimum before anything is preempted (``scheduling.engine.elastic``).

Prints, per label, the allocation rate (placed / submitted) and the queueing delay (mean, p50, p95,
seconds), for the mix with elastic moves on and off, and a JSON last line.

    python bench/simulate_mixed.py [--limit N] [--seed 7] [--compress K]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scheduling.simulator.replay import run_replay  # noqa: E402
from scheduling.simulator.trace import TracePod, load_nodes, load_pods  # noqa: E402

DEFAULT_DIR = next(
    (p for p in (ROOT.parent / "shared/traces/openb", Path("/work/shared/traces/openb")) if p.is_dir()),
    ROOT.parent / "shared/traces/openb",
)


def synthesise(
    pods: list[TracePod], seed: int, split: float, array: float, elastic: float
) -> tuple[list[TracePod], dict[str, tuple[int, int]], dict[str, str]]:
    rng = random.Random(seed)
    out: list[TracePod] = []
    bounds: dict[str, tuple[int, int]] = {}
    groups: dict[str, str] = {}
    for p in pods:
        r = rng.random()
        if p.num_gpu > 1 and r < split:
            q = replace(p, num_gpu=min(16, 2 * p.num_gpu), gpus_per_node=(1, 2, 4, 8))
            out.append(q)
            groups[q.name] = "split"
        elif p.num_gpu == 1 and p.gpu_milli >= 1000 and r < array:
            for k in range(8):
                q = replace(p, name=f"{p.name}-a{k}")
                out.append(q)
                groups[q.name] = "array"
        elif 1 <= p.num_gpu <= 4 and p.gpu_milli >= 1000 and r < elastic:
            out.append(p)
            bounds[p.name] = (p.num_gpu, min(8, 2 * p.num_gpu))
            groups[p.name] = "elastic"
        else:
            out.append(p)
            if p.num_gpu:
                groups[p.name] = "plain"
    return out, bounds, groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default=str(DEFAULT_DIR / "openb_node_list_gpu_node.csv"))
    ap.add_argument("--pods", default=str(DEFAULT_DIR / "openb_pod_list_default.csv"))
    ap.add_argument("--limit", type=int, default=0, help="only the first N pods by creation time (0: all)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--split", type=float, default=0.3)
    ap.add_argument("--array", type=float, default=0.02)
    ap.add_argument("--elastic", type=float, default=0.2)
    ap.add_argument(
        "--compress",
        type=float,
        default=1.0,
        help="arrivals come this many times faster (durations kept): the load the cluster sees",
    )
    ap.add_argument("--node-share", type=float, default=1.0, help="replay on this share of the nodes")
    a = ap.parse_args()
    pods = sorted(load_pods(a.pods), key=lambda p: (p.creation_time, p.name))
    if a.compress != 1.0:
        t0 = pods[0].creation_time if pods else 0
        pods = [
            replace(
                p,
                creation_time=t0 + int((p.creation_time - t0) / a.compress),
                deletion_time=None
                if p.deletion_time is None
                else t0 + int((p.creation_time - t0) / a.compress) + (p.deletion_time - p.creation_time),
            )
            for p in pods
        ]
    if a.limit:
        pods = pods[: a.limit]
    mixed, bounds, groups = synthesise(pods, a.seed, a.split, a.array, a.elastic)
    print(
        f"trace {Path(a.pods).name}: {len(pods)} pods -> {len(mixed)} "
        f"({sum(1 for g in groups.values() if g == 'split')} split, "
        f"{sum(1 for g in groups.values() if g == 'array')} array tasks, {len(bounds)} elastic), seed {a.seed}"
    )
    results = {}
    for moves in (True, False):
        nodes, catalog = load_nodes(a.nodes)
        if a.node_share < 1.0:
            nodes = random.Random(a.seed).sample(nodes, max(1, round(a.node_share * len(nodes))))
        t0 = time.perf_counter()
        r = run_replay(nodes, catalog, mixed, seed=a.seed, elastic=bounds, groups=groups, elastic_moves=moves)
        label = "elastic on" if moves else "elastic off"
        results[label] = r.as_json() | {"seconds": round(time.perf_counter() - t0, 1)}
        print(
            f"\n{label}: placed {r.placed}/{r.pods}, GPU utilisation mean {r.utilisation_mean:.2f} %, "
            f"resizes {r.resizes}, {time.perf_counter() - t0:.1f} s"
        )
        print(f"{'group':<8} {'pods':>6} {'placed %':>9} {'mean s':>9} {'p50 s':>8} {'p95 s':>8}")
        for g, row in r.groups.items():
            d = row["delay_s"]
            print(
                f"{g:<8} {row['pods']:>6} {row['allocation_rate_pct']:>9} {d['mean']:>9} {d['p50']:>8} {d['p95']:>8}"
            )
    for res in results.values():
        res.pop("series", None)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
