"""Trace-quality benchmark: the ATC'23 inflation protocol on the openb trace, per policy, seeds 42-51.

Prints the mean GPU allocation ratio at 50 / 100 / 130 % requested per policy, and a JSON last line.
``--variant`` derives a stress trace from the pod list (deterministically, by ``--variant-seed``), in
the spirit of the paper's openb_pod_list_gpuspec10..33, multigpu20..50, gpushare20..100 and cpu050..250;
``--level`` sets how hard (default in brackets):

* ``gpuspec``: that fraction of the GPU pods [1/3] accept only one or two models (drawn by GPU
  capacity share);
* ``multigpu``: pods resampled so that multi-GPU pods ask for that share of all GPU [0.5];
* ``gpushare``: pods resampled so that sharing pods ask for that share of all GPU [0.5];
* ``cpu``: the CPU-only pods resampled to that multiple of their number, so of their CPU [2.0];
* ``split``: that fraction of the multi-GPU pods [1.0] may take their GPUs as pieces over several
  nodes (``gpus_per_node`` 1, 2, 4 or 8; the engine's ``place_split`` when no node takes it whole).

    python bench/simulate_openb.py [--policies gpupool,fgd,bestfit,random] [--variant NAME [--level X]]
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


LEVELS = {"default": None, "gpuspec": 1 / 3, "multigpu": 0.5, "gpushare": 0.5, "cpu": 2.0, "split": 1.0}


def variant(
    name: str, pods: list[TracePod], capacity: dict[str, int], seed: int, level: float | None = None
) -> list[TracePod]:
    if name not in LEVELS:
        raise SystemExit(f"unknown variant {name!r}")
    rng = random.Random(seed)
    if level is None:
        level = LEVELS[name]
    if name == "default":
        return pods
    if name == "cpu":
        gpu = [p for p in pods if p.num_gpu]
        cpu_only = [p for p in pods if not p.num_gpu]
        n = round(level * len(cpu_only))
        extra = [replace(src, name=f"{src.name}-v{i}") for i, src in enumerate(rng.choices(cpu_only, k=n))]
        return gpu + extra
    if name == "gpuspec":
        models = list(capacity)
        weights = [capacity[m] for m in models]
        out = []
        for p in pods:
            if p.num_gpu and rng.random() < level:
                k = rng.choice((1, 2))
                spec: set[str] = set()
                while len(spec) < k:
                    spec.add(rng.choices(models, weights)[0])
                p = replace(p, gpu_spec=tuple(sorted(spec)))
            out.append(p)
        return out
    if name == "split":
        return [
            replace(p, gpus_per_node=(1, 2, 4, 8)) if p.num_gpu > 1 and rng.random() < level else p
            for p in pods
        ]
    if name == "multigpu":
        return _resample(pods, lambda p: p.num_gpu > 1, level, rng)
    return _resample(pods, lambda p: p.num_gpu == 1 and p.gpu_milli < 1000, level, rng)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default=str(DEFAULT_DIR / "openb_node_list_gpu_node.csv"))
    ap.add_argument("--pods", default=str(DEFAULT_DIR / "openb_pod_list_default.csv"))
    ap.add_argument("--policies", default="gpupool,fgd,bestfit,random")
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--variant", default="default", choices=tuple(LEVELS))
    ap.add_argument("--variant-seed", type=int, default=7)
    ap.add_argument("--level", type=float, default=None, help="how hard the variant stresses (see above)")
    ap.add_argument("--tune", type=float, default=1.3)
    a = ap.parse_args()
    lo, _, hi = a.seeds.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    nodes0, catalog = load_nodes(a.nodes)
    capacity: dict[str, int] = {}
    for n in nodes0:
        capacity[n.model] = capacity.get(n.model, 0) + len(n.gpus)
    pods = variant(a.variant, load_pods(a.pods), capacity, a.variant_seed, a.level)
    table: dict[str, dict] = {}
    level = a.level if a.level is not None else LEVELS[a.variant]
    print(
        f"trace {Path(a.pods).name} variant {a.variant} (level {level}, variant seed {a.variant_seed}), "
        f"seeds {seeds[0]}-{seeds[-1]}, tune {a.tune}"
    )
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
    print(
        json.dumps(
            {
                "variant": a.variant,
                "level": level,
                "variant_seed": a.variant_seed,
                "seeds": [seeds[0], seeds[-1]],
                "policies": table,
            }
        )
    )


if __name__ == "__main__":
    main()
