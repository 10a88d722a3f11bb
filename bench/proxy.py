"""The portal's proxy to workloads' HTTP ports (``scheduling/proxy.py``): requests per second and
latency through ``/proxy/<id>/<port>/`` versus the same upstream reached directly, and a websocket
message's round trip both ways.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/proxy.py

Makes its own database (``gpupool_bench_proxy``: created, migrated, dropped at the end) with one
tenant, a read token and one RUNNING instance whose port 8080 the node "published" on an aiohttp
upstream of the bench's own (a 1 KiB page and a websocket echo, in a process of its own). The portal
is uvicorn serving ``portal.asgi`` in another process, as ``make run`` starts it. The load is httpx
from this process: ``--seconds`` at ``--concurrency`` for requests per second, then ``--samples``
one at a time for latency (p50 and p95; the proxy's added latency is the difference, and includes
its per-request database check of who may pass). Prints a line per figure, then one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pgdb import django_on_own_database, drop_database  # noqa: E402

DB_NAME = "gpupool_bench_proxy"
H100 = "NVIDIA H100 SXM 80GB"
PAGE = b"x" * 1024

UPSTREAM = """
import sys
from aiohttp import web, WSMsgType

async def page(request):
    return web.Response(body=b"x" * 1024, content_type="text/plain")

async def ws(request):
    sock = web.WebSocketResponse()
    await sock.prepare(request)
    async for message in sock:
        if message.type == WSMsgType.TEXT:
            await sock.send_str(message.data)
    return sock

app = web.Application()
app.router.add_get("/proxy/{wid}/8080/", page)
app.router.add_get("/proxy/{wid}/8080/ws", ws)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listens on {port} after {timeout} s")


def seed(upstream_port: int):
    from django.utils import timezone

    from nodes.models import CommandKind, CommandState, Gpu, GpuModel, Node, NodeState, Region
    from portal.actors import Actor
    from portal.models import Membership, Role
    from portal.services.tenants import tenant_create
    from portal.services.tokens import api_token_create
    from scheduling.models import Allocation
    from scheduling.services.cycle import scheduling_cycle_run
    from scheduling.services.lifecycle import workload_on_command_finished
    from scheduling.services.submission import workload_submit

    region = Region.objects.create(code="us-east-1", name="US East")
    node = Node.objects.create(
        hostname="gpu-0001", address="127.0.0.1", region=region, cpu_cores=96, ram_mib=1024 * 1024,
        state=NodeState.READY, last_heartbeat_at=timezone.now(),
    )  # fmt: skip
    model = GpuModel.objects.get(name=H100)
    Gpu.objects.create(node=node, index=0, uuid="GPU-bench-0", model=model, reported_name=model.name,
                       memory_mib=model.memory_gib * 1024)  # fmt: skip
    tenant = tenant_create(slug="acme", name="Acme", owner_email="owner@acme.test", actor=Actor.system())
    owner = Membership.objects.get(tenant=tenant, role=Role.OWNER).user
    _, token = api_token_create(tenant=tenant, name="bench", scopes=["read"], actor=Actor(user=owner))
    spec = {"gpu_models": [H100], "image": "ghcr.io/acme/notebook:1", "ports": [8080]}
    w = workload_submit(tenant=tenant, kind="instance", spec=spec, actor=Actor.system())
    scheduling_cycle_run()
    assert Allocation.objects.filter(workload=w, node=node).exists(), "the instance was not placed"
    workload_on_command_finished(
        kind=CommandKind.START_WORKLOAD,
        payload={"workload_id": str(w.pk), "attempt": 1},
        node_id=node.pk,
        state=CommandState.SUCCEEDED,
        result={
            "workload_id": str(w.pk),
            "ref": "bench",
            "ports": {"8080": upstream_port},
            "runtime": "docker",
        },
    )
    return w.pk, token


async def throughput(url: str, headers: dict[str, str], seconds: float, concurrency: int) -> float:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=30) as client:
        deadline = time.perf_counter() + seconds
        done = 0

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                r = await client.get(url)
                assert r.status_code == 200 and r.content == PAGE, r.status_code
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def latencies(url: str, headers: dict[str, str], samples: int) -> list[float]:
    import httpx

    with httpx.Client(headers=headers, timeout=30) as client:
        client.get(url)
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            r = client.get(url)
            times.append((time.perf_counter() - start) * 1000)
            assert r.status_code == 200
    return times


def ws_round_trips(url: str, headers: dict[str, str], samples: int) -> list[float]:
    from websockets.sync.client import connect

    with connect(url, additional_headers=headers) as ws:
        times = []
        for i in range(samples):
            start = time.perf_counter()
            ws.send(f"m{i}")
            assert ws.recv(timeout=10) == f"m{i}"
            times.append((time.perf_counter() - start) * 1000)
    return times


def pct(values: list[float], q: float) -> float:
    return round(statistics.quantiles(values, n=100)[int(q) - 1], 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--samples", type=int, default=500)
    a = ap.parse_args()
    base = django_on_own_database(DB_NAME, ROOT, ALLOWED_HOSTS="127.0.0.1", SCHEDULING_TRIGGER_CYCLES="0")
    procs: list[subprocess.Popen] = []
    try:
        from django.core.management import call_command
        from django.db import connections

        call_command("migrate", verbosity=0)
        upstream_port, portal_port = free_port(), free_port()
        wid, token = seed(upstream_port)
        connections.close_all()
        procs.append(subprocess.Popen([sys.executable, "-c", UPSTREAM, str(upstream_port)]))
        server = [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1",
                  "--port", str(portal_port), "--log-level", "warning", "--no-access-log"]  # fmt: skip
        procs.append(subprocess.Popen(server, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}))
        wait_listening(upstream_port)
        wait_listening(portal_port)
        auth = {"Authorization": f"Bearer {token}"}
        path = f"/proxy/{wid}/8080/"
        direct, proxied = f"http://127.0.0.1:{upstream_port}{path}", f"http://127.0.0.1:{portal_port}{path}"

        out: dict[str, float | int] = {
            "concurrency": a.concurrency,
            "seconds": a.seconds,
            "samples": a.samples,
        }
        for name, url in (("direct", direct), ("proxy", proxied)):
            out[f"{name}_rps"] = round(asyncio.run(throughput(url, auth, a.seconds, a.concurrency)), 1)
            times = latencies(url, auth, a.samples)
            out[f"{name}_p50_ms"], out[f"{name}_p95_ms"] = pct(times, 50), pct(times, 95)
            ws_times = ws_round_trips(url.replace("http://", "ws://") + "ws", auth, a.samples)
            out[f"ws_{name}_p50_ms"], out[f"ws_{name}_p95_ms"] = pct(ws_times, 50), pct(ws_times, 95)
        out["added_p50_ms"] = round(out["proxy_p50_ms"] - out["direct_p50_ms"], 3)
        out["added_p95_ms"] = round(out["proxy_p95_ms"] - out["direct_p95_ms"], 3)
        out["ws_added_p50_ms"] = round(out["ws_proxy_p50_ms"] - out["ws_direct_p50_ms"], 3)
        for key, value in out.items():
            print(f"{key:24} {value}")
        print(json.dumps(out))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        from django.db import connections

        connections.close_all()
        drop_database(base, DB_NAME)


if __name__ == "__main__":
    main()
