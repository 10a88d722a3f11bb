"""Heartbeat ingest and command round trip through the real HTTP endpoints and PostgreSQL.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/ingest.py

Creates (drops first) a database of its own (``gpupool_bench`` on the same server), migrates it,
starts uvicorn on a free port, registers simulated nodes (8 GPUs each) through ``/agent/v1/register``,
then for a fixed time several client processes post heartbeats (``--ticks`` readings of each GPU per
batch, as an agent sends when it samples every second and posts every few seconds, or replays its
buffer). It prints samples/s, the database growth per GPU-day, then the command round trip
(``node_command_enqueue`` in this process -> the agent's long poll receives it -> its ``accepted``
report is answered), and ends with one JSON line. REDIS_URL, when set, is passed to the server
(long polls then wake by pub/sub instead of polling the database).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
TABLES = ("nodes_gpusample", "nodes_gpuminuterollup", "nodes_heartbeatbatch", "nodes_sequencegap")


def iso(dt: datetime) -> str:
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def bench_database_url(base: str, name: str) -> str:
    parts = urlsplit(base)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def recreate_database(base_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(base_url.replace("postgres://", "postgresql://", 1), autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [name],
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(db_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE",)}
    env.update(
        DATABASE_URL=db_url,
        DJANGO_SETTINGS_MODULE="portal.settings",
        DEBUG="0",
        SECRET_KEY="bench-only-secret-key-" + "x" * 40,
        SECURE_SSL_REDIRECT="0",
        LOG_LEVEL="WARNING",
        GPUPOOL_VAR_DIR=str(ROOT / "var" / "bench"),
    )
    return env


# --- client side ---------------------------------------------------------------------------------------


def make_batch(seq: int, uuids: list[str], ticks: int, t0: datetime) -> bytes:
    samples = []
    for k in range(ticks):
        ts = iso(t0 + timedelta(seconds=k))
        for i, u in enumerate(uuids):
            samples.append(
                {
                    "gpu_uuid": u,
                    "ts": ts,
                    "util_pct": float((seq * 7 + i * 13 + k) % 100),
                    "mem_used_mib": 40000 + i,
                    "power_w": 500.0 + k,
                    "temp_c": 60 + i,
                    "sm_clock_mhz": 1980,
                    "ecc_sbe": 0,
                    "ecc_dbe": 0,
                    "xid_errors": [],
                    "throttle_reasons": 0,
                    "retired_pages_pending": False,
                    "row_remap_failure": False,
                    "fell_off_bus": False,
                    "processes": [{"pid": 4242, "used_mib": 40000, "workload_id": "123"}],
                }
            )
    body = {
        "seq": seq,
        "sent_at": iso(t0 + timedelta(seconds=ticks)),
        "status": {"uptime_s": 1000 + seq, "load_1m": 3.2, "agent_version": "bench", "draining": False},
        "samples": samples,
        "workloads": [{"workload_id": "123", "state": "running", "exit_code": None}],
    }
    return orjson.dumps(body)


def client_worker(
    base: str, nodes: list[dict], ticks: int, duration: float, threads: int, out: mp.Queue
) -> None:
    """Post heartbeats round-robin over this worker's nodes from a few threads until time is up."""
    stop_at = time.monotonic() + duration
    lock = threading.Lock()
    totals = {"samples": 0, "batches": 0, "errors": 0, "latencies": []}
    # Each node's batches are sent in order by one thread: split nodes among threads.
    groups = [nodes[i::threads] for i in range(threads)]

    def run(group: list[dict]) -> None:
        seqs = {n["node_id"]: 0 for n in group}
        t0 = datetime.now(UTC) - timedelta(hours=1)
        with httpx.Client(base_url=base, timeout=30) as client:
            i = 0
            while time.monotonic() < stop_at:
                node = group[i % len(group)]
                i += 1
                seqs[node["node_id"]] += 1
                seq = seqs[node["node_id"]]
                body = make_batch(seq, node["uuids"], ticks, t0 + timedelta(seconds=seq * ticks))
                started = time.monotonic()
                r = client.post(
                    f"/agent/v1/nodes/{node['node_id']}/heartbeat",
                    content=body,
                    headers={
                        "Authorization": f"Node {node['credential']}",
                        "Content-Type": "application/json",
                    },
                )
                elapsed = time.monotonic() - started
                with lock:
                    if r.status_code == 200 and r.json()["status"] == "accepted":
                        totals["samples"] += len(node["uuids"]) * ticks
                        totals["batches"] += 1
                        totals["latencies"].append(elapsed)
                    else:
                        totals["errors"] += 1

    ts = [threading.Thread(target=run, args=(g,)) for g in groups if g]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out.put(totals)


