"""Scale-out: the whole stack on one machine under a realistic mix of tenant and agent traffic.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/scale.py [--duration 60]

Creates (drops first) a database of its own (``gpupool_scale`` on DATABASE_URL's server) and uses
Redis database 9 (``--redis-url``; flushed first). Starts the deployment's process layout on one
machine: two uvicorn web processes for pages and the API, the agent ingress (the same ASGI app in a
uvicorn process of its own, which the agents are sent to, as deploy/'s ``agent-web`` service), two
Celery workers (queues split: scheduling + commands, default + metering), beat, and a simulated
fleet of 500 nodes (real ``gpupool-agent`` code, simulated GPUs and runtime, 100 agents per process,
the processes started one after another) that registers, heartbeats every 10 s and long-polls for
commands. The background (agent ingress, workers, beat and the fleet) runs at ``--background-nice``,
each part's session set to it (``session_nice``): on a shared machine the tenants' requests get the
CPU first, as deploy/compose.yaml's CPU shares and Kubernetes' separate pods give them. Then, for
``--duration`` seconds, a load generator (asyncio + aiohttp, open loop at a fixed arrival rate)
plays tenants: listing instances, jobs, GPU types and usage, reading a job, creating jobs (which run
for 30 s on the simulated fleet) and instances.

Prints request rate and p50/p95/p99 latency per endpoint (tenant API, and the agents' heartbeats
and command polls as the agents saw them), errors, submit -> SCHEDULED latency (from the workload
events), whether every submitted workload is scheduled or waiting with a reason, a few figures
from /metrics, the CPU each part of the stack used during the load (in cores: web, agent-web,
agents, workers, PostgreSQL, Redis, the load generator), the machine's speed before, during (a
probe process) and after the run and the CPU the hypervisor took during the load (``steal_cores``),
and ends with one JSON line (``rps``, ``read_p99_ms``, ``errors``, ``submit_to_scheduled_p95_ms``
and more). ``rps`` counts the requests answered; ``offered_rps`` the requests due, with those not
sent (every connection busy) or not answered in time, which are errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stack import (
    METRICS_TOKEN,
    PY,
    ROOT,
    Stack,
    free_port,
    role_of,
    seed,
    stack_env,
    up,
    wait_for,
)

# The tenant mix: (name, weight). Reads are the GETs.
MIX = (
    ("GET /api/v1/instances/", 22),
    ("GET /api/v1/jobs/", 22),
    ("GET /api/v1/gpu-types/", 20),
    ("GET /api/v1/usage/", 10),
    ("GET /api/v1/jobs/{id}/", 16),
    ("POST /api/v1/jobs/", 7),
    ("POST /api/v1/instances/", 3),
)
JOB_RUN_S = 30


def _tenth_ms() -> float:
    """The yardstick, a fixed piece of pure Python, in CPU ms (a wait for the CPU does not count):
    200,000 steps, scaled to the 2,000,000 that earlier runs of this bench reported."""
    started = time.process_time()
    total = 0
    for i in range(200_000):
        total += i
    return (time.process_time() - started) * 10_000


def machine_speed_ms(samples: int = 20) -> tuple[float, float]:
    """How fast this machine runs Python now: a tenth of the yardstick, ``samples`` times a quarter
    of a second apart, as (best, median) in ms (lower is faster). This virtual machine's speed
    swings from one second to the next with nothing of the stack running (53-105 ms in 100 samples
    on the idle machine; a busy loop never lost the CPU for more than 0.7 ms, so its core runs
    slower rather than being taken away): the best is what it can do, the median what it does in
    that phase. Runs compare fairly only at a similar median."""
    runs = []
    for i in range(samples):
        if i:
            time.sleep(0.25)
        runs.append(_tenth_ms())
    return round(min(runs), 1), round(pct(runs, 50), 1)


def _lookups_ms(table: dict[int, str], keys: list[int]) -> float:
    """CPU ms to look up ``keys`` in ``table`` and read each value: work that waits on memory, as
    Django's does and ``_tenth_ms``'s loop (which fits in a core's caches) does not."""
    started = time.process_time()
    total = 0
    for key in keys:
        total += len(table[key])
    return (time.process_time() - started) * 1000


def speed_probe(duration: float) -> int:
    """In a process of its own during the load, once a second: ``_tenth_ms`` and 20,000 random
    lookups in a million-entry dict (about 120 MB of objects, past the 32 MB shared cache), printed.
    Their CPU time is what the CPU took to run them, whatever the wait for the CPU: they show
    whether the machine itself ran slower while the stack was loaded. The dict is made first; the
    probe starts when a line comes on stdin (the load's start), or ends if none comes."""
    table = {i: str(i) for i in range(1_000_000)}
    keys = random.Random(1).sample(range(1_000_000), 20_000)
    if not sys.stdin.readline():  # the bench ended before its load started
        return 0
    end = time.monotonic() + duration
    while time.monotonic() < end:
        print(f"{_tenth_ms():.1f} {_lookups_ms(table, keys):.1f}", flush=True)
        time.sleep(1)
    return 0


def steal_s() -> float:
    """CPU seconds the hypervisor has given to others while this machine wanted them (/proc/stat's
    steal, all CPUs), so far. Some hypervisors report none of it (this one); the probe tells more."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


# --- the simulated fleet (child process) --------------------------------------------------------------


def agents_child(fleet_file: str, portal_url: str, state_root: str, out: str) -> int:
    """Run the fleet file's agents; time every request they make; write the timings on SIGTERM."""
    from nodes.agent import client as agent_client
    from nodes.agent.cli import run_event_loop
    from nodes.agent.fleet import Fleet

    timings: list[tuple[float, str, float, int]] = []  # (wall time, kind, seconds, status)
    original = agent_client.PortalClient.request

    async def timed(self, method, path, **kwargs):
        started = time.perf_counter()
        status = 0
        try:
            response = await original(self, method, path, **kwargs)
            status = response.status_code
            return response
        finally:
            kind = path.rsplit("/", 1)[-1] if "/nodes/" in path else path.rstrip("/").rsplit("/", 1)[-1]
            timings.append(
                (time.time(), f"{method} /agent/v1/…/{kind}", time.perf_counter() - started, status)
            )

    agent_client.PortalClient.request = timed
    fleet = Fleet(fleet_file, portal_url=portal_url, state_root=state_root)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, fleet.request_stop)
        await fleet.run()

    import logging

    logging.basicConfig(level=logging.WARNING)
    run_event_loop(run())
    Path(out).write_text(json.dumps(timings))
    return 0


