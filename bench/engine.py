"""Engine-alone benchmark: placement decisions per second on a synthetic fleet.

A 10,000-server, 80,000-GPU snapshot (three models, three regions, two NVLink islands per server,
a quarter of the fleet already partly busy) and 50,000 pending requests (whole GPUs, 2/4/8-GPU,
fractions, CPU-only; any model, one model or a list; on-demand and spot; 40 tenants), scheduled in
one cycle with the default policy. The same at 1,000 servers and 5,000 requests shows how the cost
per decision grows with the fleet. Last line: one JSON object.

    python bench/engine.py [--policy NAME] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduling.engine import (
    CycleConfig,
    Gpu,
    GpuModelInfo,
    GpuSpec,
    Node,
    Place,
    Plan,
    Request,
    Snapshot,
    Vendor,
    schedule,
)

CATALOG = {
    "H100": GpuModelInfo("H100", Vendor.NVIDIA, 81920, 4.0, (9, 0)),
    "A100": GpuModelInfo("A100", Vendor.NVIDIA, 40960, 2.5, (8, 0)),
    "L40S": GpuModelInfo("L40S", Vendor.NVIDIA, 46080, 1.5, (8, 9)),
}
REGIONS = ("eu-west", "us-east", "ap-south")


def fleet(n: int, rng: random.Random) -> list[Node]:
    nodes = []
    for i in range(n):
        model = ("H100", "A100", "A100", "L40S")[i % 4]
        gpus = [Gpu(index=g, island=g // 4) for g in range(8)]
        cpu_used = mem_used = 0
        if rng.random() < 0.25:  # partly busy: a few whole GPUs or halves taken
            for g in gpus[: rng.choice((2, 4, 6))]:
                g.free_milli = rng.choice((0, 0, 500))
            cpu_used, mem_used = 8000 * 4, 65536 * 4
        nodes.append(
            Node(f"node-{i:05d}", model, gpus, 192_000, 2_097_152, cpu_used, mem_used, REGIONS[i % 3])
        )
    return nodes


def queue(n: int, rng: random.Random) -> list[Request]:
    shapes = [
        (1, 1000, 40),
        (1, 500, 12),
        (1, 250, 8),
        (2, 1000, 12),
        (4, 1000, 6),
        (8, 1000, 3),
        (0, 1000, 4),
    ]
    weights = [w for *_, w in shapes]
    specs = [
        GpuSpec(),
        GpuSpec(),
        GpuSpec(models=("H100",)),
        GpuSpec(models=("A100", "H100")),
        GpuSpec(min_memory_mib=45000),
        GpuSpec(models=("L40S",)),
    ]
    out = []
    for i in range(n):
        gpus, milli, _ = rng.choices(shapes, weights)[0]
        share = gpus * milli / 1000 if gpus else 0.5
        out.append(
            Request(
                id=f"req-{i}",
                tenant=f"tenant-{rng.randrange(40)}",
                gpu=rng.choice(specs),
                gpus=gpus,
                milli=milli,
                cpu_milli=int(8000 * max(share, 0.25)),
                memory_mib=int(65536 * max(share, 0.25)),
                region=rng.choice((None, None, *REGIONS)),
                plan=Plan.SPOT if rng.random() < 0.2 else Plan.ON_DEMAND,
                submit_time=float(i),
            )
        )
    return out


def run(nodes_n: int, pending_n: int, policy: str, seed: int) -> dict:
    rng = random.Random(seed)
    snap = Snapshot(fleet(nodes_n, rng), CATALOG, [], {}, now=float(pending_n))
    reqs = queue(pending_n, rng)
    t0 = time.perf_counter()
    out = schedule(snap, reqs, CycleConfig(policy=policy, seed=seed))
    dt = time.perf_counter() - t0
    placed = sum(isinstance(d, Place) for d in out)
    return {
        "nodes": nodes_n,
        "gpus": nodes_n * 8,
        "pending": pending_n,
        "placed": placed,
        "seconds": round(dt, 3),
        "decisions_per_s": round(len(out) / dt),
        "placements_per_s": round(placed / dt),
        "us_per_decision": round(dt / len(out) * 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="gpupool")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    small = run(1_000, 5_000, a.policy, a.seed)
    big = run(10_000, 50_000, a.policy, a.seed)
    for r in (small, big):
        print(
            f"{r['nodes']:>6} nodes {r['gpus']:>6} GPUs {r['pending']:>6} pending: {r['placed']} placed in "
            f"{r['seconds']} s = {r['decisions_per_s']:,} decisions/s ({r['placements_per_s']:,} placements/s), "
            f"{r['us_per_decision']} us/decision"
        )
    growth = big["us_per_decision"] / small["us_per_decision"]
    print(f"cost per decision 1,000 -> 10,000 nodes: x{growth:.2f} (logarithmic growth: x{4 / 3:.2f})")
    print(
        json.dumps(
            {
                "policy": a.policy,
                "engine_decisions_per_s": big["decisions_per_s"],
                "engine_placements_per_s": big["placements_per_s"],
                "nodes": big["nodes"],
                "pending": big["pending"],
                "us_per_decision_1000_nodes": small["us_per_decision"],
                "us_per_decision_10000_nodes": big["us_per_decision"],
            }
        )
    )


if __name__ == "__main__":
    main()
