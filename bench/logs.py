"""Workload logs: lines per second through the real ingest endpoint, and follow latency.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test [REDIS_URL=redis://127.0.0.1:6379/N] \\
        .venv/bin/python bench/logs.py [--duration 10] [--workers 1]

Creates (drops first) a database of its own (``gpupool_logbench``), migrates it, registers a node,
places a job on it with a real scheduling cycle, and starts uvicorn (httptools, uvloop) serving
``portal.asgi``. Then:

1. Ingest: for ``--duration`` seconds, ``--concurrency`` keep-alive connections post batches of
   ``--batch`` lines (``POST /agent/v1/nodes/<id>/logs``, the agent's shape, ~100-byte lines), each
   its own seq; lines/s counts the lines the portal answered as stored.
2. Follow latency: a ``?follow=1`` stream (bearer token, read scope) is open while one-line
   batches are posted every 50 ms; each line carries the time its POST began, and the latency is
   from then to its arrival on the stream (p50, p95, max over ``--samples`` lines).

The last line printed is JSON with ``lines_per_s`` and ``follow_p95_ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ingest import free_port, server_env  # noqa: E402
from bench.pgdb import recreate_database  # noqa: E402

H100 = "NVIDIA H100 SXM 80GB"


def setup(db_url: str) -> tuple[int, str, int, str]:
    """(node id, node credential, job id, read token) in the bench database."""
    import django

    django.setup()
    from django.db import connection
    from django.utils import timezone

    from nodes.models import Node, NodeState, Region
    from nodes.services.registration import GpuInfo, NodeInfo, bootstrap_token_create, node_register
    from portal.actors import Actor
    from portal.services.tenants import tenant_create
    from portal.services.tokens import api_token_create
    from scheduling.models import Allocation
    from scheduling.services.cycle import scheduling_cycle_run
    from scheduling.services.submission import workload_submit

    region = Region.objects.create(code="bench-1", name="Bench", location="here")
    token = bootstrap_token_create(region=region, actor=Actor.system())[1]
    node, credential = node_register(
        bootstrap_token=token,
        info=NodeInfo(
            hostname="logbench-1", cpu_cores=64, ram_mib=512 * 1024,
            gpus=(GpuInfo(index=0, uuid="GPU-logbench-0", name=H100, memory_mib=81920),),
        ),
    )  # fmt: skip
    Node.objects.filter(pk=node.pk).update(state=NodeState.READY, last_heartbeat_at=timezone.now())
    tenant = tenant_create(slug="bench", name="Bench", owner_email="o@bench.test", actor=Actor.system())
    job = workload_submit(
        tenant=tenant,
        kind="job",
        spec={"image": "ghcr.io/acme/train:1", "command": ["train"], "gpu_models": [H100]},
        actor=Actor.system(),
    )
    scheduling_cycle_run()
    assert Allocation.objects.filter(workload=job, node=node).exists(), "the job was not placed"
    reader = api_token_create(tenant=tenant, name="bench", scopes=["read"], actor=Actor.system())[1]
    connection.close()
    return node.pk, credential, job.pk, reader


async def ingest(base: str, node_id: int, credential: str, job_id: int, args) -> tuple[int, float]:
    """Post batches for ``args.duration`` seconds; (lines stored, seconds)."""
    text = "step 123456: loss 0.012345 lr 3.0e-4 grad_norm 1.2345 tokens/s 123456.7 " + "x" * 28
    seqs = iter(range(1, 10**9))
    stored = 0
    url = f"{base}/agent/v1/nodes/{node_id}/logs"
    headers = {"Authorization": f"Node {credential}", "Content-Type": "application/json"}

    # The client must not be what is measured: a batch is built from bytes made once (building
    # 5,000 lists and dumping them was most of this process's CPU), with the time of sending.
    line = orjson.dumps([0.0, "stdout", text])[len(b"[0.0") :]  # b',"stdout","..."]'
    head = b'{"seq":%d,"workloads":[{"workload_id":"%d","lines":['
    tail = b"]}]}"

    def body(seq: int) -> bytes:
        at = b"[" + orjson.dumps(time.time())
        return head % (seq, job_id) + b",".join([at + line] * args.batch) + tail

    async def worker(client: httpx.AsyncClient, until: float) -> None:
        nonlocal stored
        while time.monotonic() < until:
            response = await client.post(url, content=body(next(seqs)), headers=headers)
            assert response.status_code == 200, response.text
            stored += response.json()["lines"]

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await worker(client, time.monotonic() + 1)  # warm: connections, caches
        stored = 0
        began = time.monotonic()
        until = began + args.duration
        await asyncio.gather(*(worker(client, until) for _ in range(args.concurrency)))
        return stored, time.monotonic() - began


def follow_latency(
    base: str, node_id: int, credential: str, job_id: int, reader: str, samples: int
) -> list[float]:
    arrivals: queue.Queue = queue.Queue()
    opened = threading.Event()

    def listen() -> None:
        url = f"{base}/api/v1/jobs/{job_id}/logs/?follow=1&tail=1"
        with (
            httpx.Client(timeout=httpx.Timeout(10, read=60)) as client,
            client.stream("GET", url, headers={"Authorization": f"Bearer {reader}"}) as response,
        ):
            assert response.status_code == 200, response.read()
            opened.set()
            for raw in response.iter_lines():
                if raw.startswith("data: ") and (text := json.loads(raw[6:])["text"]).startswith("follow-"):
                    arrivals.put((text, time.perf_counter()))
                    if arrivals.qsize() >= samples:
                        return

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    assert opened.wait(10), "the follow stream did not open"
    time.sleep(0.3)
    headers = {"Authorization": f"Node {credential}", "Content-Type": "application/json"}
    sent: dict[str, float] = {}
    with httpx.Client(timeout=10) as client:
        for i in range(samples):
            marker = f"follow-{i}"
            started = time.perf_counter()
            sent[marker] = started
            body = {
                "seq": 10**8 + i,
                "workloads": [{"workload_id": str(job_id), "lines": [[time.time(), "stdout", marker]]}],
            }
            assert (
                client.post(
                    f"{base}/agent/v1/nodes/{node_id}/logs", content=orjson.dumps(body), headers=headers
                ).status_code
                == 200
            )
            time.sleep(0.05)
    thread.join(30)
    latencies = []
    while not arrivals.empty():
        marker, at = arrivals.get()
        latencies.append((at - sent[marker]) * 1000)
    assert len(latencies) == samples, f"{len(latencies)} of {samples} lines arrived"
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument(
        "--batch", type=int, default=5000, help="lines per batch (the agent's BATCH_MAX_LINES)"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    parser.add_argument("--samples", type=int, default=100, help="follow latency samples")
    parser.add_argument("--db-name", default="gpupool_logbench")
    args = parser.parse_args()
    base_db = os.environ.get("DATABASE_URL", "")
    if not base_db.startswith(("postgres://", "postgresql://")):
        print("DATABASE_URL must point at PostgreSQL", file=sys.stderr)
        return 2
    db_url = recreate_database(base_db, args.db_name)
    env = server_env(db_url)
    env["SCHEDULING_TRIGGER_CYCLES"] = "0"
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    os.environ.update(env)
    node_id, credential, job_id, reader = setup(db_url)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(args.workers), "--http", "httptools", "--loop", "uvloop", "--log-level", "warning",
         "--no-access-log", "--lifespan", "off", "--timeout-graceful-shutdown", "2"],
        cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            print("the server did not start", file=sys.stderr)
            return 1
        redis = "yes" if env.get("REDIS_URL") else "no (in-memory channel layer)"
        print(f"uvicorn: {args.workers} worker(s), redis: {redis}, cpus: {os.cpu_count()}")
        stored, seconds = asyncio.run(ingest(base, node_id, credential, job_id, args))
        lines_per_s = stored / seconds
        print(f"ingest: {stored} lines in {seconds:.1f} s = {lines_per_s:,.0f} lines/s "
              f"({args.concurrency} connections, {args.batch} lines per batch)")  # fmt: skip
        latencies = sorted(follow_latency(base, node_id, credential, job_id, reader, args.samples))
        p95 = latencies[max(0, round(0.95 * len(latencies)) - 1)]
        print(f"follow: p50 {statistics.median(latencies):.1f} ms, p95 {p95:.1f} ms, max {latencies[-1]:.1f} ms "
              f"over {len(latencies)} lines")  # fmt: skip
        print(json.dumps({"lines_per_s": round(lines_per_s), "follow_p95_ms": round(p95, 1),
                          "follow_p50_ms": round(statistics.median(latencies), 1), "workers": args.workers,
                          "batch": args.batch, "concurrency": args.concurrency}))  # fmt: skip
        return 0
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    sys.exit(main())
