"""The staff finance pages and API on a month of data, on PostgreSQL.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/finance.py

Makes its own database (``gpupool_bench_finance``: created, migrated, dropped at the end) seeded
like ``bench/invoices.py`` (``--tenants`` tenants, ``--records`` usage records for March 2024), runs
the March invoice run twice (drafts, then finalized) so there are invoices and lines, and then times
every finance page, its CSV export and the staff API (best and median of ``--repeat`` calls, with the
number of SQL statements) as a signed-in staff person through the Django test client.

Prints its figures; the last line is one JSON object (``*_ms`` per page, and ``slowest_ms``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.invoices import MARCH, CountQueries, seed  # noqa: E402
from bench.pgdb import django_on_own_database, drop_database  # noqa: E402

DB_NAME = "gpupool_bench_finance"
PAGES = {
    "revenue_tenant": "/staff/finance/?start=2024-03&end=2024-03&group=tenant",
    "revenue_model": "/staff/finance/?start=2024-03&end=2024-03&group=model",
    "revenue_plan": "/staff/finance/?start=2024-03&end=2024-03&group=plan",
    "revenue_region": "/staff/finance/?start=2024-03&end=2024-03&group=region",
    "revenue_12_months": "/staff/finance/?start=2023-04&end=2024-03&group=month",
    "revenue_tenant_csv": "/staff/finance/?start=2024-03&end=2024-03&group=tenant&export=csv",
    "gpu_hours_fleet": "/staff/finance/gpu-hours/?start=2024-03&end=2024-03&group=fleet",
    "gpu_hours_region": "/staff/finance/gpu-hours/?start=2024-03&end=2024-03&group=region",
    "gpu_hours_csv": "/staff/finance/gpu-hours/?start=2024-03&end=2024-03&group=model&export=csv",
    "receivables": "/staff/finance/receivables/",
    "receivables_csv": "/staff/finance/receivables/?export=csv",
    "api_revenue_region": "/api/staff/v1/finance/revenue/?start=2024-03&end=2024-03&group=region",
    "api_gpu_hours": "/api/staff/v1/finance/gpu-hours/?start=2024-03&end=2024-03&group=model",
    "api_receivables": "/api/staff/v1/finance/receivables/",
}


def bench(tenants: int, records: int, repeat: int) -> dict:
    from django.db import connection
    from django.test import Client

    from metering.services.invoices import invoice_run
    from portal.models import User

    t0 = time.perf_counter()
    _, _, made = seed(tenants, records, min(10_000, records // 2))
    from nodes.models import Gpu, GpuModel, Node, Region

    # A fleet that was there all month and can hold the seeded usage (64 H100s: 47,616 GPU-hours).
    region, h100 = Region.objects.get(code="us-east-1"), GpuModel.objects.get(name="NVIDIA H100 SXM 80GB")
    for n in range(2, 9):
        node = Node.objects.create(hostname=f"bench-{n:04d}", region=region, cpu_cores=64, ram_mib=512 * 1024)
        Gpu.objects.bulk_create(
            Gpu(node=node, index=i, uuid=f"GPU-bench-{n}-{i}", model=h100) for i in range(8)
        )
    Node.objects.update(registered_at=datetime(2024, 1, 1, tzinfo=UTC))
    invoice_run(period_start=MARCH, now=datetime(2024, 4, 1, 1, tzinfo=UTC))
    invoice_run(period_start=MARCH, now=datetime(2024, 4, 5, 1, tzinfo=UTC))
    with connection.cursor() as c:
        c.execute("ANALYZE")
    print(
        f"seeded {tenants} tenants, {made} usage records, invoices finalized in {time.perf_counter() - t0:.1f} s"
    )

    staff = User.objects.create_user(email="finance@bench.test", password="bench-pw-1", is_staff=True)
    client = Client()
    client.force_login(staff)
    out: dict = {"tenants": tenants, "usage_records": made}
    for name, url in PAGES.items():
        times = []
        for _ in range(repeat):
            with CountQueries() as q:
                t0 = time.perf_counter()
                response = client.get(url)
                times.append(time.perf_counter() - t0)
            assert response.status_code == 200, (url, response.status_code, response.content[:300])
        best, median = min(times) * 1000, statistics.median(times) * 1000
        print(
            f"{name:22s} {best:7.1f} ms (median {median:7.1f}), {q.count} queries, {len(response.content)} bytes"
        )
        out[f"{name}_ms"] = round(best, 1)
        out[f"{name}_queries"] = q.count
    out["slowest_ms"] = max(v for k, v in out.items() if k.endswith("_ms"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the database (to look at query plans)")
    a = ap.parse_args()
    base = django_on_own_database(DB_NAME, ROOT, ALLOWED_HOSTS="testserver")
    try:
        from django.conf import settings

        # Pages render {% static %} links: no collectstatic manifest here.
        settings.STORAGES["staticfiles"] = {
            "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        }
        from django.core.management import call_command
        from django.db import connections

        call_command("migrate", verbosity=0)
        out = bench(a.tenants, a.records, a.repeat)
        connections.close_all()
    finally:
        if not a.keep:
            drop_database(base, DB_NAME)
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