# --- main ------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=25, help="readings of each GPU per batch")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--threads", type=int, default=4, help="threads per client process")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument("--commands", type=int, default=50)
    parser.add_argument("--sample-interval-s", type=float, default=5.0, help="for the GPU-day figure")
    parser.add_argument("--db-name", default="gpupool_bench")
    args = parser.parse_args()

    base_db = os.environ.get("DATABASE_URL", "")
    if not base_db.startswith(("postgres://", "postgresql://")):
        print("DATABASE_URL must point at PostgreSQL", file=sys.stderr)
        return 2
    db_url = bench_database_url(base_db, args.db_name)
    recreate_database(base_db, args.db_name)
    env = server_env(db_url)
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    print(f"database {args.db_name}: migrated")

    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.db import connection

    from nodes.models import NodeCommand, Region
    from nodes.services.commands import node_command_enqueue
    from nodes.services.registration import bootstrap_token_create
    from portal.actors import Actor

    region = Region.objects.create(code="bench-1", name="Bench", location="here")
    tokens = [bootstrap_token_create(region=region, actor=Actor.system())[1] for _ in range(args.nodes + 1)]
    connection.close()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(args.workers), "--log-level", "warning", "--no-access-log"],
        cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            print("the server did not start", file=sys.stderr)
            return 1
        print(
            f"uvicorn: {args.workers} worker(s) on port {port}, redis: {'yes' if env.get('REDIS_URL') else 'no'}"
        )

        nodes = []
        with httpx.Client(base_url=base, timeout=30) as client:
            for n, token in enumerate(tokens):
                hostname = f"bench-{n:04d}"
                body = {
                    "bootstrap_token": token,
                    "hostname": hostname,
                    "cpu_cores": 96,
                    "ram_mib": 1048576,
                    "interconnect": "nvswitch",
                    "agent_version": "bench",
                    "gpus": [
                        {
                            "index": i,
                            "uuid": f"GPU-{hostname}-{i}",
                            "name": "NVIDIA H100 80GB HBM3",
                            "memory_mib": 81559,
                        }
                        for i in range(args.gpus)
                    ],
                }
                r = client.post("/agent/v1/register", json=body)
                r.raise_for_status()
                data = r.json()
                nodes.append({"node_id": data["node_id"], "credential": data["credential"],
                              "uuids": [g["uuid"] for g in body["gpus"]]})  # fmt: skip
        rtt_node, nodes = nodes[-1], nodes[:-1]
        print(f"registered {len(nodes) + 1} nodes x {args.gpus} GPUs")

        sizes_before = table_sizes(connection)
        out: mp.Queue = mp.Queue()
        procs = [
            mp.Process(target=client_worker, args=(base, nodes[i :: args.clients], args.ticks, args.duration, args.threads, out))
            for i in range(args.clients)
        ]  # fmt: skip
        started = time.monotonic()
        for p in procs:
            p.start()
        results = [out.get() for _ in procs]
        for p in procs:
            p.join()
        elapsed = time.monotonic() - started
        samples = sum(r["samples"] for r in results)
        batches = sum(r["batches"] for r in results)
        errors = sum(r["errors"] for r in results)
        latencies = sorted(x for r in results for x in r["latencies"])
        samples_per_s = samples / elapsed
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM nodes_gpusample")
            stored = cur.fetchone()[0]
        print(
            f"ingest: {samples} samples in {batches} batches ({args.gpus} GPUs x {args.ticks} readings each) "
            f"in {elapsed:.1f} s, {errors} errors: {samples_per_s:,.0f} samples/s, {batches / elapsed:,.0f} batches/s; "
            f"batch latency p50 {pct(latencies, 50) * 1000:.1f} ms p95 {pct(latencies, 95) * 1000:.1f} ms; "
            f"{stored} rows stored"
        )
        if stored != samples:
            print(f"MISMATCH: {stored} rows stored for {samples} accepted samples", file=sys.stderr)

        sizes_after = table_sizes(connection)
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM nodes_gpuminuterollup")
            rollup_rows = cur.fetchone()[0]
        raw_bytes = (sizes_after["nodes_gpusample"] - sizes_before["nodes_gpusample"]) / max(samples, 1)
        rollup_bytes = (sizes_after["nodes_gpuminuterollup"] - sizes_before["nodes_gpuminuterollup"]) / max(
            rollup_rows, 1
        )
        hb_bytes = (sizes_after["nodes_heartbeatbatch"] - sizes_before["nodes_heartbeatbatch"]) / max(
            batches, 1
        )
        per_day = 86400 / args.sample_interval_s
        raw_day = raw_bytes * per_day
        rollup_day = rollup_bytes * 1440
        print(
            f"db growth: {raw_bytes:.0f} B per raw sample (table + indexes), {rollup_bytes:.0f} B per minute rollup, "
            f"{hb_bytes:.0f} B per heartbeat marker; per GPU-day at one sample every {args.sample_interval_s:g} s: "
            f"raw {raw_day / 1e6:.2f} MB + rollups {rollup_day / 1e6:.2f} MB = {(raw_day + rollup_day) / 1e6:.2f} MB"
        )

        rtts = command_round_trips(
            base, rtt_node, args.commands, node_command_enqueue, NodeCommand, connection
        )
        p50, p95 = pct(rtts, 50) * 1000, pct(rtts, 95) * 1000
        print(
            f"command round trip over {len(rtts)} commands: p50 {p50:.1f} ms, p95 {p95:.1f} ms, max {max(rtts) * 1000:.1f} ms"
        )
        print(
            json.dumps(
                {
                    "samples_per_s": round(samples_per_s),
                    "batches_per_s": round(batches / elapsed, 1),
                    "samples_per_batch": args.gpus * args.ticks,
                    "ingest_errors": errors,
                    "heartbeat_p50_ms": round(pct(latencies, 50) * 1000, 1),
                    "heartbeat_p95_ms": round(pct(latencies, 95) * 1000, 1),
                    "command_roundtrip_p50_ms": round(p50, 1),
                    "command_roundtrip_p95_ms": round(p95, 1),
                    "raw_bytes_per_sample": round(raw_bytes),
                    "db_mb_per_gpu_day": round((raw_day + rollup_day) / 1e6, 2),
                    "sample_interval_s": args.sample_interval_s,
                    "redis": bool(env.get("REDIS_URL")),
                }
            )
        )
        return 0 if errors == 0 and stored == samples else 1
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def table_sizes(connection) -> dict[str, int]:
    with connection.cursor() as cur:
        sizes = {}
        for table in TABLES:
            cur.execute("SELECT pg_total_relation_size(%s)", [table])
            sizes[table] = cur.fetchone()[0]
    return sizes


def pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def command_round_trips(base, node, count, enqueue, NodeCommand, connection) -> list[float]:
    """The agent side long-polls in a thread and reports ``accepted`` at once; this side enqueues
    one command at a time and times enqueue -> accepted report answered."""
    from nodes.models import Node

    node_obj = Node.objects.get(pk=node["node_id"])
    acked: dict[str, float] = {}
    done = threading.Event()
    cond = threading.Condition()
    headers = {"Authorization": f"Node {node['credential']}"}

    def agent() -> None:
        with httpx.Client(base_url=base, timeout=40, headers=headers) as client:
            while not done.is_set():
                r = client.get(f"/agent/v1/nodes/{node['node_id']}/commands", params={"wait": 2})
                for command in r.json()["commands"]:
                    rep = client.post(
                        f"/agent/v1/nodes/{node['node_id']}/commands/{command['id']}/report",
                        json={
                            "status": "accepted",
                            "result": {},
                            "message": "",
                            "at": iso(datetime.now(UTC)),
                        },
                    )
                    if rep.status_code == 200 and rep.json()["status"] == "accepted":
                        with cond:
                            acked[command["id"]] = time.monotonic()
                            cond.notify_all()

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    time.sleep(0.5)  # the long poll is waiting
    rtts = []
    for i in range(count):
        started = time.monotonic()
        command = enqueue(node=node_obj, kind="prewarm", payload={"image": f"bench:{i}", "gpu_uuids": []})
        key = str(command.pk)
        with cond:
            if not cond.wait_for(lambda key=key: key in acked, timeout=10):
                print(f"command {i} not acknowledged in 10 s", file=sys.stderr)
                continue
        rtts.append(acked[key] - started)
        time.sleep(0.05)
    done.set()
    thread.join(timeout=5)
    connection.close()
    return rtts


if __name__ == "__main__":
    sys.exit(main())
