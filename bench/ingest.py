"""Heartbeat ingest and command round trip through the real HTTP endpoints and PostgreSQL.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/ingest.py

Creates (drops first) a database of its own (``gpupool_bench`` on the same server), migrates it,
starts uvicorn (httptools, uvloop) on a free port, registers many simulated nodes (8 GPUs each)
through ``/agent/v1/register``, then for a fixed time client processes post heartbeats at the
protocol's real shape: an agent reads its GPUs every second and sends every 10 s, so a batch holds
8 GPUs x 10 readings = 80 samples (``--ticks``). Each client process keeps many keep-alive
connections busy (one node's batches in order on one connection) with a small HTTP/1.1 client, so
that the client costs the shared CPUs as little as possible. It prints samples/s and heartbeats/s,
then the same for one reading per heartbeat (``--ticks-small``), the database growth per GPU-day,
the command round trip (``node_command_enqueue`` in this process -> the agent's long poll receives
it -> its ``accepted`` report is answered), the load average, and ends with one JSON line.
REDIS_URL, when set, is passed to the server (long polls then wake by pub/sub instead of polling).
"""

from __future__ import annotations

import argparse
import asyncio
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

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
# The readings' clock: a day ago, so that a node's batches stay in the past however many it sends.
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(days=1)
TABLES = ("nodes_gpusample", "nodes_gpuminuterollup", "nodes_heartbeatbatch", "nodes_sequencegap")


def iso(dt: datetime) -> str:
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


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
        # A pool per process, as bench/scale.py: 400 nodes registering at once through Django's
        # ASGI handler (a thread and a connection each) exceed the server's max_connections.
        DB_POOL_MAX_SIZE=env.get("DB_POOL_MAX_SIZE", "16"),
    )
    return env


# --- client side ---------------------------------------------------------------------------------------


def _sample_template(uuid: str, i: int) -> bytes:
    """One GPU's reading as the agent sends it, with holes for the time and the numbers that move."""
    return orjson.dumps(
        {
            "gpu_uuid": uuid, "ts": "@TS@", "util_pct": "@U@", "mem_used_mib": 40000 + i, "power_w": "@P@",
            "temp_c": 60 + i, "sm_clock_mhz": 1980, "ecc_sbe": 0, "ecc_dbe": 0, "xid_errors": [],
            "throttle_reasons": 0, "retired_pages_pending": False, "row_remap_failure": False,
            "fell_off_bus": False, "processes": [{"pid": 4242, "used_mib": 40000, "workload_id": "123"}],
        }
    ).replace(b'"@TS@"', b'"%(ts)s"').replace(b'"@U@"', b"%(u)s").replace(b'"@P@"', b"%(p)s")  # fmt: skip


