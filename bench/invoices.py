"""Monthly invoice run and the usage API on PostgreSQL.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/invoices.py

Makes its own database (``gpupool_bench_invoices``: created, migrated, dropped at the end) with
``--tenants`` tenants (default 1,000) and ``--records`` usage records for March 2024 (default
500,000; bulk-created directly, not through scheduling): the first tenant has ``--heavy`` (10,000)
of them, the rest share the remainder; on-demand and spot, two GPU models, GPU memory priced per
GiB-hour (every record carries its GiB-seconds). Every tenth tenant holds a reservation of two
H100s for the month (one in five of them cancelled on 15 March, with a cancellation fee). Then:

1. ``invoice_run`` for March as beat runs it on 1 April (usage pass + every tenant's draft built);
2. the same run on 5 April, when the drafts' grace is over (rebuilt once more and finalized);
3. the heavy tenant's month through ``GET /api/v1/usage/?period=2024-03-01`` with the Django test
   client and a billing token, as a client fetches it: in one call with ``page_size=10000`` (the
   figure ``usage_api_ms``, best of 5, with the median), plus the default-sized first page of 200
   and the full cursor walk by 200 for comparison. Statements are counted for the runs and calls.

Prints its figures; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import sys
import time
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pgdb import django_on_own_database, drop_database  # noqa: E402

DB_NAME = "gpupool_bench_invoices"
H100 = "NVIDIA H100 SXM 80GB"
A100 = "NVIDIA A100 SXM 80GB"
MARCH = date(2024, 3, 1)
HOUR = Decimal(3600)
MEMORY_PRICE = "0.002"


def seed(tenants: int, records: int, heavy: int):
    from metering.models import RateCard, UsageRecord
    from metering.services.rates import rate_card_version_create
    from nodes.models import Gpu, GpuModel, Node, Region
    from portal.actors import Actor
    from portal.bulk import bulk_insert
    from portal.models import Membership, Role, Tenant, User
    from portal.services.tokens import api_token_create
    from scheduling.models import Allocation, Plan, Reservation, ReservationStatus, Workload

    h100, a100 = GpuModel.objects.get(name=H100), GpuModel.objects.get(name=A100)
    region = Region.objects.get_or_create(code="us-east-1", defaults={"name": "US East"})[0]
    card = RateCard.objects.create(name="Standard", currency="USD", is_default=True)
    prices = {(h100.pk, Plan.ON_DEMAND): "2.00", (h100.pk, Plan.SPOT): "0.80"}
    prices |= {
        (a100.pk, Plan.ON_DEMAND): "1.00",
        (a100.pk, Plan.SPOT): "0.40",
        (h100.pk, Plan.RESERVED): "1.50",
    }
    version = rate_card_version_create(
        rate_card=card,
        effective_from=datetime(2020, 1, 1, tzinfo=UTC),
        gpu_prices=prices,
        gpu_memory_gib_hour_price=MEMORY_PRICE,
        allow_past=True,
    )
    node = Node.objects.create(hostname="bench-0001", region=region, cpu_cores=64, ram_mib=512 * 1024)
    gpus = [Gpu.objects.create(node=node, index=i, uuid=f"GPU-bench-{i}", model=h100) for i in range(8)]
    Tenant.objects.bulk_create(
        Tenant(name=f"Tenant {i}", slug=f"t{i:05d}", billing_email=f"billing@t{i}.test")
        for i in range(tenants)
    )
    ts = list(Tenant.objects.order_by("pk"))
    start = datetime(2024, 3, 1, tzinfo=UTC)
    workloads, allocations = [], []
    for t in ts:
        for plan in (Plan.ON_DEMAND, Plan.SPOT):
            workloads.append(Workload(tenant=t, kind="job", state="completed", plan=plan, image="img"))
    Workload.objects.bulk_create(workloads, batch_size=2000)
    for i, w in enumerate(workloads):
        allocations.append(
            Allocation(
                tenant_id=w.tenant_id,
                workload=w,
                node=node,
                gpu=gpus[i % 8],
                gpu_model=h100,
                plan=w.plan,
                fraction_milli=1000,
                started_at=start,
                ended_at=start + timedelta(days=28),
                end_reason="stopped",
            )
        )
    Allocation.objects.bulk_create(allocations, batch_size=2000)
    per_tenant = [heavy] + [(records - heavy) // (tenants - 1)] * (tenants - 1)
    per_tenant[-1] += records - sum(per_tenant)
    rows = []
    seg = timedelta(seconds=240)  # 10,000 x 4 min fit in 28 days
    made = 0
    for t_index, (t, n) in enumerate(zip(ts, per_tenant, strict=True)):
        for k in range(n):
            a = allocations[2 * t_index + (k % 2)]
            model = h100 if k % 3 else a100
            price = Decimal(prices[(model.pk, a.plan)])
            s = start + seg * (k // 2)
            gpu_s = Decimal(240)
            mem_s = gpu_s * model.memory_gib
            mem_amount = (mem_s * Decimal(MEMORY_PRICE) / HOUR).quantize(Decimal("1e-10"))
            rows.append(
                UsageRecord(
                    tenant_id=t.pk,
                    allocation_id=a.pk,
                    workload_id=a.workload_id,
                    gpu_model_id=model.pk,
                    region_id=region.pk,
                    plan=a.plan,
                    period_start=MARCH,
                    version_id=version.pk,
                    start=s,
                    end=s + seg,
                    fraction_milli=1000,
                    seconds=gpu_s,
                    gpu_seconds=gpu_s,
                    gpu_memory_gib_seconds=mem_s,
                    gpu_memory_amount=mem_amount,
                    unit_price=price,
                    amount=(gpu_s * price / HOUR).quantize(Decimal("1e-10")) + mem_amount,
                    avg_util_pct=80.0,
                    avg_mem_used_mib=40000.0,
                    created_at=start + timedelta(days=29),
                )
            )
            if len(rows) >= 50_000:
                bulk_insert(rows)
                made += len(rows)
                rows = []
    bulk_insert(rows)
    made += len(rows)
    Reservation.objects.bulk_create(
        Reservation(
            tenant=t,
            gpu_model=h100,
            region=region,
            count=2,
            starts_at=start,
            ends_at=datetime(2024, 4, 1, tzinfo=UTC),
            status=ReservationStatus.CANCELLED if i % 50 == 0 else ReservationStatus.ACTIVE,
            activated_at=start - timedelta(days=1),
            cancelled_at=datetime(2024, 3, 15, tzinfo=UTC) if i % 50 == 0 else None,
            cancel_fee_percent=Decimal(25) if i % 50 == 0 else Decimal(0),
        )
        for i, t in enumerate(ts)
        if i % 10 == 0
    )
    heavy_tenant = ts[0]
    owner = User.objects.create_user(email="owner@bench.test", password="bench-pw-1")
    Membership.objects.create(tenant=heavy_tenant, user=owner, role=Role.OWNER)
    _, token = api_token_create(
        tenant=heavy_tenant, name="bench", scopes=["read", "billing"], actor=Actor(user=owner)
    )
    return heavy_tenant, token, made


class CountQueries:
    """Counts the SQL statements run inside the ``with`` block."""

    def __enter__(self):
        from django.db import connection

        self.count = 0
        self._cm = connection.execute_wrapper(self)
        self._cm.__enter__()
        return self

    def __call__(self, execute, sql, params, many, context):
        self.count += 1
        return execute(sql, params, many, context)

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)


def bench(tenants: int, records: int, heavy: int, profile: str | None = None) -> dict:
    from django.db import connection
    from django.test import Client

    from metering.models import Invoice, InvoiceStatus, UsageRecord
    from metering.services.invoices import invoice_run

    t0 = time.perf_counter()
    _, token, made = seed(tenants, records, heavy)
    with connection.cursor() as c:
        c.execute("ANALYZE")
    print(f"seeded {tenants} tenants, {made} usage records in {time.perf_counter() - t0:.1f} s")

    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    with CountQueries() as q:
        built = invoice_run(period_start=MARCH, now=datetime(2024, 4, 1, 1, tzinfo=UTC))
    run_s, run_queries = time.perf_counter() - t0, q.count
    if prof:
        prof.disable()
        prof.dump_stats(profile)
    assert len(built) == tenants and all(i.status == InvoiceStatus.DRAFT for i in built)
    print(f"invoice run (drafts): {len(built)} invoices in {run_s:.2f} s, {run_queries} queries")

    t0 = time.perf_counter()
    with CountQueries() as q:
        invoice_run(period_start=MARCH, now=datetime(2024, 4, 5, 1, tzinfo=UTC))
    finalize_s, finalize_queries = time.perf_counter() - t0, q.count
    finalized = Invoice.objects.filter(status=InvoiceStatus.FINALIZED).count()
    assert finalized == tenants, finalized
    from django.db.models import Sum

    from metering.models import InvoiceLine, LineKind

    billed = Invoice.objects.aggregate(s=Sum("total"))["s"]
    rated = UsageRecord.objects.aggregate(s=Sum("amount"))["s"]
    fees = InvoiceLine.objects.filter(kind__in=[LineKind.RESERVED_FEE, LineKind.CANCEL_FEE]).aggregate(
        s=Sum("amount")
    )["s"]
    memory = InvoiceLine.objects.filter(kind=LineKind.GPU_MEMORY).aggregate(s=Sum("amount"))["s"]
    print(
        f"invoice run (finalize): {finalized} invoices in {finalize_s:.2f} s, {finalize_queries} queries; "
        f"billed {billed}: rated usage {rated} (GPU memory lines {memory}) + reservation fees {fees}"
    )

    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    base = "/api/v1/usage/?period=2024-03-01"

    def timed(url: str) -> tuple[float, dict, int]:
        with CountQueries() as q:
            t0 = time.perf_counter()
            r = client.get(url)
            elapsed = time.perf_counter() - t0
        assert r.status_code == 200, r.content[:300]
        return elapsed, r.json(), q.count

    month, first, walk = [], [], []
    for _ in range(5):
        elapsed, body, month_queries = timed(f"{base}&page_size={heavy}")
        month.append(elapsed)
        assert len(body["results"]) == heavy and body["next"] is None, (len(body["results"]), body["next"])
        elapsed, body, page_queries = timed(f"{base}&page_size=200")
        first.append(elapsed)
    for _ in range(3):
        t0 = time.perf_counter()
        nxt, pages, seen = f"{base}&page_size=200", 0, 0
        while nxt:
            body = client.get(nxt).json()
            pages += 1
            seen += len(body["results"])
            nxt = body["next"]
        walk.append(time.perf_counter() - t0)
    assert seen == heavy, seen
    print(
        f"usage API, {heavy} records in one call (page_size={heavy}): {min(month) * 1000:.1f} ms "
        f"(median {statistics.median(month) * 1000:.1f}, {month_queries} queries); "
        f"first page of 200 {min(first) * 1000:.1f} ms ({page_queries} queries); "
        f"cursor walk by 200 ({pages} pages) {min(walk) * 1000:.1f} ms"
    )
    return {
        "invoice_run_s": round(run_s, 2),
        "invoice_run_queries": run_queries,
        "invoice_finalize_run_s": round(finalize_s, 2),
        "invoice_finalize_run_queries": finalize_queries,
        "tenants": tenants,
        "usage_records": made,
        "usage_api_ms": round(min(month) * 1000, 1),
        "usage_api_median_ms": round(statistics.median(month) * 1000, 1),
        "usage_api_queries": month_queries,
        "usage_api_records": heavy,
        "usage_api_first_page_ms": round(min(first) * 1000, 1),
        "usage_api_walk_200_ms": round(min(walk) * 1000, 1),
        "usage_api_walk_pages": pages,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument("--heavy", type=int, default=10_000)
    ap.add_argument("--profile", help="write a cProfile of the first (drafts) run to this file")
    a = ap.parse_args()
    base = django_on_own_database(DB_NAME, ROOT, ALLOWED_HOSTS="testserver", API_RATE_LIMIT="100000/min")
    try:
        from django.core.management import call_command
        from django.db import connections

        call_command("migrate", verbosity=0)
        out = bench(a.tenants, a.records, a.heavy, a.profile)
        connections.close_all()
    finally:
        drop_database(base, DB_NAME)
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
