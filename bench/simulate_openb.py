"""Trace-quality benchmark: the ATC'23 inflation protocol on the openb trace, per policy, seeds 42-51.

Prints the mean GPU allocation ratio at 50 / 100 / 130 % requested per policy, and a JSON last line.
``--variant`` derives a stress trace from the pod list (deterministically, by ``--variant-seed``):

* ``gpuspec``: a third of the GPU pods accept only one or two models (drawn by GPU capacity share);
* ``multigpu``: pods resampled so that multi-GPU pods ask for half of all GPU;
* ``gpushare``: pods resampled so that sharing pods ask for half of all GPU.

    python bench/simulate_openb.py [--policies gpupool,fgd,bestfit,random] [--variant NAME]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scheduling.simulator.inflation import run_inflation  # noqa: E402
from scheduling.simulator.trace import TracePod, load_nodes, load_pods  # noqa: E402

DEFAULT_DIR = next(
    (p for p in (ROOT.parent / "shared/traces/openb", Path("/work/shared/traces/openb")) if p.is_dir()),
    ROOT.parent / "shared/traces/openb",
)


def _resample(pods: list[TracePod], pick, share: float, rng: random.Random) -> list[TracePod]:
    """Draw len(pods) pods so that pods matching ``pick`` carry ``share`` of the GPU requested."""
    hit = [p for p in pods if pick(p)]
    rest = [p for p in pods if not pick(p)]
    mean_hit = statistics.mean(p.gpu_request_milli for p in hit)
    mean_rest = statistics.mean(p.gpu_request_milli for p in rest) or 1
    # fraction f of pods from `hit` so that f*mean_hit / (f*mean_hit + (1-f)*mean_rest) = share
    f = share * mean_rest / (mean_hit * (1 - share) + share * mean_rest)
    out = []
    for i in range(len(pods)):
        src = rng.choice(hit) if rng.random() < f else rng.choice(rest)
        out.append(replace(src, name=f"{src.name}-v{i}"))
    return out


def variant(name: str, pods: list[TracePod], capacity: dict[str, int], seed: int) -> list[TracePod]:
    rng = random.Random(seed)
    if name == "default":
        return pods
    if name == "gpuspec":
        models = list(capacity)
        weights = [capacity[m] for m in models]
        out = []
        for p in pods:
            if p.num_gpu and rng.random() < 1 / 3:
                k = rng.choice((1, 2))
                spec: set[str] = set()
                while len(spec) < k:
                    spec.add(rng.choices(models, weights)[0])
                p = replace(p, gpu_spec=tuple(sorted(spec)))
            out.append(p)
        return out
    if name == "multigpu":
        return _resample(pods, lambda p: p.num_gpu > 1, 0.5, rng)
    if name == "gpushare":
        return _resample(pods, lambda p: p.num_gpu == 1 and p.gpu_milli < 1000, 0.5, rng)
    raise SystemExit(f"unknown variant {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default=str(DEFAULT_DIR / "openb_node_list_gpu_node.csv"))
    ap.add_argument("--pods", default=str(DEFAULT_DIR / "openb_pod_list_default.csv"))
    ap.add_argument("--policies", default="gpupool,fgd,bestfit,random")
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--variant", default="default", choices=("default", "gpuspec", "multigpu", "gpushare"))
    ap.add_argument("--variant-seed", type=int, default=7)
    ap.add_argument("--tune", type=float, default=1.3)
    a = ap.parse_args()
    lo, _, hi = a.seeds.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    nodes0, catalog = load_nodes(a.nodes)
    capacity: dict[str, int] = {}
    for n in nodes0:
        capacity[n.model] = capacity.get(n.model, 0) + len(n.gpus)
    pods = variant(a.variant, load_pods(a.pods), capacity, a.variant_seed)
    table: dict[str, dict] = {}
    print(f"trace {Path(a.pods).name} variant {a.variant}, seeds {seeds[0]}-{seeds[-1]}, tune {a.tune}")
    print(
        f"{'policy':<10} {'50 %':>8} {'100 %':>8} {'130 %':>8} {'failed':>8} {'decisions/s':>12} {'time s':>7}"
    )
    for policy in a.policies.split(","):
        rows = []
        t0 = time.perf_counter()
        for seed in seeds:
            nodes, catalog = load_nodes(a.nodes)
            rows.append(run_inflation(nodes, catalog, pods, policy=policy, seed=seed, tune=a.tune))
        mean = {
            x: round(
                statistics.mean(r.allocation_ratio[x] for r in rows if r.allocation_ratio[x] is not None), 2
            )
            for x in ("50", "100", "130")
        }
        failed = statistics.mean(r.failed for r in rows)
        dps = statistics.mean(r.decisions_per_s for r in rows)
        table[policy] = {"allocation_ratio": mean, "failed": round(failed, 1), "decisions_per_s": round(dps)}
        print(
            f"{policy:<10} {mean['50']:>8.2f} {mean['100']:>8.2f} {mean['130']:>8.2f} {failed:>8.1f} "
            f"{dps:>12,.0f} {time.perf_counter() - t0:>7.1f}",
            flush=True,
        )
    print(json.dumps({"variant": a.variant, "seeds": [seeds[0], seeds[-1]], "policies": table}))


if __name__ == "__main__":
    main()
