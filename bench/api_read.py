"""One tenant API read, in parts: the token lookup, the page's query, its GPU model names, the
rendering, and the whole ``GET /api/v1/jobs/`` through the Django test client, on PostgreSQL.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/api_read.py

Makes its own database (``gpupool_bench_api_read``: created, migrated, dropped at the end), one
tenant with ``--jobs`` jobs (default 6, about what each of ``bench/scale.py``'s tenants has) on one
8-GPU node, and times each part ``--repeat`` times. Prints best and median milliseconds per part,
then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pgdb import django_on_own_database, drop_database  # noqa: E402

DB_NAME = "gpupool_bench_api_read"
H100 = "NVIDIA H100 SXM 80GB"


def timed(fn, repeat: int) -> dict[str, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return {"best_ms": round(min(times), 3), "median_ms": round(statistics.median(times), 3)}


def seed(jobs: int):
    from django.utils import timezone

    from nodes.models import Gpu, GpuModel, Node, NodeState, Region
    from portal.actors import Actor
    from portal.models import Membership, Role
    from portal.services.tenants import tenant_create
    from portal.services.tokens import api_token_create
    from scheduling.services.cycle import scheduling_cycle_run
    from scheduling.services.submission import workload_submit

    region = Region.objects.create(code="us-east-1", name="US East")
    node = Node.objects.create(
        hostname="gpu-0001", region=region, cpu_cores=96, ram_mib=1024 * 1024, state=NodeState.READY,
        last_heartbeat_at=timezone.now(),
    )  # fmt: skip
    model = GpuModel.objects.get(name=H100)
    Gpu.objects.bulk_create(
        Gpu(node=node, index=i, uuid=f"GPU-{uuid.uuid4()}", model=model, reported_name=model.name,
            memory_mib=model.memory_gib * 1024)
        for i in range(8)
    )  # fmt: skip
    tenant = tenant_create(
        slug="acme", name="Acme", owner_email="owner@acme.test", owner_password="bench-pw-1",
        actor=Actor.system(),
    )  # fmt: skip
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
    _, token = api_token_create(tenant=tenant, name="bench", scopes=["read"], actor=Actor(user=owner))
    for i in range(jobs):
        spec = {"gpu_models": [H100], "gpu_count": 1, "image": "ghcr.io/acme/train:1",
                "command": ["python", "train.py"], "name": f"job {i}", "env": {"A": str(i)}}  # fmt: skip
        workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())
    scheduling_cycle_run()
    return tenant, token


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=300)
    a = ap.parse_args()
    base = django_on_own_database(DB_NAME, ROOT, ALLOWED_HOSTS="testserver", SCHEDULING_TRIGGER_CYCLES="0")
    try:
        from django.core.management import call_command
        from django.db import connections
        from django.test import Client

        call_command("migrate", verbosity=0)
        tenant, token = seed(a.jobs)

        from portal.services.tokens import api_token_authenticate
        from scheduling.api import WorkloadSerializer
        from scheduling.models import Workload
        from scheduling.selectors.shared import workload_gpu_model_names

        def page():
            qs = Workload.objects.filter(tenant=tenant, kind="job").select_related("region")
            return list(qs.defer("log_tail").order_by("-submitted_at")[: a.jobs])

        rows = page()
        names = workload_gpu_model_names(workload_ids=[w.pk for w in rows])
        for w in rows:
            w.gpu_model_names = names[w.pk]
        client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
        url = f"/api/v1/jobs/?page_size={a.jobs}"
        assert len(client.get(url).json()["results"]) == a.jobs
        parts = {
            "token lookup": lambda: api_token_authenticate(plaintext=token),
            "page query": page,
            "GPU model names": lambda: workload_gpu_model_names(workload_ids=[w.pk for w in rows]),
            "render (fields built, then rows)": lambda: WorkloadSerializer(rows, many=True).data,
            f"GET {url}": lambda: client.get(url),
        }
        out = {name: timed(fn, a.repeat) for name, fn in parts.items()}
        for name, t in out.items():
            print(f"{name:40} best {t['best_ms']:7.3f} ms   median {t['median_ms']:7.3f} ms")
        print(json.dumps({"jobs": a.jobs, "repeat": a.repeat, "parts": out}))
    finally:
        connections.close_all()
        drop_database(base, DB_NAME)


if __name__ == "__main__":
    main()