class NodeFeed:
    """A node's batches, numbered 1, 2, ...: ``ticks`` readings of each GPU one second apart."""

    def __init__(self, node: dict, ticks: int, t0: datetime) -> None:
        self.node = node
        self.ticks = ticks
        self.t0 = t0
        self.seq = node.get("seq", 0)  # a later run goes on where the previous one stopped
        self.t = node.get("t", 0)  # seconds after t0 of the next reading
        self.templates = [_sample_template(u, i) for i, u in enumerate(node["uuids"])]
        self.head = (
            f"POST /agent/v1/nodes/{node['node_id']}/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Node {node['credential']}\r\nContent-Type: application/json\r\n"
        ).encode()

    def next_request(self) -> bytes:
        self.seq += 1
        seq, base = self.seq, self.t0 + timedelta(seconds=self.t)
        self.t += self.ticks
        parts = []
        for k in range(self.ticks):
            ts = iso(base + timedelta(seconds=k)).encode()
            for i, template in enumerate(self.templates):
                parts.append(
                    template
                    % {b"ts": ts, b"u": b"%d.0" % ((seq * 7 + i * 13 + k) % 100), b"p": b"%d.5" % (500 + k)}
                )
        body = (
            b'{"seq":%d,"sent_at":"%s","status":{"uptime_s":%d,"load_1m":3.2,"agent_version":"bench","draining":false},'
            b'"samples":[%s],"workloads":[{"workload_id":"123","state":"running","exit_code":null}]}'
            % (seq, iso(base + timedelta(seconds=self.ticks)).encode(), 1000 + seq, b",".join(parts))
        )  # fmt: skip
        return self.head + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def _post_loop(host: str, port: int, feeds: list[NodeFeed], stop_at: float, totals: dict) -> None:
    """One keep-alive connection posting its nodes' batches round-robin (each node's in order)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        i = 0
        while time.monotonic() < stop_at:
            feed = feeds[i % len(feeds)]
            i += 1
            request = feed.next_request()
            started = time.monotonic()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            body = await reader.readexactly(length)
            if head.startswith(b"HTTP/1.1 200") and b'"accepted"' in body:
                totals["samples"] += len(feed.templates) * feed.ticks
                totals["batches"] += 1
                totals["latencies"].append(time.monotonic() - started)
            else:
                totals["errors"] += 1
                if totals["errors"] <= 3:
                    print(f"heartbeat refused: {head[:40]!r} {body[:200]!r}", file=sys.stderr)
                if b"connection: close" in head.lower():
                    return
    finally:
        writer.close()
        await writer.wait_closed()


def client_worker(
    base: str, nodes: list[dict], ticks: int, duration: float, conns: int, out: mp.Queue
) -> None:
    """Post heartbeats over ``conns`` connections until time is up; report the totals."""
    host, port = base.removeprefix("http://").split(":")
    totals = {"samples": 0, "batches": 0, "errors": 0, "latencies": [], "next": {}}
    feeds = [NodeFeed(n, ticks, T0) for n in nodes]
    groups = [feeds[i::conns] for i in range(conns)]

    async def run() -> None:
        stop_at = time.monotonic() + duration
        await asyncio.gather(*(_post_loop(host, int(port), g, stop_at, totals) for g in groups if g))

    asyncio.run(run())
    totals["next"] = {f.node["node_id"]: (f.seq, f.t) for f in feeds}
    out.put(totals)


def run_ingest(base: str, nodes: list[dict], ticks: int, args, connection) -> dict:
    sizes_before = table_sizes(connection)
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM nodes_gpusample")
        rows_before = cur.fetchone()[0]
    out: mp.Queue = mp.Queue()
    procs = [
        mp.Process(target=client_worker, args=(base, nodes[i :: args.clients], ticks, args.duration, args.connections, out))
        for i in range(args.clients)
    ]  # fmt: skip
    load_before = os.getloadavg()
    started = time.monotonic()
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    elapsed = time.monotonic() - started
    load = os.getloadavg()
    samples = sum(r["samples"] for r in results)
    batches = sum(r["batches"] for r in results)
    errors = sum(r["errors"] for r in results)
    latencies = sorted(x for r in results for x in r["latencies"])
    for node in nodes:
        for r in results:
            if node["node_id"] in r["next"]:
                node["seq"], node["t"] = r["next"][node["node_id"]]
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM nodes_gpusample")
        stored = cur.fetchone()[0] - rows_before
    sizes_after = table_sizes(connection)
    figures = {
        "ticks": ticks,
        "samples_per_batch": args.gpus * ticks,
        "samples": samples,
        "batches": batches,
        "errors": errors,
        "elapsed": elapsed,
        "samples_per_s": samples / elapsed,
        "heartbeats_per_s": batches / elapsed,
        "p50_ms": pct(latencies, 50) * 1000,
        "p95_ms": pct(latencies, 95) * 1000,
        "stored": stored,
        "load_before": load_before,
        "load_after": load,
        "sizes_before": sizes_before,
        "sizes_after": sizes_after,
    }
    print(
        f"ingest, {args.gpus} GPUs x {ticks} reading(s) = {args.gpus * ticks} samples per heartbeat, "
        f"{len(nodes)} nodes, {args.clients} x {args.connections} connections: {samples} samples in {batches} "
        f"heartbeats in {elapsed:.1f} s, {errors} errors: {samples / elapsed:,.0f} samples/s, "
        f"{batches / elapsed:,.0f} heartbeats/s; latency p50 {figures['p50_ms']:.1f} ms "
        f"p95 {figures['p95_ms']:.1f} ms; {stored} rows stored; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"(before: {load_before[0]:.2f})"
    )
    if stored != samples:
        print(f"MISMATCH: {stored} rows stored for {samples} accepted samples", file=sys.stderr)
    return figures


# --- main ------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=400, help="simulated nodes posting heartbeats")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=10, help="readings of each GPU per batch (1 s apart)")
    parser.add_argument("--ticks-small", type=int, default=1, help="the second run: readings per batch")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--duration-small", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=1, help="client processes")
    parser.add_argument("--connections", type=int, default=32, help="keep-alive connections per client")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument("--commands", type=int, default=50)
    parser.add_argument("--sample-interval-s", type=float, default=1.0, help="for the GPU-day figure")
    parser.add_argument("--db-name", default="gpupool_bench")
    args = parser.parse_args()

    base_db = os.environ.get("DATABASE_URL", "")
    if not base_db.startswith(("postgres://", "postgresql://")):
        print("DATABASE_URL must point at PostgreSQL", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from bench.pgdb import recreate_database

    db_url = recreate_database(base_db, args.db_name)
    env = server_env(db_url)
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    print(f"database {args.db_name}: migrated")

    os.environ.update(env)
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
         "--workers", str(args.workers), "--http", "httptools", "--loop", "uvloop", "--log-level", "warning",
         "--no-access-log", "--lifespan", "off"],
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

        main = run_ingest(base, nodes, args.ticks, args, connection)
        samples, batches = main["samples"], main["batches"]
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM nodes_gpuminuterollup")
            rollup_rows = cur.fetchone()[0]
        before, after = main["sizes_before"], main["sizes_after"]
        raw_bytes = (after["nodes_gpusample"] - before["nodes_gpusample"]) / max(samples, 1)
        rollup_bytes = (after["nodes_gpuminuterollup"] - before["nodes_gpuminuterollup"]) / max(
            rollup_rows, 1
        )
        hb_bytes = (after["nodes_heartbeatbatch"] - before["nodes_heartbeatbatch"]) / max(batches, 1)
        per_day = 86400 / args.sample_interval_s
        raw_day = raw_bytes * per_day
        rollup_day = rollup_bytes * 1440
        hb_day = hb_bytes * per_day / args.ticks / args.gpus  # a GPU's share of its node's batches
        print(
            f"db growth: {raw_bytes:.0f} B per raw sample (table + indexes), {rollup_bytes:.0f} B per minute rollup, "
            f"{hb_bytes:.0f} B per heartbeat marker; per GPU-day at one reading every {args.sample_interval_s:g} s, "
            f"{args.ticks} readings per batch: raw {raw_day / 1e6:.2f} MB + rollups {rollup_day / 1e6:.2f} MB "
            f"+ markers {hb_day / 1e6:.2f} MB = {(raw_day + rollup_day + hb_day) / 1e6:.2f} MB"
        )
        small = run_ingest(
            base,
            nodes,
            args.ticks_small,
            argparse.Namespace(**{**vars(args), "duration": args.duration_small}),
            connection,
        )
        errors = main["errors"] + small["errors"]
        stored_ok = main["stored"] == main["samples"] and small["stored"] == small["samples"]

        rtts = command_round_trips(
            base, rtt_node, args.commands, node_command_enqueue, NodeCommand, connection
        )
        p50, p95 = pct(rtts, 50) * 1000, pct(rtts, 95) * 1000
        print(
            f"command round trip over {len(rtts)} commands: p50 {p50:.1f} ms, p95 {p95:.1f} ms, max {max(rtts) * 1000:.1f} ms"
        )
        load = os.getloadavg()
        print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
        print(
            json.dumps(
                {
                    "samples_per_s": round(main["samples_per_s"]),
                    "heartbeats_per_s": round(main["heartbeats_per_s"], 1),
                    "samples_per_batch": main["samples_per_batch"],
                    "heartbeat_p50_ms": round(main["p50_ms"], 1),
                    "heartbeat_p95_ms": round(main["p95_ms"], 1),
                    "nodes": len(nodes),
                    "small_samples_per_batch": small["samples_per_batch"],
                    "small_samples_per_s": round(small["samples_per_s"]),
                    "small_heartbeats_per_s": round(small["heartbeats_per_s"], 1),
                    "ingest_errors": errors,
                    "command_roundtrip_p50_ms": round(p50, 1),
                    "command_roundtrip_p95_ms": round(p95, 1),
                    "raw_bytes_per_sample": round(raw_bytes),
                    "db_mb_per_gpu_day": round((raw_day + rollup_day + hb_day) / 1e6, 2),
                    "sample_interval_s": args.sample_interval_s,
                    "load_avg_1m": round(main["load_after"][0], 2),
                    "cpus": os.cpu_count(),
                    "redis": bool(env.get("REDIS_URL")),
                }
            )
        )
        return 0 if errors == 0 and stored_ok else 1
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
