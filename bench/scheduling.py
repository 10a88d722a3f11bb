"""Scheduling benchmark: the engine alone, then whole cycles committed to PostgreSQL.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/scheduling.py

1. Engine alone, on ``bench/engine.py``'s synthetic snapshots (imported, not copied): 1,000 nodes
   with 5,000 pending requests and 10,000 nodes / 80,000 GPUs with 50,000 pending; decisions per
   second and the growth of the cost per decision.
2. End to end: a database of its own (``gpupool_bench_sched`` on the same server, created and
   migrated here, dropped at the end) holding a fleet (``--nodes`` x 8 GPUs, H100 and A100 in two
   regions) and ``--pending`` queued workloads of several tenants (whole GPUs, 2/4/8-GPU, halves and
   quarters, model lists, region preferences, spot and on-demand). Every workload is submitted
   through ``workload_submit`` once per (tenant, shape) and the rest are copies of those rows, so
   that building the queue does not dominate the run. Then ``scheduling_cycle_run`` runs until it
   places nothing more; placements per second count the whole cycle: admission, snapshot, engine,
   allocations, state changes, events, start commands and the commit.

The last line is one JSON object. ``--profile FILE`` writes a cProfile of the first cycle.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import run as engine_run  # noqa: E402
from bench.pgdb import django_on_own_database, drop_database  # noqa: E402

DB_NAME = "gpupool_bench_sched"
H100 = "NVIDIA H100 SXM 80GB"
A100 = "NVIDIA A100 SXM 80GB"
REGIONS = ("us-east-1", "eu-west-1")
# (gpu_count, fraction milli, weight)
SHAPES = ((1, 1000, 50), (2, 1000, 12), (4, 1000, 6), (8, 1000, 2), (1, 500, 15), (1, 250, 10))


# --- 1. engine alone ----------------------------------------------------------------------------------


def bench_engine(seed: int) -> dict:
    small = engine_run(1_000, 5_000, "gpupool", seed)
    big = engine_run(10_000, 50_000, "gpupool", seed)
    for r in (small, big):
        print(
            f"engine: {r['nodes']:>6} nodes {r['gpus']:>6} GPUs {r['pending']:>6} pending: {r['placed']} placed in "
            f"{r['seconds']} s = {r['decisions_per_s']:,} decisions/s, {r['us_per_decision']} us/decision"
        )
    print(
        f"engine: cost per decision 1,000 -> 10,000 nodes: x{big['us_per_decision'] / small['us_per_decision']:.2f}"
    )
    return {"small": small, "big": big}


# --- 2. end to end ------------------------------------------------------------------------------------


def _fleet(n_nodes: int) -> int:
    import uuid

    from django.utils import timezone

    from nodes.models import Gpu, GpuModel, Node, NodeState, Region

    regions = [Region.objects.get_or_create(code=c, defaults={"name": c})[0] for c in REGIONS]
    models = [GpuModel.objects.get(name=H100), GpuModel.objects.get(name=A100)]
    now = timezone.now()
    nodes = Node.objects.bulk_create(
        [
            Node(
                hostname=f"bench-{i:05d}",
                region=regions[i % 2],
                cpu_cores=128,
                ram_mib=2 * 1024 * 1024,
                state=NodeState.READY,
                last_heartbeat_at=now,
            )
            for i in range(n_nodes)
        ],
        batch_size=1000,
    )
    gpus = []
    for i, node in enumerate(nodes):
        gm = models[(i // 2) % 2]
        gpus += [
            Gpu(
                node=node,
                index=g,
                uuid=f"GPU-{uuid.uuid4()}",
                model=gm,
                reported_name=gm.name,
                memory_mib=gm.memory_gib * 1024,
                nvlink_island=g // 4,
                numa_node=g // 4,
            )
            for g in range(8)
        ]
    Gpu.objects.bulk_create(gpus, batch_size=2000)
    return len(gpus)


def _queue(n_pending: int, n_tenants: int, rng: random.Random) -> None:
    from django.db import transaction

    from portal.actors import Actor
    from portal.models import Tenant
    from scheduling.models import Quota, Workload, WorkloadState
    from scheduling.services.submission import workload_submit

    tenants = [
        Tenant.objects.create(name=f"Bench {t}", slug=f"bench-{t}", billing_email=f"t{t}@example.com")
        for t in range(n_tenants)
    ]
    Quota.objects.bulk_create(
        [Quota(tenant=t, max_gpus_total=None, max_concurrent_workloads=None) for t in tenants]
    )
    model_choices = ([H100], [A100], [H100, A100])
    templates: list[Workload] = []
    for t in tenants:
        for gpus, milli, _ in SHAPES:
            for models in model_choices:
                spec = {
                    "image": "ghcr.io/acme/train:1",
                    "command": ["python", "train.py"],
                    "gpu_models": models,
                    "gpu_count": gpus,
                    "cpu_millicores": 8000 * gpus,
                    "ram_mib": 65536 * gpus,
                    "region": rng.choice(REGIONS),
                    "plan": rng.choice(("on_demand", "on_demand", "on_demand", "spot")),
                    "estimated_runtime_s": rng.choice((600, 3600, 7200)),
                }
                if milli < 1000:
                    spec["gpu_fraction_milli"] = milli
                templates.append(workload_submit(tenant=t, kind="job", spec=spec, actor=Actor.system()))
    weights = [w for *_, w in SHAPES]
    by_shape: dict[int, list[Workload]] = {}
    for i, w in enumerate(templates):
        by_shape.setdefault(i // len(model_choices) % len(SHAPES), []).append(w)
    through = Workload.gpu_models.through
    chosen = {}
    for wid, mid in through.objects.values_list("workload_id", "gpumodel_id"):
        chosen.setdefault(wid, []).append(mid)
    copies = []
    for _ in range(n_pending - len(templates)):
        shape = rng.choices(range(len(SHAPES)), weights)[0]
        src = rng.choice(by_shape[shape])
        copies.append((_copy(src), chosen.get(src.pk, [])))
    with transaction.atomic():
        made = Workload.objects.bulk_create([w for w, _ in copies], batch_size=2000)
        through.objects.bulk_create(
            [
                through(workload_id=w.pk, gpumodel_id=m)
                for w, ms in zip(made, (c for _, c in copies), strict=True)
                for m in ms
            ],
            batch_size=5000,
        )
    # Templates are admitted by the cycle (PENDING -> QUEUED); copies wait QUEUED already.
    assert (
        Workload.objects.filter(state__in=[WorkloadState.PENDING, WorkloadState.QUEUED]).count() == n_pending
    )


def _copy(src):
    from django.forms.models import model_to_dict

    from scheduling.models import Workload, WorkloadState

    data = model_to_dict(
        src, exclude=["id", "gpu_models", "tenant", "region", "reservation", "preempted_for"]
    )
    w = Workload(**data)
    w.tenant_id, w.region_id, w.reservation_id = src.tenant_id, src.region_id, src.reservation_id
    w.state = WorkloadState.QUEUED
    w.submitted_at = src.submitted_at
    w.state_changed_at = src.state_changed_at
    w.queued_at = src.state_changed_at
    return w


def bench_e2e(n_nodes: int, n_pending: int, n_tenants: int, seed: int, profile: str | None) -> dict:
    from django.db import connection

    from nodes.models import NodeCommand
    from scheduling.models import Allocation, Workload, WorkloadState
    from scheduling.services.cycle import scheduling_cycle_run

    rng = random.Random(seed)
    t0 = time.perf_counter()
    n_gpus = _fleet(n_nodes)
    _queue(n_pending, n_tenants, rng)
    print(
        f"e2e: fleet of {n_nodes:,} nodes / {n_gpus:,} GPUs and {n_pending:,} queued workloads of "
        f"{n_tenants} tenants built in {time.perf_counter() - t0:.1f} s ({connection.vendor})"
    )
    cycles = []
    while True:
        prof = cProfile.Profile() if profile and not cycles else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        r = scheduling_cycle_run()
        if prof:
            prof.disable()
            prof.dump_stats(profile)
        dt = time.perf_counter() - t
        cycles.append((len(r.placed), r.pending, dt))
        print(
            f"e2e: cycle {len(cycles)}: {len(r.placed):,} placed, {r.pending:,} waiting, {dt:.3f} s "
            f"= {len(r.placed) / dt:,.0f} placements/s (commit included)"
        )
        if not r.placed or len(cycles) >= 5:
            break
    placed = sum(p for p, _, _ in cycles)
    total = sum(dt for *_, dt in cycles)
    first_placed, _, first_dt = cycles[0]
    allocs = Allocation.objects.filter(ended_at__isnull=True).count()
    commands = NodeCommand.objects.count()
    scheduled = Workload.objects.filter(state=WorkloadState.SCHEDULED).count()
    assert scheduled == placed, (scheduled, placed)
    assert commands >= placed, (commands, placed)
    print(
        f"e2e: {placed:,} placed in {len(cycles)} cycle(s), {total:.3f} s; {allocs:,} open allocations, "
        f"{commands:,} start commands"
    )
    return {
        "placements_per_s": round(first_placed / first_dt),
        "first_cycle_placed": first_placed,
        "first_cycle_s": round(first_dt, 3),
        "placed": placed,
        "cycles": len(cycles),
        "gpus": n_gpus,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pending", type=int, default=6000)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--profile", help="write a cProfile of the first cycle to this file")
    a = ap.parse_args()

    engine = None if a.skip_engine else bench_engine(a.seed)

    base = django_on_own_database(DB_NAME, ROOT)
    try:
        from django.conf import settings
        from django.core.management import call_command
        from django.db import connections

        settings.SCHEDULING_TRIGGER_CYCLES = False  # the bench runs the cycles itself
        call_command("migrate", verbosity=0)
        e2e = bench_e2e(a.nodes, a.pending, a.tenants, a.seed, a.profile)
        connections.close_all()
    finally:
        drop_database(base, DB_NAME)
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    out = {
        "engine_decisions_per_s": engine["big"]["decisions_per_s"] if engine else None,
        "engine_us_per_decision_1000_nodes": engine["small"]["us_per_decision"] if engine else None,
        "engine_us_per_decision_10000_nodes": engine["big"]["us_per_decision"] if engine else None,
        "e2e_placements_per_s": e2e["placements_per_s"],
        "e2e_first_cycle_placed": e2e["first_cycle_placed"],
        "e2e_first_cycle_s": e2e["first_cycle_s"],
        "e2e_gpus": e2e["gpus"],
        "nodes": a.nodes,
        "pending": a.pending,
        "load_1m": round(load[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
