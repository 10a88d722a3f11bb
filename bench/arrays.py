"""Job arrays and work queues: what they add to a scheduling cycle, and how fast the portal hands
out work items.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/arrays.py

On a database of its own (``gpupool_bench_arrays``, created, migrated and dropped here) with a fleet
of ``--nodes`` x 8 H100:

1. The cycle's two new steps (``dependencies_gate``, ``arrays_advance``) with no array and no
   dependency, then with ``--arrays`` unfinished arrays: milliseconds per call.
2. One cycle that makes and places ``--parallelism`` tasks of a 10,000-task array, against one
   that places as many plain jobs submitted one by one.
3. A work queue of ``--items`` items: its submission, then leases with completion (``work_next``
   then ``work_done``, the services the endpoint calls) by 1 and by ``--workers`` threads.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pgdb import django_on_own_database, drop_database  # noqa: E402

DB_NAME = "gpupool_bench_arrays"
H100 = "NVIDIA H100 SXM 80GB"


def _fleet(n_nodes: int) -> None:
    import uuid

    from django.utils import timezone

    from nodes.models import Gpu, GpuModel, Node, NodeState, Region

    region = Region.objects.get_or_create(code="us-east-1", defaults={"name": "US"})[0]
    gm = GpuModel.objects.get(name=H100)
    nodes = Node.objects.bulk_create(
        Node(
            hostname=f"bench-{i:05d}",
            region=region,
            cpu_cores=128,
            ram_mib=2 << 20,
            state=NodeState.READY,
            last_heartbeat_at=timezone.now(),
        )
        for i in range(n_nodes)
    )
    Gpu.objects.bulk_create(
        [
            Gpu(
                node=n, index=g, uuid=f"GPU-{uuid.uuid4()}", model=gm, reported_name=gm.name, memory_mib=81920
            )
            for n in nodes
            for g in range(8)
        ],
        batch_size=2000,
    )


def _ms(fn, repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return round((time.perf_counter() - started) * 1000 / repeat, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--arrays", type=int, default=50)
    ap.add_argument("--parallelism", type=int, default=500)
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    a = ap.parse_args()
    base = django_on_own_database(DB_NAME, ROOT)
    out: dict = {}
    try:
        from django.conf import settings
        from django.core.management import call_command
        from django.db import connection, connections, transaction
        from django.utils import timezone

        from portal.actors import Actor
        from portal.services.tenants import tenant_create
        from scheduling.models import Quota, Workload
        from scheduling.services.arrays import arrays_advance
        from scheduling.services.cycle import scheduling_cycle_run
        from scheduling.services.dependencies import dependencies_gate
        from scheduling.services.submission import workload_submit
        from scheduling.services.work import work_done, work_next

        settings.SCHEDULING_TRIGGER_CYCLES = False
        call_command("migrate", verbosity=0)
        _fleet(a.nodes)
        tenant = tenant_create(slug="bench", name="Bench", owner_email="b@bench.test", actor=Actor.system())
        Quota.objects.update_or_create(
            tenant=tenant,
            defaults={"max_concurrent_workloads": None, "max_gpus_total": None, "max_gpus_per_request": None},
        )
        system = Actor.system()
        job = {"image": "ghcr.io/acme/x:1", "command": ["x"], "gpu_models": [H100]}

        def steps() -> None:
            with transaction.atomic():
                arrays_advance(now=timezone.now(), blocked=dependencies_gate(now=timezone.now()))

        def baseline() -> None:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT 1")

        out["baseline_ms"] = _ms(baseline, 200)
        print(f"baseline (a transaction with one SELECT 1): {out['baseline_ms']} ms")
        out["steps_ms_no_arrays"] = _ms(steps, 200)
        print(f"cycle's array and dependency steps, no arrays: {out['steps_ms_no_arrays']} ms")
        for _ in range(a.arrays):
            workload_submit(
                tenant=tenant, kind="job", spec={**job, "array": {"count": 4, "parallelism": 1}}, actor=system
            )
        steps()  # makes their first tasks
        out["steps_ms_with_arrays"] = _ms(steps, 50)
        print(f"the same, {a.arrays} unfinished arrays: {out['steps_ms_with_arrays']} ms")
        scheduling_cycle_run()
        Workload.objects.all().delete()

        # One array making and placing `parallelism` tasks, then as many plain jobs.
        workload_submit(
            tenant=tenant,
            kind="job",
            spec={**job, "array": {"count": 10_000, "parallelism": a.parallelism}},
            actor=system,
        )
        started = time.perf_counter()
        placed = len(scheduling_cycle_run().placed)
        out["array_cycle_s"] = round(time.perf_counter() - started, 3)
        print(f"a cycle making and placing {placed} array tasks: {out['array_cycle_s']} s")
        Workload.objects.all().delete()
        for _ in range(a.parallelism):
            workload_submit(tenant=tenant, kind="job", spec=job, actor=system)
        started = time.perf_counter()
        placed = len(scheduling_cycle_run().placed)
        out["plain_cycle_s"] = round(time.perf_counter() - started, 3)
        print(f"a cycle placing {placed} plain jobs: {out['plain_cycle_s']} s")
        Workload.objects.all().delete()

        # A work queue.
        started = time.perf_counter()
        parent = workload_submit(
            tenant=tenant,
            kind="job",
            spec={
                **job,
                "array": {"parallelism": a.workers, "work": {"first": 1, "last": a.items, "lease_s": 600}},
            },
            actor=system,
        )
        out["work_submit_s"] = round(time.perf_counter() - started, 3)
        print(f"submitting a work queue of {a.items} items: {out['work_submit_s']} s")
        scheduling_cycle_run()
        tasks = list(Workload.objects.filter(array_parent=parent).order_by("array_index"))

        def worker(task, count: list, limit: int | None) -> None:
            try:
                while limit is None or count[0] < limit:
                    item, _ = work_next(task=task, now=timezone.now())
                    if item is None:
                        return
                    work_done(task=task, index=item.index, now=timezone.now())
                    count[0] += 1
            finally:
                connection.close()

        one = [0]
        started = time.perf_counter()
        t = threading.Thread(target=worker, args=(tasks[0], one, a.items // 4))
        t.start()
        t.join()
        out["items_per_s_1_worker"] = round(one[0] / (time.perf_counter() - started))
        print(f"lease + done, 1 worker: {out['items_per_s_1_worker']} items/s")
        counts = [[0] for _ in tasks]
        started = time.perf_counter()
        threads = [
            threading.Thread(target=worker, args=(task, c, None))
            for task, c in zip(tasks, counts, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = sum(c[0] for c in counts)
        out["items_per_s_n_workers"] = round(total / (time.perf_counter() - started))
        print(f"lease + done, {len(tasks)} workers: {out['items_per_s_n_workers']} items/s ({total} items)")
        connections.close_all()
    finally:
        drop_database(base, DB_NAME)
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