# --- the load generator -----------------------------------------------------------------------------


MAX_IN_FLIGHT = 256  # the client's connections; a request due while all are busy is not sent
REQUEST_TIMEOUT_S = 30


async def tenant_load(base: str, tokens: list[str], rate: float, duration: float, models: dict[str, int]):
    """Open loop: requests start at fixed intervals (1/rate) whatever the answers take. A request
    due while MAX_IN_FLIGHT are outstanding is counted as an error (status -1) and not sent; one
    that takes longer than REQUEST_TIMEOUT_S in all is an error (status 0)."""
    names = [n for n, _ in MIX]
    weights = [w for _, w in MIX]
    rng = random.Random(7)
    # (endpoint, seconds, status, start lag, sent at)
    results: list[tuple[str, float, int, float, float]] = []
    created: list[tuple[str, int]] = []  # (kind, workload id)
    jobs_of: dict[int, list[int]] = defaultdict(list)
    errors: dict[tuple[str, int], str] = {}  # the first answer of each failing (endpoint, status)
    # aiohttp, not httpx: the load generator shares the machine with what it measures, and httpx
    # cost about 4 ms of CPU a request here (httpcore checks every pooled connection for each request
    # it sends), against about 1 ms for aiohttp's client. Idle connections are kept 30 s (the web
    # tier keeps them 75 s).
    connector = aiohttp.TCPConnector(limit=MAX_IN_FLIGHT, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    in_flight = 0

    async with aiohttp.ClientSession(base, connector=connector, timeout=timeout) as client:

        async def one(endpoint: str, t: int, due: float) -> None:
            nonlocal in_flight
            headers = {"Authorization": f"Bearer {tokens[t]}"}
            method, path = endpoint.split(" ")
            body = None
            if path == "/api/v1/jobs/{id}/":
                if not jobs_of[t]:
                    path = "/api/v1/jobs/"
                    endpoint = "GET /api/v1/jobs/"
                else:
                    path = f"/api/v1/jobs/{rng.choice(jobs_of[t])}/"
            elif method == "POST":
                model = rng.choice(list(models))
                spec = {
                    "gpu_models": [model],
                    "gpu_count": rng.choice([n for n in (1, 1, 1, 2, 4) if n <= models[model]]),
                    "image": "ghcr.io/bench/train:1",
                }
                if "jobs" in path:
                    spec |= {
                        "command": ["python", "train.py"],
                        "env": {"GPUPOOL_SIM_DURATION_S": str(JOB_RUN_S)},
                    }
                body = spec
            lag = time.monotonic() - due
            started, sent_at = time.perf_counter(), time.time()
            if in_flight >= MAX_IN_FLIGHT:
                errors.setdefault((endpoint, -1), f"not sent: {in_flight} requests in flight")
                results.append((endpoint, 0.0, -1, lag, sent_at))
                return
            in_flight += 1
            try:
                async with client.request(method, path, headers=headers, json=body) as response:
                    status = response.status
                    content = await response.read()
                if method == "POST" and status == 201:
                    wid = json.loads(content)["id"]
                    created.append(("job" if "jobs" in path else "instance", wid))
                    if "jobs" in path:
                        jobs_of[t].append(wid)
                elif status >= 400 and (endpoint, status) not in errors:
                    errors[(endpoint, status)] = content[:200].decode(errors="replace")
            except (aiohttp.ClientError, TimeoutError) as exc:
                status = 0
                errors.setdefault((endpoint, 0), f"{type(exc).__name__} {exc}")
            finally:
                in_flight -= 1
            results.append((endpoint, time.perf_counter() - started, status, lag, sent_at))

        tasks = []
        start = time.monotonic()
        n = int(rate * duration)
        for i in range(n):
            due = start + i / rate
            await asyncio.sleep(max(due - time.monotonic(), 0))  # yields even when behind
            endpoint = rng.choices(names, weights)[0]
            tasks.append(asyncio.create_task(one(endpoint, rng.randrange(len(tokens)), due)))
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - start
    return results, created, errors, elapsed


# --- the stack ----------------------------------------------------------------------------------------


def _stat(pid: int | str, tick: int) -> tuple[int, float] | None:
    """A process's parent and the CPU seconds (user + system) it has used, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / tick


def postgres_backends_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by each PostgreSQL backend serving this database, with the part of
    the stack it serves (its application_name, ``gpupool-<role>``, less the prefix): who PostgreSQL's
    CPU is spent for. Only when the server runs on this machine (its pids are in /proc)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database()"
        )
        rows = cursor.fetchall()
    connection.close()
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid, name in rows:
        stat = _stat(pid, tick)
        if stat is not None:
            out[pid] = (name.removeprefix("gpupool-") or "unnamed", stat[1])
    return out


def cpu_by_role(procs: dict[str, subprocess.Popen]) -> dict[str, float]:
    """CPU seconds used so far by each part of the stack (Linux /proc): the processes started here
    with their children (by the name they were started under, ``agents-3`` counting as ``agents``),
    this process (the load generator), PostgreSQL's and Redis's processes by command line."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, used, command = {}, {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(entry, tick)
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat is None:
            continue
        pid = int(entry)
        (parent[pid], used[pid]), command[pid] = stat, cmd
    roots = {p.pid: role_of(name) for name, p in procs.items()}
    roots[os.getpid()] = "load generator"
    out: dict[str, float] = defaultdict(float)
    for pid, seconds in used.items():
        up, role = pid, None
        while up > 1 and role is None:
            role, up = roots.get(up), parent.get(up, 0)
        if role is None:
            cmd = command[pid]
            role = "postgres" if "postgres" in cmd else "redis" if "redis-server" in cmd else None
        if role is not None:
            out[role] += seconds
    return out


def scrape_metrics(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = defaultdict(float)
    started = time.perf_counter()
    try:
        response = httpx.get(
            f"{base}/metrics", timeout=60, headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
        )
        response.raise_for_status()
        text = response.text
    except httpx.HTTPError as exc:
        print(f"/metrics did not answer: {type(exc).__name__}", file=sys.stderr)
        return out
    out["scrape_s"] = time.perf_counter() - started
    out["series"] = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gpupool_scheduling_cycles_total":
                out[f"cycles_{s.labels['result']}"] += s.value
            elif s.name in (
                "gpupool_scheduling_cycle_duration_seconds_sum",
                "gpupool_scheduling_cycle_duration_seconds_count",
            ):
                out[s.name.rsplit("_", 1)[-1] + "_cycle"] += s.value
            elif s.name == "gpupool_celery_task_latency_seconds_sum":
                out["task_latency_sum"] += s.value
            elif s.name == "gpupool_celery_task_latency_seconds_count":
                out["task_latency_count"] += s.value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument(
        "--rate",
        type=float,
        default=107.0,
        help="tenant API requests per second; with the agents' heartbeats, polls and command reports "
        "(about 93 requests/s at this rate) the default makes 200 requests/s in total, the target's",
    )
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--agent-processes", type=int, default=5, help="started one after another")
    parser.add_argument(
        "--agent-web-workers",
        type=int,
        default=1,
        help="uvicorn processes of the agent ingress; 0: the agents use the tenants' web processes",
    )
    parser.add_argument(
        "--background-nice",
        type=int,
        default=10,
        help="nice value of the agent ingress, the workers, beat and the simulated fleet, each process's and "
        "its session's (0: as the web)",
    )
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--settle", type=float, default=20.0, help="seconds allowed for the last placements")
    parser.add_argument("--db-name", default="gpupool_scale")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    parser.add_argument("--db-pool", type=int, default=16, help="DB_POOL_MAX_SIZE of each process")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    parser.add_argument(
        "--timeline",
        type=float,
        default=0,
        metavar="S",
        help="print latency and CPU by role per S seconds of the load",
    )
    parser.add_argument(
        "--agents-child", nargs=4, metavar=("FLEET", "URL", "STATE", "OUT"), help=argparse.SUPPRESS
    )
    parser.add_argument("--speed-probe", type=float, metavar="S", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agents_child:
        return agents_child(*args.agents_child)
    if args.speed_probe:
        return speed_probe(args.speed_probe)

    base_db = os.environ.get("DATABASE_URL", "")
    if not base_db.startswith(("postgres://", "postgresql://")):
        print("DATABASE_URL must point at PostgreSQL", file=sys.stderr)
        return 2
    best_ms, speed_ms = machine_speed_ms()  # before anything of the stack runs
    print(
        f"machine speed: median {speed_ms} ms, best {best_ms} ms for a fixed piece of Python (lower is faster)"
    )
    sys.path.insert(0, str(ROOT))
    import redis

    from bench.pgdb import drop_database, recreate_database
    from nodes.agent.cli import run_event_loop

    redis.Redis.from_url(args.redis_url).flushdb()
    db_url = recreate_database(base_db, args.db_name)
    work = Path(tempfile.mkdtemp(prefix="gpupool-scale-"))
    env = stack_env(db_url, args.redis_url, work / "var", args.db_pool)
    (work / "var").mkdir()
    subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    os.environ.update(env)
    import django

    django.setup()
    from django.db import connection

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent_port = free_port() if args.agent_web_workers else port
    agent_base = f"http://127.0.0.1:{agent_port}"
    tokens, fleet_nodes, models = seed(tenants=args.tenants, nodes=args.nodes)
    connection.close()
    print(
        f"database {args.db_name}: migrated; {args.tenants} tenants, {len(fleet_nodes)} nodes to register; logs in {work}"
    )

    stack = Stack(env, work)
    procs = stack.procs
    start = stack.start

    # Separate processes for the agents' heartbeats, long polls and reports, below the web's
    # priority with the rest of the background. At --rate 70 on a 2-core machine, interleaved:
    # read p99 167-897 ms (median 613, five runs) against 794-2196 ms (median 1886, four runs)
    # with everything in the web processes; heartbeats wait longer (p95 up to 6 s against 0.5 s),
    # well inside the 30 s after which a silent node is suspect. That gain was the separate
    # process's alone: until session_nice, the background's nice held only inside its own session,
    # each part had an autogroup of its own, and the web's two processes together got the same
    # share of a contended CPU as any one of the nine background ones. Interleaved at the default
    # --rate, read p99 105 and 159 ms at --background-nice 0 (as it was), 33 and 27 ms at 10.
    background = args.background_nice  # start()'s nice for every part but the web

    agent_outs = []
    try:
        stack.start_layout(
            port=port,
            agent_port=agent_port,
            agent_web_workers=args.agent_web_workers,
            web_workers=2,
            background=background,
            beat_schedule=work / "beat-schedule",
        )
        if not wait_for(lambda: up(base) and up(agent_base), 60):
            print("the web processes did not start", file=sys.stderr)
            return 1
        from nodes.models import Node, NodeState

        def ready() -> int:
            n = Node.objects.filter(state=NodeState.READY).count()
            connection.close()
            return n

        # The fleet comes up a process (a rack) at a time, as a real one does, not in one burst.
        per = -(-len(fleet_nodes) // args.agent_processes)
        t0 = time.monotonic()
        ok = True
        for i in range(args.agent_processes):
            part = work / f"fleet-{i}.json"
            nodes_i = fleet_nodes[i * per : (i + 1) * per]
            part.write_text(json.dumps({"portal_url": agent_base, "nodes": nodes_i}))
            out = work / f"agents-{i}.json"
            agent_outs.append(out)
            start(f"agents-{i}", [PY, str(Path(__file__).resolve()), "--agents-child", str(part), agent_base,
                                  str(work / "agents"), str(out)], background)  # fmt: skip
            target = min((i + 1) * per, len(fleet_nodes))
            ok = ok and wait_for(lambda target=target: ready() >= target, 180, 1)
        print(f"fleet: {ready()} of {len(fleet_nodes)} nodes READY after {time.monotonic() - t0:.1f} s")
        if not ok:
            return 1
        # The tables were filled seconds ago: give the planner the statistics that autovacuum's
        # analyze keeps on a database that has been running for a while.
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
        connection.close()
        # Started now: it makes its lookup table while the stack settles, not during the load.
        probe = subprocess.Popen(
            [PY, str(Path(__file__).resolve()), "--speed-probe", str(args.duration)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(5)  # past the registration burst: heartbeats and polls at their steady pace

        metrics_before = scrape_metrics(base)
        window = (time.time(), None)
        load_avg = os.getloadavg()
        cpu_before = cpu_by_role(procs)
        pg_before = postgres_backends_cpu()
        steal_before = steal_s()
        # With --timeline: CPU by role at each step, read from /proc by a thread of its own.
        cpu_steps: list[dict[str, float]] = [cpu_before]
        load_done = threading.Event()

        def sample_cpu() -> None:
            while not load_done.wait(window[0] + len(cpu_steps) * args.timeline - time.time()):
                cpu_steps.append(cpu_by_role(procs))

        sampler = threading.Thread(target=sample_cpu, daemon=True)
        if args.timeline:
            sampler.start()
        probe.stdin.write("start\n")
        probe.stdin.flush()
        # On uvloop, as the web processes and the agents run.
        results, created, sample_errors, elapsed = run_event_loop(
            tenant_load(base, tokens, args.rate, args.duration, models)
        )
        load_done.set()
        probed = [line.split() for line in probe.communicate(timeout=30)[0].splitlines()]
        probe_ms = [float(small) for small, _ in probed]
        probe_memory_ms = [float(memory) for _, memory in probed]
        window = (window[0], time.time())
        load_after = os.getloadavg()
        cpu_after = cpu_by_role(procs)
        pg_after = postgres_backends_cpu()
        steal = steal_s() - steal_before
        print(f"load: {len(results)} tenant requests in {elapsed:.1f} s; load average {load_after[0]:.2f} "
              f"(before {load_avg[0]:.2f}) on {os.cpu_count()} CPUs")  # fmt: skip

        from scheduling.models import Workload, WorkloadEvent, WorkloadState

        ids = [wid for _, wid in created]
        waiting = (WorkloadState.PENDING, WorkloadState.QUEUED)
        # "submitted" is the reason a workload has until a scheduling cycle first looks at it: no
        # answer yet, so it counts as waiting without a reason.
        unassessed = ("", "submitted")

        def settled() -> bool:
            n = Workload.objects.filter(pk__in=ids, state__in=waiting, pending_reason__in=unassessed).count()
            connection.close()
            return n == 0

        wait_for(settled, args.settle, 1)
        metrics_after = scrape_metrics(base)
    finally:
        stack.stop_all()

    # --- figures ----------------------------------------------------------------------------------------
    # Again with the stack gone: a machine whose speed changed during the run shows it here.
    _, speed_after_ms = machine_speed_ms()
    report: dict[str, dict] = {}
    by_endpoint: dict[str, list] = defaultdict(list)
    for endpoint, seconds, status, *_ in results:
        by_endpoint[endpoint].append((seconds, status))
    agent_rows: dict[str, list] = defaultdict(list)
    heartbeat_times: list[tuple[float, float]] = []  # (sent at, seconds)
    for out in agent_outs:
        try:
            for at, kind, seconds, status in json.loads(out.read_text()):
                if window[0] <= at <= window[1]:
                    agent_rows[kind].append((seconds, status))
                    if kind.endswith("heartbeat"):
                        heartbeat_times.append((at - seconds, seconds))
        except (OSError, ValueError):
            print(f"no agent timings in {out}", file=sys.stderr)
    span = window[1] - window[0]
    print(f"\n{'endpoint':42} {'answered/s':>10} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'errors':>6}")
    for endpoint, rows in sorted({**by_endpoint, **agent_rows}.items()):
        lat = [s * 1000 for s, st in rows if st > 0]
        # A long poll that ends without a command answers 204 after its wait: not an error.
        errs = sum(1 for _, st in rows if st <= 0 or st >= 400)
        report[endpoint] = {
            "rps": round(len(lat) / span, 1),  # answered; a request not sent or not answered is an error
            "offered_rps": round(len(rows) / span, 1),
            "p50_ms": round(pct(lat, 50), 1),
            "p95_ms": round(pct(lat, 95), 1),
            "p99_ms": round(pct(lat, 99), 1),
            "errors": errs,
        }
        r = report[endpoint]
        print(
            f"{endpoint:42} {r['rps']:10.1f} {r['p50_ms']:8.1f} {r['p95_ms']:8.1f} {r['p99_ms']:8.1f} {errs:6d}"
        )
    reads = [s * 1000 for e, s, st, *_ in results if e.startswith("GET") and st > 0]
    tenant_errors = sum(1 for _, _, st, *_ in results if st <= 0 or st >= 400)
    agent_errors = sum(1 for rows in agent_rows.values() for _, st in rows if st <= 0 or st >= 400)
    lags = sorted(lag for _, _, _, lag, _ in results)
    offered = len(results) + sum(len(rows) for rows in agent_rows.values())
    tenant_answered = sum(1 for _, _, st, *_ in results if st > 0)
    answered = tenant_answered + sum(1 for rows in agent_rows.values() for _, st in rows if st > 0)
    for (endpoint, status), text in sorted(sample_errors.items()):
        n = sum(1 for e, _, st, *_ in results if (e, st) == (endpoint, status))
        print(f"error: {endpoint} answered {status or 'no answer'} {n} time(s), e.g. {text}")

    if args.timeline:
        print(
            f"\ntimeline ({args.timeline:g} s steps from the start of the load): tenant reads and heartbeats sent"
        )
        roles = ("web", "agent-web", "postgres", "agents", "worker-scheduling")
        print(f"{'t s':>5} {'reads':>6} {'p50 ms':>8} {'p95 ms':>8} {'heartbeats':>10} {'p95 ms':>8}   "
              f"cores: {' '.join(roles)}, all")  # fmt: skip
        steps = defaultdict(lambda: ([], []))
        for e, seconds, st, _, at in results:
            if e.startswith("GET") and st > 0:
                steps[int((at - window[0]) // args.timeline)][0].append(seconds * 1000)
        for at, seconds in heartbeat_times:
            steps[int((at - window[0]) // args.timeline)][1].append(seconds * 1000)
        for step in sorted(k for k in steps if k >= 0):
            r, h = steps[step]
            cores = ""
            if step + 1 < len(cpu_steps):
                used = {
                    k: (cpu_steps[step + 1][k] - cpu_steps[step].get(k, 0)) / args.timeline
                    for k in cpu_steps[step + 1]
                }
                cores = (
                    "   " + " ".join(f"{used.get(k, 0):.2f}" for k in roles) + f", {sum(used.values()):.2f}"
                )
            print(
                f"{step * args.timeline:5.0f} {len(r):6d} {pct(r, 50):8.1f} {pct(r, 95):8.1f} {len(h):10d} {pct(h, 95):8.1f}{cores}"
            )

    first_scheduled: dict[int, float] = {}
    for wid, at in WorkloadEvent.objects.filter(
        workload_id__in=ids, to_state=WorkloadState.SCHEDULED
    ).values_list("workload_id", "at"):
        t = at.timestamp()
        first_scheduled[wid] = min(first_scheduled.get(wid, t), t)
    submitted = dict(Workload.objects.filter(pk__in=ids).values_list("pk", "submitted_at"))
    waits = sorted((first_scheduled[w] - submitted[w].timestamp()) * 1000 for w in first_scheduled)
    states = defaultdict(int)
    no_reason = 0
    for state, reason in Workload.objects.filter(pk__in=ids).values_list("state", "pending_reason"):
        states[state] += 1
        if state in waiting and reason in unassessed:
            no_reason += 1
    reasons = defaultdict(int)
    for reason in Workload.objects.filter(pk__in=ids, state__in=waiting).values_list(
        "pending_reason", flat=True
    ):
        reasons[reason or "(none)"] += 1
    connection.close()
    if not args.keep:
        drop_database(base_db, args.db_name)

    print(
        f"\nsubmitted {len(ids)} workloads; scheduled {len(waits)}: submit -> SCHEDULED p50 {pct(waits, 50):.0f} ms, "
        f"p95 {pct(waits, 95):.0f} ms, max {waits[-1] if waits else 0:.0f} ms"
    )
    print(
        f"states now: {dict(sorted(states.items()))}; waiting by reason: {dict(reasons)}; waiting without a reason: {no_reason}"
    )
    cycles = {
        k: metrics_after.get(k, 0) - metrics_before.get(k, 0)
        for k in ("cycles_ok", "cycles_failed", "cycles_skipped")
    }
    n_cycles = metrics_after.get("count_cycle", 0) - metrics_before.get("count_cycle", 0)
    mean_cycle = (
        (metrics_after.get("sum_cycle", 0) - metrics_before.get("sum_cycle", 0)) / n_cycles if n_cycles else 0
    )
    n_tasks = metrics_after.get("task_latency_count", 0) - metrics_before.get("task_latency_count", 0)
    mean_task = (
        (metrics_after.get("task_latency_sum", 0) - metrics_before.get("task_latency_sum", 0)) / n_tasks
        if n_tasks
        else 0
    )
    print(
        f"/metrics: {metrics_after.get('series', 0):.0f} series, scrape {metrics_after.get('scrape_s', 0) * 1000:.0f} ms "
        f"(before the load: {metrics_before.get('scrape_s', 0) * 1000:.0f} ms)"
    )
    print(f"/metrics over the run: cycles {cycles}, mean cycle {mean_cycle * 1000:.0f} ms; "
          f"{n_tasks:.0f} tasks, mean publish->start {mean_task * 1000:.0f} ms")  # fmt: skip
    print(
        f"client: start lag p99 {pct(lags, 99) * 1000:.1f} ms (a busy load generator delays its own requests)"
    )
    cpu = {role: (cpu_after[role] - cpu_before.get(role, 0)) / span for role in cpu_after}
    cpu = {role: share for role, share in sorted(cpu.items(), key=lambda kv: -kv[1]) if share >= 0.005}
    print(
        f"CPU during the load, in cores ({os.cpu_count()} on this machine): "
        + ", ".join(f"{role} {share:.2f}" for role, share in cpu.items())
        + f"; total {sum(cpu.values()):.2f}"
    )
    # A backend that started during the load counts whole; one that ended during it is missed.
    pg_by_client: dict[str, float] = defaultdict(float)
    for pid, (client, seconds) in pg_after.items():
        pg_by_client[client] += (seconds - pg_before.get(pid, (client, 0.0))[1]) / span
    pg_by_client = {
        c: share for c, share in sorted(pg_by_client.items(), key=lambda kv: -kv[1]) if share >= 0.005
    }
    if pg_by_client:
        print(
            "PostgreSQL's backends during the load, in cores, by the part of the stack they served: "
            + ", ".join(f"{client} {share:.2f}" for client, share in pg_by_client.items())
        )
    print(
        f"machine speed (medians): {speed_ms} ms before the run (best {best_ms} ms), {speed_after_ms} ms "
        f"after it, during the load (once a second) {pct(probe_ms, 50):.1f} ms, "
        f"p90 {pct(probe_ms, 90):.1f} ms; memory-bound lookups during the load median "
        f"{pct(probe_memory_ms, 50):.1f} ms, p90 {pct(probe_memory_ms, 90):.1f} ms; "
        f"stolen by the hypervisor during the load: {steal / span:.2f} cores"
    )
    figures = {
        # Requests answered per second; "offered" counts the load generator's requests not sent
        # (all connections busy) or not answered in time too.
        "rps": round(answered / span, 1),
        "offered_rps": round(offered / span, 1),
        "tenant_rps": round(tenant_answered / span, 1),
        "tenant_offered_rps": round(len(results) / span, 1),
        "read_p50_ms": round(pct(reads, 50), 1),
        "read_p95_ms": round(pct(reads, 95), 1),
        "read_p99_ms": round(pct(reads, 99), 1),
        "errors": tenant_errors + agent_errors,
        "submitted": len(ids),
        "scheduled": len(waits),
        "submit_to_scheduled_p50_ms": round(pct(waits, 50), 1),
        "submit_to_scheduled_p95_ms": round(pct(waits, 95), 1),
        "waiting_without_reason": no_reason,
        "nodes": len(fleet_nodes),
        "duration_s": round(span, 1),
        "load_avg_1m": round(load_after[0], 2),
        "cpus": os.cpu_count(),
        "background_nice": args.background_nice,
        "machine_speed_ms": speed_ms,
        "machine_speed_best_ms": best_ms,
        "machine_speed_after_ms": speed_after_ms,
        "machine_speed_during_ms": round(pct(probe_ms, 50), 1),
        "machine_memory_speed_during_ms": round(pct(probe_memory_ms, 50), 1),
        "steal_cores": round(steal / span, 2),
        "metrics_scrape_ms": round(metrics_after.get("scrape_s", 0) * 1000),
        "cpu_cores_by_role": {role: round(share, 2) for role, share in cpu.items()},
        "postgres_cores_by_client": {client: round(share, 2) for client, share in pg_by_client.items()},
        "endpoints": report,
    }
    print(json.dumps(figures))
    return 0 if figures["errors"] == 0 and no_reason == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
