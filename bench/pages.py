"""Server time of every main web page on a realistic data set, on PostgreSQL.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/pages.py

Makes its own database (``gpupool_bench_pages``: created, migrated, dropped at the end) and fills it:
``--tenants`` tenants (default 20) with ``--workloads`` workloads (default 3,000; the first tenant,
"heavy", has a third of them) in every state, running ones holding GPUs of a fleet of ``--nodes``
nodes (default 500, 8 GPUs each, H100 and A100, two regions), about 45 days of finished allocations
(the heavy tenant's come to about 10,000 usage records a month) turned into usage records and
invoices by the real metering run (``invoice_run`` for the last two months), members and tokens,
quotas, workload events, and a month of per-minute telemetry rollups for ``--rollup-nodes`` nodes.

Then it requests every page as the right person with the Django test client: each sidebar entry
registered in ``portal.dashboard`` (staff-only entries as a staff superuser, the others as the heavy
tenant's owner), each dashboard panel, and the detail pages (a workload, a node, a tenant's quota,
the workloads list at 100 per page). Pages registered later are measured without changing this
file. Each page is requested ``--repeat`` times after one warm-up; the table lists the best and
median server time and the SQL statements per page, slowest first. The last line is one JSON
object: ``{"slowest_page": ..., "slowest_ms": ..., "pages": {name: {...}}}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.invoices import CountQueries  # noqa: E402
from bench.pgdb import django_on_own_database, drop_database  # noqa: E402

DB_NAME = "gpupool_bench_pages"
H100 = "NVIDIA H100 SXM 80GB"
A100 = "NVIDIA A100 SXM 80GB"
BUDGET_MS = 300.0


def _month_start(dt: datetime) -> datetime:
    return dt.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def seed(a: argparse.Namespace) -> dict:
    from django.utils import timezone

    from metering.models import RateCard
    from metering.services.invoices import invoice_run
    from metering.services.rates import rate_card_version_create
    from nodes.models import Gpu, GpuMinuteRollup, GpuModel, Node, NodeState, Region
    from portal.actors import Actor
    from portal.bulk import bulk_insert
    from portal.models import Membership, Role, Tenant, User
    from portal.services.tokens import api_token_create
    from scheduling.models import Allocation, Plan, Quota, QuotaModelLimit, Workload, WorkloadEvent

    rnd = random.Random(7)
    now = timezone.now()
    h100, a100 = GpuModel.objects.get(name=H100), GpuModel.objects.get(name=A100)
    us = Region.objects.get_or_create(code="us-east-1", defaults={"name": "US East"})[0]
    eu = Region.objects.get_or_create(code="eu-west-1", defaults={"name": "EU West"})[0]
    card = RateCard.objects.create(name="Standard", currency="USD", is_default=True)
    prices = {(h100.pk, Plan.ON_DEMAND): "2.00", (h100.pk, Plan.SPOT): "0.80"}
    prices |= {(a100.pk, Plan.ON_DEMAND): "1.00", (a100.pk, Plan.SPOT): "0.40"}
    rate_card_version_create(
        rate_card=card, effective_from=datetime(2020, 1, 1, tzinfo=UTC), gpu_prices=prices, allow_past=True
    )

    # The fleet: 4/5 H100, 1/5 A100, two regions, a few nodes out of service.
    states = [NodeState.READY] * 46 + [
        NodeState.CORDONED,
        NodeState.DRAINING,
        NodeState.DOWN,
        NodeState.MAINTENANCE,
    ]
    nodes = Node.objects.bulk_create(
        Node(
            hostname=f"gpu-{i:04d}",
            region=us if i % 3 else eu,
            cpu_cores=128,
            ram_mib=2 * 1024 * 1024,
            driver_version="560.35.03",
            cuda_version="12.6",
            agent_version="0.1.0",
            interconnect="nvswitch",
            state=states[i % len(states)],
            last_heartbeat_at=now - timedelta(seconds=rnd.randint(1, 20)),
            registered_at=now - timedelta(days=90),
        )
        for i in range(a.nodes)
    )
    node_model = {n.pk: (a100 if i % 5 == 4 else h100) for i, n in enumerate(nodes)}
    Gpu.objects.bulk_create(
        (
            Gpu(
                node=n,
                index=g,
                uuid=f"GPU-{n.hostname}-{g}",
                model=node_model[n.pk],
                reported_name=node_model[n.pk].name,
                memory_mib=node_model[n.pk].memory_gib * 1024,
                nvlink_island=0,
                last_sample_at=now,
                last_util_pct=rnd.uniform(0, 100),
                last_mem_used_mib=rnd.randint(0, 80_000),
                last_power_w=rnd.uniform(80, 700),
                last_temp_c=rnd.randint(30, 80),
            )
            for n in nodes
            for g in range(8)
        ),
        batch_size=2000,
    )
    ready_gpus = list(
        Gpu.objects.filter(node__state=NodeState.READY)
        .order_by("node_id", "index")
        .values_list("pk", "node_id", "model_id")
    )

    # Tenants: the heavy one has an owner, members and tokens.
    Tenant.objects.bulk_create(
        Tenant(
            name=f"Tenant {i:02d}" if i else "Heavy Tenant",
            slug=f"t{i:02d}" if i else "heavy",
            billing_email=f"billing@t{i}.test",
        )
        for i in range(a.tenants)
    )
    tenants = list(Tenant.objects.order_by("pk"))
    heavy = tenants[0]
    owner = User.objects.create_user(email="owner@heavy.test", password="bench-pw-1", full_name="Heavy Owner")
    Membership.objects.create(tenant=heavy, user=owner, role=Role.OWNER)
    for i, role in enumerate([Role.ADMIN, Role.MEMBER, Role.MEMBER, Role.BILLING, Role.VIEWER] * 2):
        u = User.objects.create_user(email=f"m{i}@heavy.test", password="bench-pw-1")
        Membership.objects.create(tenant=heavy, user=u, role=role)
    for i in range(5):
        api_token_create(tenant=heavy, name=f"ci-{i}", scopes=["read", "write"], actor=Actor(user=owner))
    Quota.objects.bulk_create(
        Quota(
            tenant=t,
            max_gpus_total=512 if t == heavy else 64,
            max_concurrent_workloads=1200 if t == heavy else 150,
        )
        for t in tenants
    )
    for q in Quota.objects.all()[:5]:
        QuotaModelLimit.objects.create(quota=q, gpu_model=a100, max_gpus=32)

    # Workloads: the heavy tenant a third, the rest shared; 60 % finished, 25 % holding GPUs, 15 % waiting.
    per_tenant = [a.workloads // 3] + [(a.workloads - a.workloads // 3) // (a.tenants - 1)] * (a.tenants - 1)
    per_tenant[-1] += a.workloads - sum(per_tenant)
    finished = ["succeeded", "stopped", "failed"]
    rows = []
    for t, n in zip(tenants, per_tenant, strict=True):
        for k in range(n):
            r = k % 20
            state = finished[k % 3] if r < 12 else "running" if r < 17 else "queued" if r < 19 else "pending"
            submitted = now - timedelta(minutes=rnd.randint(5, 45 * 24 * 60))
            kind = "job" if k % 4 else "instance"
            rows.append(
                Workload(
                    tenant=t,
                    kind=kind,
                    name=f"{kind}-{k:04d}",
                    state=state,
                    plan=Plan.SPOT if k % 7 == 0 else Plan.ON_DEMAND,
                    gpu_count=rnd.choice([1, 1, 2, 4]),
                    image="ghcr.io/acme/train:1",
                    command=["python", "train.py"] if kind == "job" else [],
                    submitted_at=submitted,
                    state_changed_at=submitted + timedelta(minutes=2),
                    started_at=submitted + timedelta(minutes=2) if r < 17 else None,
                    finished_at=submitted + timedelta(hours=6) if r < 12 else None,
                    pending_reason="no_capacity" if r >= 17 and k % 2 else ("quota" if r >= 17 else ""),
                    pending_message="No node has room for it now." if r >= 17 else "",
                    log_tail="epoch 3/10 loss 0.231\n" * 20 if kind == "job" else "",
                )
            )
    workloads = Workload.objects.bulk_create(rows, batch_size=2000)
    waiting_models = Workload.gpu_models.through
    waiting_models.objects.bulk_create(
        waiting_models(workload_id=w.pk, gpumodel_id=(h100 if w.pk % 3 else a100).pk)
        for w in workloads
        if w.state in ("queued", "pending")
    )
    events = []
    for w in workloads:
        steps = [
            (w.submitted_at, "", "pending", "submitted"),
            (w.submitted_at, "pending", "queued", "admitted"),
            (w.started_at, "queued", "running", "started"),
            (w.finished_at, "running", w.state, "exited"),
        ]
        events.extend(
            WorkloadEvent(
                tenant_id=w.tenant_id, workload=w, at=at, from_state=src, to_state=dst, reason=reason
            )
            for at, src, dst, reason in steps
            if at
        )

    # Allocations: running workloads hold distinct GPUs (the heavy tenant's first ones on the nodes
    # with telemetry); finished ones held GPUs in the last 45 days, more than once for the heavy tenant.
    allocations = []
    free = iter(ready_gpus)
    running = sorted(
        (w for w in workloads if w.state == "running"), key=lambda w: (w.tenant_id != heavy.pk, w.pk)
    )
    detail_workload = running[0]
    for w in running:
        for _ in range(w.gpu_count):
            gpu_id, node_id, model_id = next(free)
            allocations.append(
                Allocation(
                    tenant_id=w.tenant_id,
                    workload=w,
                    node_id=node_id,
                    gpu_id=gpu_id,
                    gpu_model_id=model_id,
                    plan=w.plan,
                    started_at=w.started_at,
                )
            )
    history = now - timedelta(days=45)
    for w in workloads:
        if w.state not in finished:
            continue
        runs = a.heavy_runs if w.tenant_id == heavy.pk else 1
        for _ in range(runs):
            start = history + timedelta(minutes=rnd.randint(0, 44 * 24 * 60))
            # Billing starts at the RUNNING event inside the allocation (metering.services.usage).
            events.append(
                WorkloadEvent(
                    tenant_id=w.tenant_id,
                    workload=w,
                    at=start + timedelta(seconds=30),
                    from_state="starting",
                    to_state="running",
                    reason="started",
                )
            )
            for _ in range(w.gpu_count):
                gpu_id, node_id, model_id = ready_gpus[rnd.randrange(len(ready_gpus))]
                allocations.append(
                    Allocation(
                        tenant_id=w.tenant_id,
                        workload=w,
                        node_id=node_id,
                        gpu_id=gpu_id,
                        gpu_model_id=model_id,
                        plan=w.plan,
                        started_at=start,
                        ended_at=start + timedelta(hours=rnd.randint(1, 8)),
                        end_reason="exited",
                    )
                )
    Allocation.objects.bulk_create(allocations, batch_size=2000)
    bulk_insert(events)

    # A month of per-minute rollups for the first nodes (where the heavy tenant's workloads run).
    rollups = 0
    telemetry_nodes = sorted({nid for _, nid, _ in ready_gpus})[: a.rollup_nodes]
    gpu_ids = list(Gpu.objects.filter(node_id__in=telemetry_nodes).values_list("pk", flat=True))
    first = (now - timedelta(days=a.rollup_days)).replace(second=0, microsecond=0)
    minutes = a.rollup_days * 24 * 60
    batch = []
    for gid in gpu_ids:
        for m in range(minutes):
            u = 50 + 40 * ((m % 120) / 120)
            batch.append(
                GpuMinuteRollup(
                    gpu_id=gid,
                    minute=first + timedelta(minutes=m),
                    sample_count=6,
                    util_sum=u * 6,
                    util_count=6,
                    util_max=u,
                    mem_used_sum=6 * 40_000,
                    mem_used_count=6,
                    mem_used_max=41_000,
                    power_sum=6 * 450.0,
                    power_count=6,
                    temp_max=70,
                )
            )
            if len(batch) >= 100_000:
                bulk_insert(batch)
                rollups += len(batch)
                batch = []
    bulk_insert(batch)
    rollups += len(batch)

    # Usage records and invoices by the real metering run: the month before last, then last month.
    last_month = _month_start(_month_start(now) - timedelta(days=1))
    before_last = _month_start(last_month - timedelta(days=1))
    invoice_run(period_start=before_last.date(), now=now)
    invoice_run(period_start=last_month.date(), now=now)

    staff = User.objects.create_superuser(email="ops@bench.test", password="bench-pw-1")
    from metering.models import Invoice, UsageRecord

    this_month = UsageRecord.objects.filter(tenant=heavy, start__gte=now - timedelta(days=30)).count()
    return {
        "heavy": heavy,
        "owner": owner,
        "staff": staff,
        "detail_workload": detail_workload,
        "detail_node": telemetry_nodes[0],
        "counts": {
            "tenants": len(tenants),
            "workloads": len(workloads),
            "nodes": len(nodes),
            "gpus": len(nodes) * 8,
            "allocations": len(allocations),
            "usage_records": UsageRecord.objects.count(),
            "heavy_usage_records_30d": this_month,
            "invoices": Invoice.objects.count(),
            "events": len(events),
            "rollups": rollups,
        },
    }


def pages(data: dict) -> list[tuple[str, str, str]]:
    """(name, url, who) for every sidebar entry and dashboard panel, and the detail pages."""
    from django.urls import NoReverseMatch, reverse

    from portal.dashboard import _nav, panels_for
    from portal.models import Membership

    out = []
    for item in sorted(_nav.values(), key=lambda i: (i.order, i.name)):
        try:
            url = item.url
        except NoReverseMatch:  # an entry whose URLs are not mounted
            continue
        out.append((item.name, url, "staff" if item.staff_only else "owner"))
    membership = Membership.objects.get(tenant=data["heavy"], user=data["owner"])
    for p in panels_for(membership):
        out.append((f"panel:{p.name}", p.url, "owner"))
    w, heavy = data["detail_workload"], data["heavy"]
    out += [
        ("workloads (100 per page)", reverse("scheduling:workloads") + "?per_page=100", "owner"),
        ("workloads (waiting)", reverse("scheduling:workloads") + "?state=waiting&per_page=100", "owner"),
        ("workload detail", reverse("scheduling:workload", args=[w.pk]), "owner"),
        ("workload live", reverse("scheduling:workload-live", args=[w.pk]), "owner"),
        ("workload telemetry", reverse("scheduling:workload-telemetry", args=[w.pk]), "owner"),
        ("node detail", reverse("nodes:node", args=[data["detail_node"]]), "staff"),
        ("node detail (24h)", reverse("nodes:node", args=[data["detail_node"]]) + "?range=24h", "staff"),
        ("quota edit", reverse("scheduling:staff-quota", args=[heavy.pk]), "staff"),
        ("quotas (at limit)", reverse("scheduling:staff-quotas") + "?status=limited", "staff"),
    ]
    for name in ("metering:finance-gpu-hours", "metering:finance-receivables", "metering:usage"):
        with contextlib.suppress(NoReverseMatch):  # not there yet
            out.append((name.split(":")[1], reverse(name), "staff" if "finance" in name else "owner"))
    seen, unique = set(), []
    for name, url, who in out:
        if (url, who) not in seen:
            seen.add((url, who))
            unique.append((name, url, who))
    return unique


def measure(data: dict, repeat: int) -> dict:
    from django.test import Client

    from portal.middleware import SESSION_TENANT_KEY

    owner = Client()
    owner.force_login(data["owner"])
    session = owner.session
    session[SESSION_TENANT_KEY] = data["heavy"].pk
    session.save()
    staff = Client()
    staff.force_login(data["staff"])
    clients = {"owner": owner, "staff": staff}
    results = {}
    for name, url, who in pages(data):
        client = clients[who]
        headers = {"HTTP_HX_REQUEST": "true"} if name.startswith("panel:") else {}
        client.get(url, **headers)  # warm-up: templates compiled, caches filled
        times = []
        for _ in range(repeat):
            with CountQueries() as q:
                t0 = time.perf_counter()
                response = client.get(url, **headers)
                times.append(time.perf_counter() - t0)
        results[name] = {
            "url": url,
            "as": who,
            "status": response.status_code,
            "best_ms": round(min(times) * 1000, 1),
            "median_ms": round(statistics.median(times) * 1000, 1),
            "queries": q.count,
            "bytes": len(response.content),
        }
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tenants", type=int, default=20)
    ap.add_argument("--workloads", type=int, default=3000)
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument(
        "--heavy-runs", type=int, default=12, help="placements of each finished workload of the heavy tenant"
    )
    ap.add_argument("--rollup-nodes", type=int, default=2)
    ap.add_argument("--rollup-days", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the database (to look at query plans)")
    a = ap.parse_args()
    base = django_on_own_database(DB_NAME, ROOT, ALLOWED_HOSTS="testserver", SCHEDULING_TRIGGER_CYCLES="0")
    try:
        from django.conf import settings

        # Pages render {% static %} links: no collectstatic manifest here.
        settings.STORAGES["staticfiles"] = {
            "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        }
        settings.SCHEDULING_TRIGGER_CYCLES = False
        from django.core.management import call_command
        from django.db import connection, connections

        call_command("migrate", verbosity=0)
        t0 = time.perf_counter()
        data = seed(a)
        with connection.cursor() as c:
            c.execute("ANALYZE")
        counts = data["counts"]
        print(
            f"seeded in {time.perf_counter() - t0:.1f} s: "
            + ", ".join(f"{k} {v:,}" for k, v in counts.items())
        )
        results = measure(data, a.repeat)
        connections.close_all()
    finally:
        if not a.keep:
            drop_database(base, DB_NAME)
    ranked = sorted(results.items(), key=lambda kv: -kv[1]["best_ms"])
    print(f"{'page':28s} {'as':5s} {'best ms':>8s} {'median':>8s} {'queries':>7s} {'status':>6s}  url")
    for name, r in ranked:
        flag = "  OVER 300 ms" if r["best_ms"] > BUDGET_MS else ""
        print(
            f"{name:28s} {r['as']:5s} {r['best_ms']:8.1f} {r['median_ms']:8.1f} {r['queries']:7d} {r['status']:6d}  {r['url']}{flag}"
        )
    bad = [n for n, r in results.items() if r["status"] != 200]
    if bad:
        print("pages not answering 200: " + ", ".join(bad))
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    slowest = ranked[0] if ranked else ("", {"best_ms": 0.0})
    print(
        json.dumps(
            {
                "slowest_page": slowest[0],
                "slowest_ms": slowest[1]["best_ms"],
                "data": counts,
                "pages": results,
            }
        )
    )


if __name__ == "__main__":
    main()
