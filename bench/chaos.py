"""Faults survived, counted: the whole stack under load, faults thrown at it on a seeded schedule,
then the invariants checked against the database and the agents.

    .venv/bin/python bench/chaos.py [--duration 600] [--seed 1] [--nodes 150]

Runs as root or as a user that can run PostgreSQL's ``initdb``: the run makes its OWN PostgreSQL
cluster (``initdb`` in a temporary directory, port ``--pg-port``, default 5442) and its OWN Redis
(``--redis-port``, default 6390, append-only file on), so restarting them never touches the
machine's shared servers. It starts the deployment's layout with ``bench/stack.py`` (as
``bench/scale.py``): web, agent ingress, the scheduling worker, the default + metering worker,
beat; a simulated fleet (real agent code, simulated GPUs and runtime) in processes of
``--agents-per-process`` agents; a local Stripe (``tests/metering/stripe_server.py``, answering
the real ``stripe`` library) with the payment provider set to Stripe; and tenants submitting jobs
and instances and stopping some. Then, for ``--duration`` seconds, one fault every
``--fault-every`` seconds (jittered), the kinds drawn by ``--seed``:

- ``kill-scheduling-worker``: ``kill -9`` of the scheduling worker while a cycle holds its lock;
- ``kill-metering-worker``: ``kill -9`` of the default + metering worker in an invoice or usage run;
- ``kill-beat``, ``kill-web``, ``kill-agent-web``: ``kill -9``, started again a few seconds later
  (a supervisor's restart);
- ``redis-restart`` (append-only file kept) and ``redis-restart-empty`` (its data lost);
- ``postgres-restart`` (fast: connections cut) and ``postgres-crash`` (immediate: crash recovery);
- ``partition-short`` / ``partition-long``: a few agents cut off from the portal (requests fail,
  answers to requests in flight are lost) for less / more than ``NODE_DOWN_AFTER_S``, then healed;
- ``agent-restart``: ``kill -9`` of a fleet process, started again on the same state (its buffers);
- ``agent-killed``: one agent process killed for good (at most once a run);
- ``duplicate-reports`` / ``reorder-reports``: a fleet process's heartbeats and command reports
  sent twice, or each followed by the one before it, for a while;
- ``stripe-webhooks``: an invoice paid at Stripe, its events delivered twice and out of order.

After the faults: everything healed and running, ``--settle`` seconds at most for the stack to
settle, a last usage and invoice run, and the checks (docs/reliability.md lists them). Prints the
schedule as it runs with the recovery time after each fault (until the API answers and a canary
job submitted after the fault runs), the checks, and a last line of JSON: ``faults``,
``invariant_violations``, ``lost_workloads``, ``double_allocations``, ``double_charges``,
``orphans``, ``max_recovery_s`` and more. Exit status 0 when every violation count is 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stack import PY, ROOT, Stack, free_port, seed, stack_env, up, wait_for

STRIPE_WEBHOOK_SECRET = "whsec_chaos"
JOB_RUN_S = (20, 90)
SUSPECT_AFTER_S = 30
DOWN_AFTER_S = 120
KINDS = (
    ("kill-scheduling-worker", 3),
    ("kill-metering-worker", 3),
    ("kill-beat", 2),
    ("kill-web", 2),
    ("kill-agent-web", 2),
    ("redis-restart", 2),
    ("redis-restart-empty", 2),
    ("postgres-restart", 2),
    ("postgres-crash", 1),
    ("partition-short", 2),
    ("partition-long", 1),
    ("agent-restart", 2),
    ("agent-killed", 1),
    ("duplicate-reports", 2),
    ("reorder-reports", 2),
    ("stripe-webhooks", 2),
)


# --- the simulated fleet (child process) --------------------------------------------------------------


def agents_child(fleet_file: str, portal_url: str, state_root: str, control: str, dump: str) -> int:
    """Run the fleet file's agents. Every half second reads ``control`` (JSON: ``partition``, a list
    of node ids or ``"*"``; ``duplicate`` and ``reorder``, booleans) and every two seconds writes
    what each agent's runtime runs to ``dump``."""
    import logging

    from nodes.agent import client as agent_client
    from nodes.agent.cli import run_event_loop
    from nodes.agent.fleet import Fleet

    state = {"partition": [], "duplicate": False, "reorder": False}
    previous: dict[tuple[int, str], object] = {}  # (node, kind) -> the last body sent
    original = agent_client.PortalClient.request

    def node_of(path: str) -> int | None:
        parts = path.split("/")
        if "nodes" in parts:
            with contextlib.suppress(ValueError, IndexError):
                return int(parts[parts.index("nodes") + 1])
        return None

    def cut(node: int | None) -> bool:
        p = state["partition"]
        return p == "*" or (node is not None and node in p)

    async def faulty(self, method, path, **kwargs):
        node = node_of(path)
        if cut(node):
            await asyncio.sleep(1)
            raise agent_client.PortalUnreachable("chaos: partitioned")
        response = await original(self, method, path, **kwargs)
        if cut(node):  # the request arrived; its answer is lost
            raise agent_client.PortalUnreachable("chaos: partitioned (answer lost)")
        kind = path.rsplit("/", 1)[-1]
        if method == "POST" and node is not None and kind != "commands" and response.status_code < 300:
            body = kwargs.get("json") if kwargs.get("json") is not None else kwargs.get("content")
            with contextlib.suppress(agent_client.PortalUnreachable):
                if state["duplicate"]:
                    await original(self, method, path, **kwargs)
                if state["reorder"] and (node, kind) in previous:
                    old = previous[(node, kind)]
                    again = dict(kwargs, json=old) if isinstance(old, dict) else dict(kwargs, content=old)
                    await original(self, method, path, **again)
            previous[(node, kind)] = body
        return response

    agent_client.PortalClient.request = faulty
    fleet = Fleet(fleet_file, portal_url=portal_url, state_root=state_root)

    async def watch() -> None:
        n = 0
        while True:
            with contextlib.suppress(OSError, ValueError):
                state.update(json.loads(Path(control).read_text()))
            if n % 4 == 0:
                out = {}
                for agent in fleet.agents:
                    if getattr(agent, "node_id", None) is None:
                        continue
                    with contextlib.suppress(Exception):
                        out[agent.config.hostname] = {
                            "node_id": agent.node_id,
                            "running": [
                                [s.workload_id, s.state, list(s.gpu_uuids)]
                                for s in agent.runtime.status()
                                if not s.terminal
                            ],
                            # Ended, with when: the portal hears of it at the next heartbeat.
                            "ended": {
                                s.workload_id: s.finished_at or 0
                                for s in agent.runtime.status()
                                if s.terminal
                            },
                        }
                        # What the portal has not acknowledged yet: its view of this node is as
                        # of the oldest such item (heartbeats and reports go out in order).
                        oldest = agent.buffer.peek()
                        out[agent.config.hostname]["unsent"] = agent.buffer.count()
                        out[agent.config.hostname]["unsent_since"] = oldest.created_at if oldest else None
                tmp = Path(dump + ".tmp")
                tmp.write_text(json.dumps({"at": time.time(), "agents": out}))
                tmp.replace(dump)
            n += 1
            await asyncio.sleep(0.5)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, fleet.request_stop)
        watcher = asyncio.create_task(watch())
        try:
            await fleet.run()
        finally:
            watcher.cancel()

    logging.basicConfig(level=logging.WARNING)
    run_event_loop(run())
    return 0


# --- the servers of its own ---------------------------------------------------------------------------


class Postgres:
    """A PostgreSQL cluster of the run's own, in ``root``, on ``port``."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root / "pg", port
        self.user = [] if os.geteuid() else ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str) -> None:
        subprocess.run([*self.user, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def init(self) -> None:
        self.root.mkdir()
        if self.user:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.root), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()

    def _ctl(self, *args: str) -> None:
        opts = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=400 "
            "-c shared_buffers=128MB"
        )
        self._run(
            "pg_ctl", "-D", str(self.root), "-o", opts, "-l", str(self.root / "server.log"), "-w", *args
        )

    def start(self) -> None:
        self._ctl("start")

    def restart(self, mode: str) -> None:
        self._ctl("restart", "-m", mode)

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._ctl("stop", "-m", "fast")

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/gpupool_chaos"


# --- the run ------------------------------------------------------------------------------------------


@dataclass
class Fault:
    n: int
    kind: str
    at: float  # when injected (time.time())
    detail: str = ""
    healed_at: float | None = None
    recovered_at: float | None = None
    window_end: float | None = None  # errors until then are the fault's
    phases: dict = field(default_factory=dict)  # the canary's steps, s after the fault (or heal)

    @property
    def recovery_s(self) -> float | None:
        """From the injection, or for a partition from its heal (its length is not the stack's)."""
        since = self.healed_at if self.kind.startswith("partition") else self.at
        return None if self.recovered_at is None or since is None else round(self.recovered_at - since, 1)


@dataclass
class Run:
    args: argparse.Namespace
    work: Path
    base: str
    agent_base: str
    stack: Stack
    pg: Postgres
    redis_dir: Path
    tokens: list[str]
    models: dict[str, int]
    groups: list[dict]  # {"name", "nodes": [hostname], "control": Path, "dump": Path, "dead": bool}
    stripe: object
    faults: list[Fault] = field(default_factory=list)
    api: list[tuple[float, str, int, bool]] = field(default_factory=list)  # (at, endpoint, status, shaped)
    submitted: dict[int, str] = field(default_factory=dict)  # workload id -> kind
    partitions: list[tuple[float, float, list[int]]] = field(default_factory=list)  # (from, to, nodes)
    stop_load: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    webhook_invoices: list[int] = field(default_factory=list)
    must_bill: set[int] = field(default_factory=set)  # allocations ended before the last invoice run


def redis_start(run_dir: Path, port: int, stack: Stack) -> None:
    stack.start(
        "redis",
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(run_dir),
         "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--protected-mode", "no"],
    )  # fmt: skip
    wait_for(lambda: _redis_up(port), 20, 0.2)


def _redis_up(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def control(group: dict, **changes) -> None:
    data = json.loads(group["control"].read_text())
    data.update(changes)
    group["control"].write_text(json.dumps(data))


def node_ids(run: Run, group: dict) -> list[int]:
    with contextlib.suppress(OSError, ValueError):
        return [a["node_id"] for a in json.loads(group["dump"].read_text())["agents"].values()]
    return []


# --- tenants ------------------------------------------------------------------------------------------


def error_shaped(content: bytes) -> bool:
    with contextlib.suppress(ValueError):
        body = json.loads(content)
        return isinstance(body, dict) and isinstance(body.get("error"), dict)
    return False


def tenant_load(run: Run, rate: float, seed_: int) -> None:
    """Tenants, one request every 1/rate s: submit a job (a few seconds to a minute and a half on
    the simulated fleet) or an instance, stop one of theirs, list, read."""
    rng = random.Random(seed_)
    client = httpx.Client(base_url=run.base, timeout=30)
    mine: dict[int, list[tuple[str, int]]] = defaultdict(list)
    while not run.stop_load.is_set():
        t = rng.randrange(len(run.tokens))
        headers = {"Authorization": f"Bearer {run.tokens[t]}"}
        roll = rng.random()
        model = rng.choice(list(run.models))
        spec = {"gpu_models": [model], "gpu_count": rng.choice([1, 1, 2]), "image": "ghcr.io/chaos/train:1"}
        if roll < 0.35:
            endpoint, method, path = "POST /api/v1/jobs/", "POST", "/api/v1/jobs/"
            spec |= {
                "command": ["python", "train.py"],
                "env": {"GPUPOOL_SIM_DURATION_S": str(rng.randint(*JOB_RUN_S))},
            }
        elif roll < 0.45:
            endpoint, method, path = "POST /api/v1/instances/", "POST", "/api/v1/instances/"
        elif roll < 0.6 and mine[t]:
            kind, wid = mine[t].pop(rng.randrange(len(mine[t])))
            endpoint, method, path, spec = (
                f"POST /api/v1/{kind}s/{{id}}/stop/",
                "POST",
                f"/api/v1/{kind}s/{wid}/stop/",
                None,
            )
        elif roll < 0.8:
            endpoint, method, path, spec = "GET /api/v1/jobs/", "GET", "/api/v1/jobs/", None
        else:
            endpoint, method, path, spec = "GET /api/v1/instances/", "GET", "/api/v1/instances/", None
        at = time.time()
        try:
            r = client.request(method, path, headers=headers, json=spec)
            status, shaped = r.status_code, r.status_code < 400 or error_shaped(r.content)
            if method == "POST" and status == 201 and spec is not None:
                wid = r.json()["id"]
                kind = "job" if "jobs" in path else "instance"
                with run.lock:
                    run.submitted[wid] = kind
                mine[t].append((kind, wid))
        except httpx.HTTPError:
            status, shaped = 0, True  # no answer: counted as an error of its time
        with run.lock:
            run.api.append((at, endpoint, status, shaped))
        run.stop_load.wait(max(0.0, 1 / rate - (time.time() - at)))
    client.close()


def canary(run: Run, since: float, deadline: float, phases: dict | None = None) -> float | None:
    """When the stack served again after a fault: the API answers, and a one-GPU job submitted now
    runs. ``None`` if not by ``deadline``. ``phases`` gets the seconds from ``since`` to the
    submission answered 201 (``api``), to the job first seen placed (``placed``: scheduled or
    starting) and to it seen running (``running``), to tell which part a long recovery waited on."""
    headers = {"Authorization": f"Bearer {run.tokens[0]}"}
    spec = {"gpu_models": [next(iter(run.models))], "gpu_count": 1, "image": "ghcr.io/chaos/canary:1",
            "command": ["true"], "env": {"GPUPOOL_SIM_DURATION_S": "5"}}  # fmt: skip
    phases = {} if phases is None else phases
    wid = None
    with httpx.Client(base_url=run.base, timeout=10) as client:
        while time.time() < deadline and not run.stop_load.is_set():
            try:
                if wid is None:
                    r = client.post("/api/v1/jobs/", headers=headers, json=spec)
                    if r.status_code == 201:
                        wid = r.json()["id"]
                        phases["api"] = round(time.time() - since, 1)
                        with run.lock:
                            run.submitted[wid] = "job"
                else:
                    r = client.get(f"/api/v1/jobs/{wid}/", headers=headers)
                    state = r.json()["state"] if r.status_code == 200 else None
                    if state in ("scheduled", "starting", "running", "succeeded"):
                        phases.setdefault("placed", round(time.time() - since, 1))
                    if state in ("running", "succeeded"):
                        phases["running"] = round(time.time() - since, 1)
                        return time.time()
            except httpx.HTTPError:
                pass
            time.sleep(1)
    return None


# --- faults -------------------------------------------------------------------------------------------


def cycle_lock_held() -> bool:
    from django.db import connection

    from scheduling.locks import CYCLE_LOCK_KEY

    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND granted",
                [CYCLE_LOCK_KEY & 0xFFFFFFFF],
            )
            return cursor.fetchone()[0] > 0
    except Exception:
        connection.close()
        return False


def metering_busy() -> bool:
    """The default + metering worker has a query running or a transaction open."""
    from django.db import connection

    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'gpupool-worker-default' "
                "AND state IN ('active', 'idle in transaction')"
            )
            return cursor.fetchone()[0] > 0
    except Exception:
        connection.close()
        return False


def kill_and_restart(run: Run, name: str, down_s: float) -> None:
    run.stack.kill(name)
    time.sleep(down_s)
    run.stack.restart(name)


def inject(run: Run, fault: Fault, rng: random.Random) -> None:
    """Inject ``fault``; returns when the part is started again or the heal is scheduled."""
    k = fault.kind
    stack = run.stack
    if k == "kill-scheduling-worker":
        found = wait_for(cycle_lock_held, 15, 0.05)
        fault.detail = "mid-cycle" if found else "no cycle seen in 15 s: killed anyway"
        kill_and_restart(run, "worker-scheduling", rng.uniform(1, 5))
    elif k == "kill-metering-worker":
        from portal.celery import app

        task = rng.choice(["metering.tasks.invoice_run", "metering.tasks.usage_build"])
        args = [date.today().replace(day=1).isoformat()] if task.endswith("invoice_run") else []
        app.send_task(task, args=args, queue="metering")
        busy = wait_for(metering_busy, 15, 0.02)
        time.sleep(rng.uniform(0, 0.2))
        fault.detail = task.rsplit(".", 1)[-1] + (" mid-run" if busy else ": not seen running in 15 s")
        fault.task = task  # type: ignore[attr-defined]
        kill_and_restart(run, "worker-default", rng.uniform(1, 5))
    elif k in ("kill-beat", "kill-web", "kill-agent-web"):
        kill_and_restart(run, k.removeprefix("kill-"), rng.uniform(1, 6))
    elif k in ("redis-restart", "redis-restart-empty"):
        stack.kill("redis")
        if k == "redis-restart-empty":
            for p in run.redis_dir.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        time.sleep(rng.uniform(1, 5))
        redis_start(run.redis_dir, run.args.redis_port, stack)
    elif k in ("postgres-restart", "postgres-crash"):
        run.pg.restart("fast" if k == "postgres-restart" else "immediate")
    elif k in ("partition-short", "partition-long"):
        # Any live rack, its agents not cut off already: partitions overlap, each heals its own.
        cut_now = {n for g in run.groups for ids in g["cuts"].values() for n in ids}
        live = [g for g in run.groups if not g["dead"] and set(node_ids(run, g)) - cut_now]
        group = rng.choice(live)
        ids = sorted(set(node_ids(run, group)) - cut_now)
        ids = rng.sample(ids, min(len(ids), max(1, run.args.partition_nodes)))
        length = (
            rng.uniform(SUSPECT_AFTER_S + 5, DOWN_AFTER_S - 20)
            if k == "partition-short"
            else rng.uniform(DOWN_AFTER_S + 20, DOWN_AFTER_S + 60)
        )
        fault.detail = f"{len(ids)} nodes of {group['name']} for {length:.0f} s"
        group["cuts"][fault.n] = ids
        control(group, partition=sorted(n for c in group["cuts"].values() for n in c))

        def heal() -> None:
            group["cuts"].pop(fault.n)
            control(group, partition=sorted(n for c in group["cuts"].values() for n in c))
            fault.healed_at = time.time()
            with run.lock:
                run.partitions.append((fault.at, fault.healed_at, ids))

        timer = threading.Timer(length, heal)
        timer.daemon = True
        timer.start()
        fault.heal = timer  # type: ignore[attr-defined]
    elif k in ("agent-restart", "agent-killed"):
        live = [g for g in run.groups if not g["dead"] and g["name"] != "agents-lone"]
        group = run.groups[-1] if k == "agent-killed" else rng.choice(live)
        fault.detail = f"{group['name']} ({len(group['nodes'])} agents)"
        if k == "agent-killed":
            stack.kill(group["name"])
            group["dead"] = True
        else:
            kill_and_restart(run, group["name"], rng.uniform(2, 10))
    elif k in ("duplicate-reports", "reorder-reports"):
        group = rng.choice([g for g in run.groups if not g["dead"]])
        length = rng.uniform(20, 60)
        flag = "duplicate" if k == "duplicate-reports" else "reorder"
        fault.detail = f"{group['name']} for {length:.0f} s"
        control(group, **{flag: True})
        timer = threading.Timer(length, lambda: control(group, **{flag: False}))
        timer.daemon = True
        timer.start()
    elif k == "stripe-webhooks":
        fault.detail = stripe_webhooks(run, rng)
    if fault.healed_at is None and not k.startswith("partition"):
        fault.healed_at = time.time()


def fault_plan(rng: random.Random, duration: float, every: float) -> list[tuple[float, str]]:
    """The run's faults: one in each ``every`` seconds of ``duration`` (at a random point of the
    first half of its slot, so an injection that waits for a cycle or an invoice run does not push
    the rest back), every kind at least once when there are slots enough, the rest drawn by
    weight; the agent killed for good once, and never in the last slot (its node goes DOWN only
    ``DOWN_AFTER_S`` later)."""
    slots = max(1, int(duration // every))
    kinds = [k for k, _ in KINDS]
    rng.shuffle(kinds)
    kinds = kinds[:slots]
    weighted = [k for k, w in KINDS for _ in range(w) if k != "agent-killed"]
    kinds += [rng.choice(weighted) for _ in range(slots - len(kinds))]
    rng.shuffle(kinds)
    if "agent-killed" in kinds and kinds[-1] == "agent-killed" and slots > 1:
        kinds[-1], kinds[0] = kinds[0], kinds[-1]
    return [(i * every + rng.uniform(0, every / 2), kind) for i, kind in enumerate(kinds)]


# --- Stripe -------------------------------------------------------------------------------------------


def stripe_seed(run: Run) -> None:
    """A few tenants with a finalized invoice for last month, sent to the local Stripe: what the
    webhook faults pay. Made with the services, as the invoice run and the provider would."""
    from metering.models import BillingAccount, Invoice, InvoiceStatus
    from metering.services.invoices import invoice_run
    from metering.services.payments import invoice_payment_submit
    from nodes.models import Gpu
    from portal.models import Tenant
    from scheduling.models import Allocation, Plan, Workload, WorkloadEvent, WorkloadState

    today = datetime.now(UTC)
    last_month = (today.replace(day=1) - timedelta(days=1)).replace(day=1)
    gpus = Gpu.objects.select_related("node", "model").order_by("pk")
    for tenant, gpu in zip(Tenant.objects.order_by("pk")[: run.args.stripe_invoices], gpus, strict=False):
        BillingAccount.objects.get_or_create(tenant=tenant)
        start = datetime(last_month.year, last_month.month, 2, tzinfo=UTC)
        w = Workload.objects.create(
            tenant=tenant, kind="job", state=WorkloadState.SUCCEEDED, plan=Plan.ON_DEMAND,
            image="ghcr.io/chaos/seed:1", started_at=start,
        )  # fmt: skip
        Allocation.objects.create(
            tenant=tenant, workload=w, node=gpu.node, gpu=gpu, gpu_model=gpu.model, plan=Plan.ON_DEMAND,
            started_at=start, ended_at=start + timedelta(hours=1), end_reason="succeeded",
        )  # fmt: skip
        WorkloadEvent.objects.create(
            tenant=tenant, workload=w, at=start, from_state="starting", to_state="running", reason="started"
        )
    invoice_run(period_start=last_month.date(), now=today + timedelta(days=40))
    for invoice in Invoice.objects.filter(status=InvoiceStatus.FINALIZED, period_start=last_month.date()):
        invoice_payment_submit(invoice_id=invoice.pk)
        run.webhook_invoices.append(invoice.pk)


def stripe_event(event_id: str, event_type: str, obj: dict) -> str:
    import stripe

    return json.dumps(
        {
            "id": event_id,
            "object": "event",
            "api_version": stripe.api_version,
            "created": int(time.time()),
            "livemode": False,
            "type": event_type,
            "data": {"object": obj},
        }
    )


def stripe_deliver(run: Run, payload: str) -> int:
    at = int(time.time())
    mac = hmac.new(STRIPE_WEBHOOK_SECRET.encode(), f"{at}.{payload}".encode(), hashlib.sha256).hexdigest()
    try:
        r = httpx.post(
            f"{run.base}/webhooks/stripe/",
            content=payload,
            headers={"Content-Type": "application/json", "Stripe-Signature": f"t={at},v1={mac}"},
            timeout=30,
        )
        return r.status_code
    except httpx.HTTPError:
        return 0


def stripe_webhooks(run: Run, rng: random.Random) -> str:
    """Pay one of the invoices at Stripe; deliver invoice.paid twice, then an older
    invoice.finalized after it (out of order). Stripe retries what was not answered 2xx."""
    from metering.models import Invoice

    state = run.stripe
    left = [i for i in run.webhook_invoices if Invoice.objects.get(pk=i).external_id != ""]
    if not left:
        return "no invoice sent to Stripe"
    invoice = Invoice.objects.get(pk=rng.choice(left))
    inv = state.invoices.get(invoice.external_id)
    if inv is None:
        return f"invoice {invoice.pk}: unknown at Stripe"
    older = dict(inv)
    if inv["status"] != "paid":
        state.pay(invoice.external_id)
    n = rng.randrange(1 << 30)
    paid = stripe_event(f"evt_chaos_paid_{n}", "invoice.paid", state.invoices[invoice.external_id])
    finalized = stripe_event(f"evt_chaos_fin_{n}", "invoice.finalized", older)
    codes = []
    for payload in (paid, paid, finalized, paid):
        for _ in range(5):  # Stripe's retries, shortened
            code = stripe_deliver(run, payload)
            if 200 <= code < 300:
                break
            time.sleep(2)
        codes.append(code)
    return f"invoice {invoice.pk}: paid, finalized late; answers {codes}"


# --- checks -------------------------------------------------------------------------------------------


def checks(run: Run, settled_at: float) -> dict:
    from django.db import connection
    from django.db.models import Sum

    from metering.models import Invoice, InvoiceStatus, UsageRecord
    from nodes.models import CommandState, Node, NodeCommand, NodeState, SequenceGap
    from scheduling.models import Allocation, Workload, WorkloadEvent, WorkloadState

    S = WorkloadState
    out: dict[str, int] = defaultdict(int)
    notes: list[str] = []

    def violation(key: str, text: str, n: int = 1) -> None:
        if n:
            out[key] += n
            notes.append(f"  VIOLATION {key}: {text}")

    # 1. No GPU held twice at any moment: allocations of one GPU overlapping in time and in share.
    # A forced release holds the GPU until the node confirms it gone.
    alloc = Allocation._meta.db_table
    held_until = (
        "CASE WHEN {t}.stop_forced_at IS NOT NULL THEN COALESCE(GREATEST({t}.ended_at, {t}.stop_confirmed_at), "
        "'infinity') ELSE COALESCE({t}.ended_at, 'infinity') END"
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT a.id, b.id FROM {alloc} a JOIN {alloc} b ON a.gpu_id = b.gpu_id AND a.id < b.id "
            f"AND a.started_at < {held_until.format(t='b')} AND b.started_at < {held_until.format(t='a')} "
            "AND a.milli_offset < b.milli_offset + COALESCE(b.span_milli, b.fraction_milli) "
            "AND b.milli_offset < a.milli_offset + COALESCE(a.span_milli, a.fraction_milli)"
        )
        pairs = cursor.fetchall()
    violation("double_allocations", f"allocation pairs sharing a GPU: {pairs[:5]}", len(pairs))

    # On the agents: a GPU running two workloads; a workload running that the portal has not placed
    # there (an orphan); one the portal has running there that the agent does not run (lost).
    on_agents: dict[int, dict[str, list[str]]] = {}
    ended_on_agents: dict[int, dict[str, float]] = {}
    heard_until: dict[int, float] = {}  # node -> when the portal's news of it was made
    dumped_at: dict[int, float] = {}  # node -> when its agent's state was read
    stale = []
    for g in run.groups:
        if g["dead"]:
            continue
        try:
            dump = json.loads(g["dump"].read_text())
        except (OSError, ValueError):
            stale.append(g["name"])
            continue
        if dump["at"] < settled_at:
            stale.append(g["name"])
        for a in dump["agents"].values():
            on_agents[a["node_id"]] = {w: gpus for w, st, gpus in a["running"]}
            heard_until[a["node_id"]] = a.get("unsent_since") or dump["at"]
            dumped_at[a["node_id"]] = dump["at"]
            ended_on_agents[a["node_id"]] = {w: at or dump["at"] for w, at in a.get("ended", {}).items()}
    if stale:
        notes.append(f"  (agent state not fresh from {stale})")
    for node_id, running in on_agents.items():
        seen: dict[str, str] = {}
        for wid, gpus in running.items():
            for uuid in gpus:
                if uuid in seen:
                    violation("double_allocations", f"node {node_id} GPU {uuid} runs {seen[uuid]} and {wid}")
                seen[uuid] = wid
    placed = defaultdict(set)
    for wid, node_id in Allocation.objects.filter(ended_at__isnull=True).values_list(
        "workload_id", "node_id"
    ):
        placed[node_id].add(str(wid))
    for node_id, running in on_agents.items():
        orphans = [w for w in running if w not in placed[node_id]]
        violation(
            "orphans", f"node {node_id} runs {orphans} that the portal has not placed there", len(orphans)
        )
    dead_nodes = set()
    for g in run.groups:
        if g["dead"]:
            dead_nodes |= set(Node.objects.filter(hostname__in=g["nodes"]).values_list("pk", flat=True))
    running_states = (S.RUNNING,)
    for node_id, wid, placed_at in Allocation.objects.filter(
        ended_at__isnull=True, workload__state__in=running_states
    ).values_list("node_id", "workload_id", "started_at"):
        # Placed less than a long poll before the agent's state was read: it may not run it yet
        # (seed 2: placed 0.1 s before the dump, started on the agent 0.1 s after it).
        if placed_at.timestamp() > dumped_at.get(node_id, 0) - 30:
            continue
        # Ended on the agent after the last batch the portal has (the oldest unacknowledged, or
        # the dump's time less a heartbeat interval and the time to act on it): not heard yet.
        ended = ended_on_agents.get(node_id, {}).get(str(wid))
        if ended is not None and ended > heard_until.get(node_id, 0) - 20:
            continue
        if node_id in on_agents and str(wid) not in on_agents[node_id]:
            violation(
                "lost_workloads", f"workload {wid} RUNNING on node {node_id} by the portal, not on its agent"
            )

    # 2. Every submitted workload is known; waiting ones have a reason; nothing stuck.
    ids = list(run.submitted)
    found = dict(Workload.objects.filter(pk__in=ids).values_list("pk", "state"))
    missing = [i for i in ids if i not in found]
    violation("lost_workloads", f"submitted workloads not in the database: {missing[:10]}", len(missing))
    no_reason = list(
        Workload.objects.filter(
            pk__in=ids, state__in=(S.PENDING, S.QUEUED), pending_reason__in=("", "submitted")
        ).values_list("pk", flat=True)[:10]
    )
    violation("waiting_without_reason", f"{no_reason}", len(no_reason))
    now = datetime.now(UTC)
    limits = {S.SCHEDULED: 300 + 60, S.STARTING: 300 + 60, S.STOPPING: 30 + 60 + 60, S.PREEMPTED: 120}
    for state, limit in limits.items():
        stuck = list(
            Workload.objects.filter(
                pk__in=ids, state=state, state_changed_at__lt=now - timedelta(seconds=limit)
            ).values_list("pk", flat=True)[:10]
        )
        violation("stuck_workloads", f"{state} for more than {limit} s: {stuck}", len(stuck))
    by_state = dict(Counter_(found.values()))

    # 3. Usage: no allocation billed twice, none that ran left unbilled; invoices match.
    per_alloc = UsageRecord.objects.values("allocation_id").annotate(
        s=Sum("seconds"), t=Sum("minimum_topup_s")
    )
    spans = {
        a: (e - s).total_seconds()
        for a, s, e in Allocation.objects.filter(ended_at__isnull=False).values_list(
            "pk", "started_at", "ended_at"
        )
    }
    twice = [
        r["allocation_id"]
        for r in per_alloc
        if r["s"] - (r["t"] or 0) > Decimal(str(spans.get(r["allocation_id"], 1e12))) + 1
    ]
    violation("double_charges", f"allocations billed for more than they were held: {twice[:10]}", len(twice))
    billed = set(UsageRecord.objects.values_list("allocation_id", flat=True))
    ran = set()
    for a_id, w_id, s, e in Allocation.objects.filter(
        ended_at__isnull=False, ended_at__lt=now - timedelta(seconds=5)
    ).values_list("pk", "workload_id", "started_at", "ended_at"):
        ran.add((a_id, w_id, s, e))
    running_at = defaultdict(list)
    for w_id, at in WorkloadEvent.objects.filter(
        to_state=S.RUNNING, workload_id__in={r[1] for r in ran}
    ).values_list("workload_id", "at"):
        running_at[w_id].append(at)
    unbilled = [a for a, w, s, e in ran if a not in billed and any(s <= at < e for at in running_at[w])]
    violation("unbilled", f"allocations that ran, not billed: {unbilled[:10]}", len(unbilled))
    # Invoices of this month: each subtotal equal to its usage records' amounts (the invoicer's
    # sum), and equal to a total computed here from the allocations and the rate card alone.
    period = date.today().replace(day=1)
    invoices = list(Invoice.objects.filter(period_start=period).exclude(status=InvoiceStatus.VOID))
    mismatched = []
    for inv in invoices:
        expected = UsageRecord.objects.filter(tenant_id=inv.tenant_id, period_start=period).aggregate(
            t=Sum("amount")
        )["t"] or Decimal(0)
        if abs(inv.subtotal - expected) > Decimal("0.01") * max(1, inv.lines.count()):
            mismatched.append((inv.pk, str(inv.subtotal), str(expected)))
    violation("invoice_mismatches", f"(invoice, subtotal, records) {mismatched[:5]}", len(mismatched))
    usage_vs_allocations(run, invoices, period, violation, notes)
    # Stripe: each invoice at Stripe once; paid ones paid here.
    by_ours = defaultdict(int)
    for s_inv in run.stripe.invoices.values():
        by_ours[s_inv["metadata"].get("gpupool_invoice_id") or s_inv["metadata"].get("invoice_id")] += 1
    dup = [k for k, n in by_ours.items() if k and n > 1]
    violation("double_charges", f"invoices sent to Stripe more than once: {dup}", len(dup))
    for s_id, s_inv in run.stripe.invoices.items():
        if s_inv["status"] == "paid":
            ours = Invoice.objects.filter(external_id=s_id).first()
            if ours is not None and ours.status != InvoiceStatus.PAID:
                violation("payment_mismatches", f"invoice {ours.pk} paid at Stripe, {ours.status} here")

    # 4. Commands delivered or expired with a reason; telemetry whole where the buffer covers it.
    open_late = (
        NodeCommand.objects.filter(
            state__in=(CommandState.PENDING, CommandState.DELIVERED), deadline__lt=now - timedelta(seconds=30)
        )
        .exclude(node_id__in=dead_nodes)
        .count()
    )
    violation("commands_unresolved", f"{open_late} open past their deadline", open_late)
    silent = NodeCommand.objects.filter(state=CommandState.EXPIRED, message="").count()
    violation("commands_unresolved", f"{silent} expired without a reason", silent)
    gaps = list(
        SequenceGap.objects.exclude(node_id__in=dead_nodes)
        .filter(last_seq__gte=0)
        .values_list("node_id", "first_seq", "last_seq")[:10]
    )
    n_gaps = SequenceGap.objects.exclude(node_id__in=dead_nodes).count()
    violation("telemetry_lost", f"heartbeat batches never arrived (node, first, last): {gaps}", n_gaps)
    not_ready = list(
        Node.objects.exclude(pk__in=dead_nodes)
        .exclude(state=NodeState.READY)
        .values_list("hostname", "state")[:10]
    )
    violation("nodes_not_back", f"{not_ready}", len(not_ready))

    # 5. The API answered: errors only inside a fault's window, and those with the error shape.
    windows = [(f.at - 1, (f.window_end or f.at) + 5) for f in run.faults]
    outside, unshaped, inside = [], 0, 0
    for at, endpoint, status, shaped in run.api:
        if status == 0 or status >= 500:
            if any(a <= at <= b for a, b in windows):
                inside += 1
                if status and not shaped:
                    unshaped += 1
            else:
                outside.append((round(at - run.faults[0].at if run.faults else 0, 1), endpoint, status))
    violation("api_errors_outside_outages", f"{outside[:10]}", len(outside))
    violation("api_errors_unshaped", f"{unshaped} 5xx without the error shape", unshaped)
    out["api_errors_in_outages"] = inside
    out["api_requests"] = len(run.api)
    out["submitted"] = len(ids)
    connection.close()
    return {"counts": dict(out), "notes": notes, "states": by_state}


USAGE_SQL = """
WITH alloc AS (
    SELECT a.id, a.tenant_id, a.gpu_model_id, a.plan, a.fraction_milli, a.ended_at, a.end_reason,
           n.region_id, n.last_heartbeat_at,
           (SELECT min(e.at) FROM scheduling_workloadevent e
             WHERE e.workload_id = a.workload_id AND e.to_state = 'running'
               AND e.at >= a.started_at AND e.at < a.ended_at) AS ran_from
      FROM scheduling_allocation a JOIN nodes_node n ON n.id = a.node_id
     WHERE a.ended_at IS NOT NULL
       AND (a.id = ANY(%(must)s)
            OR a.id IN (SELECT allocation_id FROM metering_usagerecord WHERE invoice_id = ANY(%(invoices)s)))
), span AS (
    SELECT alloc.*,
           CASE WHEN end_reason = 'node_down' AND last_heartbeat_at >= ran_from
                     AND last_heartbeat_at < ended_at THEN last_heartbeat_at
                ELSE ended_at END AS ran_to
      FROM alloc WHERE ran_from IS NOT NULL
), card AS (
    SELECT span.*, COALESCE(b.discount_percent, 0) AS discount,
           COALESCE(b.rate_card_id, (SELECT id FROM metering_ratecard WHERE is_default)) AS card_id
      FROM span LEFT JOIN metering_billingaccount b ON b.tenant_id = span.tenant_id
     WHERE ran_to > ran_from AND ran_from >= %(month)s
)
SELECT card.id, card.tenant_id, card.plan,
       GREATEST(EXTRACT(EPOCH FROM ran_to - ran_from), %(minimum)s) * fraction_milli / 1000
         * (SELECT p.price_per_gpu_hour
              FROM metering_gpuprice p JOIN metering_ratecardversion v ON v.id = p.version_id
             WHERE v.rate_card_id = card.card_id AND v.effective_from <= ran_from
               AND (v.effective_to IS NULL OR v.effective_to > ran_from)
               AND p.gpu_model_id = card.gpu_model_id AND p.plan = card.plan
               AND (p.region_id = card.region_id OR p.region_id IS NULL)
             ORDER BY p.region_id IS NULL LIMIT 1)
         * (100 - discount) / 100 / 3600 AS amount
  FROM card
"""


def usage_vs_allocations(run: Run, invoices: list, period: date, violation, notes: list[str]) -> None:
    """The usage invariant, apart from the metering code: what each allocation should cost, from
    its own rows (the first RUNNING event inside it to its end, the node's last heartbeat for a
    node_down end; at least the minimum; GPU share times the rate card's hourly price) in one SQL
    query of its own, compared with its usage records and, summed per tenant, with the tenant's
    invoice. The allocations checked: every one ended before the last invoice run
    (``run.must_bill``) and every one on an invoice. The bench's card prices GPU-hours only
    (on-demand, no vCPU, RAM or GPU-memory prices, no spot market): anything else is refused
    here rather than checked half."""
    from django.conf import settings
    from django.db import connection
    from django.db.models import Q, Sum

    from metering.models import InvoiceLine, RateCardVersion, UsageRecord

    extras = RateCardVersion.objects.filter(
        Q(vcpu_hour_price__isnull=False)
        | Q(ram_gib_hour_price__isnull=False)
        | Q(gpu_memory_gib_hour_price__isnull=False)
    ).count()
    violation("usage_unchecked", f"{extras} rate card versions price more than GPU-hours", extras)
    with connection.cursor() as cursor:
        cursor.execute(
            USAGE_SQL,
            {
                "must": sorted(run.must_bill),
                "invoices": [i.pk for i in invoices],
                "month": datetime(period.year, period.month, 1, tzinfo=UTC),
                "minimum": settings.METERING_MINIMUM_BILLABLE_S,
            },
        )
        rows = cursor.fetchall()
    other_plans = sorted({plan for _, _, plan, _ in rows if plan != "on_demand"})
    violation("usage_unchecked", f"allocations of plans {other_plans} (not priced here)", len(other_plans))
    unpriced = [a for a, _, _, amount in rows if amount is None]
    violation("usage_unchecked", f"allocations without a GPU-hour price: {unpriced[:10]}", len(unpriced))
    expected = {a: (t, Decimal(amount)) for a, t, _, amount in rows if amount is not None}
    recorded = dict(
        UsageRecord.objects.filter(allocation_id__in=list(expected), period_start=period)
        .values("allocation_id")
        .annotate(t=Sum("amount"))
        .values_list("allocation_id", "t")
    )
    # Records keep 10 places each; a few pieces per allocation.
    off = [
        (a, str(recorded.get(a)), str(amount.quantize(Decimal("1e-10"))))
        for a, (_, amount) in sorted(expected.items())
        if abs((recorded.get(a) or Decimal(0)) - amount) > Decimal("1e-8")
    ]
    violation("usage_mismatches", f"(allocation, recorded, from the allocation) {off[:10]}", len(off))
    per_tenant: dict[int, Decimal] = defaultdict(Decimal)
    for t, amount in expected.values():
        per_tenant[t] += amount
    wrong = []
    for inv in invoices:
        lines = InvoiceLine.objects.filter(invoice=inv).count()
        want = per_tenant.pop(inv.tenant_id, Decimal(0))
        # Each line is rounded to the cent once.
        if abs(inv.subtotal - want) > Decimal("0.005") * max(1, lines) + Decimal("1e-6"):
            wrong.append((inv.pk, str(inv.subtotal), str(want.quantize(Decimal("0.0001")))))
    missing = [(t, str(v.quantize(Decimal("0.0001")))) for t, v in per_tenant.items() if v > Decimal("0.005")]
    violation("usage_mismatches", f"(invoice, subtotal, from the allocations) {wrong[:5]}", len(wrong))
    violation("usage_mismatches", f"(tenant, owed) without an invoice: {missing[:5]}", len(missing))
    total = sum((v for _, v in expected.values()), Decimal(0))
    notes.append(
        f"  usage: {len(expected)} allocations, {total.quantize(Decimal('0.01'))} USD computed from the "
        f"allocations; {len(invoices)} invoices, {sum((i.subtotal for i in invoices), Decimal(0))} USD"
    )


def Counter_(values) -> dict:
    c: dict = defaultdict(int)
    for v in values:
        c[v] += 1
    return dict(sorted(c.items()))


# --- main ---------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--nodes", type=int, default=150, help="simulated nodes (150: what the shared 2-core machine carries)"
    )
    parser.add_argument("--fault-every", type=float, default=15.0, help="mean seconds between faults")
    parser.add_argument("--agents-per-process", type=int, default=50)
    parser.add_argument("--partition-nodes", type=int, default=5, help="agents cut off by a partition")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--rate", type=float, default=2.0, help="tenant requests per second")
    parser.add_argument("--settle", type=float, default=240.0, help="seconds allowed to settle")
    parser.add_argument(
        "--recovery-cap", type=float, default=300.0, help="a fault not recovered from by then counts"
    )
    parser.add_argument("--stripe-invoices", type=int, default=4)
    parser.add_argument("--pg-port", type=int, default=5442)
    parser.add_argument("--redis-port", type=int, default=6390)
    parser.add_argument(
        "--background-nice",
        type=int,
        default=0,
        help="nice of the workers, beat, agent ingress and fleet (bench/scale.py's 10 weighs the stack "
        "against itself; on a machine shared with other sessions it starves the run against theirs)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, data)")
    parser.add_argument("--agents-child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agents_child:
        return agents_child(*args.agents_child)

    # SIGTERM ends the run as Ctrl-C does: the stack and the servers are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="gpupool-chaos-"))
    os.chmod(work, 0o755)
    pg = Postgres(work, args.pg_port)
    redis_dir = work / "redis"
    redis_dir.mkdir()
    print(
        f"chaos: seed {args.seed}, {args.duration:.0f} s of faults, {args.nodes} nodes; work in {work}",
        flush=True,
    )
    pg.init()
    subprocess.run(
        [*pg.user, "psql", "-h", "127.0.0.1", "-p", str(args.pg_port), "-U", "postgres", "-c", "CREATE DATABASE gpupool_chaos"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    from tests.metering.stripe_server import StripeServer

    stripe_server = StripeServer().__enter__()
    env = stack_env(pg.url, f"redis://127.0.0.1:{args.redis_port}/0", work / "var", 8)
    env.update(
        NODE_SUSPECT_AFTER_S=str(SUSPECT_AFTER_S),
        NODE_DOWN_AFTER_S=str(DOWN_AFTER_S),
        METERING_PAYMENT_PROVIDER="stripe",
        STRIPE_API_BASE=stripe_server.url,
        STRIPE_SECRET_KEY="sk_test_chaos",
        STRIPE_WEBHOOK_SECRET=STRIPE_WEBHOOK_SECRET,
        # Limits short enough for a visibility timeout (150 s) inside the settling time: a killed
        # worker's task comes back within the run (the deployment's: 1,260 s).
        GPUPOOL_TASK_TIME_LIMIT_S="60",
        GPUPOOL_LONG_TASK_TIME_LIMIT_S="60",
        GPUPOOL_TASK_LONGEST_COUNTDOWN_S="30",
    )
    (work / "var").mkdir()
    stack = Stack(env, work)
    redis_start(redis_dir, args.redis_port, stack)
    subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    os.environ.update(env)
    import django

    django.setup()
    from django.db import connection

    tokens, fleet_nodes, models = seed(tenants=args.tenants, nodes=args.nodes)
    port, agent_port = free_port(), free_port()
    base, agent_base = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{agent_port}"
    groups = []
    per = args.agents_per_process
    # The last agent in a process of its own: the one killed for good (killing a whole process of
    # them would silence a third of the fleet, which the portal reads as its own network's fault).
    # Each node in exactly one process: the lone one is not also in the last rack (a second agent of
    # the same node there kept it alive after the lone one was killed).
    rest = fleet_nodes[:-1]
    parts = [rest[i : i + per] for i in range(0, len(rest), per)] + [fleet_nodes[-1:]]
    for i, part in enumerate(parts):
        name = f"agents-{i}" if i < len(parts) - 1 else "agents-lone"
        (work / f"{name}.json").write_text(json.dumps({"portal_url": agent_base, "nodes": part}))
        ctl = work / f"{name}.control"
        ctl.write_text(json.dumps({"partition": [], "duplicate": False, "reorder": False}))
        groups.append({"name": name, "nodes": [n["hostname"] for n in part], "control": ctl,
                       "dump": work / f"{name}.dump", "dead": False, "cuts": {}})  # fmt: skip
    run = Run(args, work, base, agent_base, stack, pg, redis_dir, tokens, models, groups, stripe_server.state)
    connection.close()
    result = 1
    try:
        stack.start_layout(port=port, agent_port=agent_port, agent_web_workers=1, web_workers=1,
                           background=args.background_nice, beat_schedule=work / "beat-schedule")  # fmt: skip
        stack.supervise()
        if not wait_for(lambda: up(base) and up(agent_base), 90):
            print("the web processes did not start", file=sys.stderr)
            return 1
        from nodes.models import Node, NodeState

        def ready() -> int:
            n = Node.objects.filter(state=NodeState.READY).count()
            connection.close()
            return n

        # The fleet comes up a process (a rack) at a time, as bench/scale.py's: 300 agents
        # registering at once on a loaded 2-core machine time out and retry in a storm.
        t0 = time.monotonic()
        for i, g in enumerate(groups):
            stack.start(g["name"], [PY, str(Path(__file__).resolve()), "--agents-child", str(work / f"{g['name']}.json"),
                                    agent_base, str(work / "agents"), str(g["control"]), str(g["dump"])], args.background_nice)  # fmt: skip
            target = sum(len(x["nodes"]) for x in groups[: i + 1])
            wait_for(lambda target=target: ready() >= target, 300, 2)
        print(
            f"fleet: {ready()} of {len(fleet_nodes)} nodes READY after {time.monotonic() - t0:.0f} s",
            flush=True,
        )
        stripe_seed(run)
        connection.close()
        print(
            f"stripe: {len(run.webhook_invoices)} invoices of last month sent to the local Stripe", flush=True
        )

        loader = threading.Thread(target=tenant_load, args=(run, args.rate, args.seed), daemon=True)
        loader.start()
        time.sleep(10)  # the load under way before the first fault
        plan = fault_plan(rng, args.duration, args.fault_every)
        start = time.time()
        recoveries: list[threading.Thread] = []
        print(f"\n{len(plan)} faults planned, {len({k for _, k in plan})} kinds of {len(KINDS)}")
        print(f"\n{'#':>3} {'t s':>6}  {'fault':24} detail", flush=True)
        for n, (due, kind) in enumerate(plan, 1):
            time.sleep(max(0.0, start + due - time.time()))
            fault = Fault(n, kind, time.time())
            run.faults.append(fault)
            try:
                inject(run, fault, rng)
            except Exception as exc:  # a failed injection is reported, the run goes on
                fault.detail = f"injection failed: {type(exc).__name__}: {exc}"
            connection.close()
            print(f"{n:3d} {fault.at - start:6.1f}  {kind:24} {fault.detail}", flush=True)

            def recover(fault: Fault = fault) -> None:
                heal = getattr(fault, "heal", None)
                if heal is not None:
                    heal.join()
                since = fault.healed_at or fault.at
                fault.recovered_at = canary(run, since, since + args.recovery_cap, fault.phases)
                fault.window_end = fault.recovered_at or (since + args.recovery_cap)
                r = fault.recovery_s
                after = f", healed at {since - fault.at:.0f} s" if fault.kind.startswith("partition") else ""
                steps = ", ".join(f"{k} {v} s" for k, v in fault.phases.items())
                print(f"    fault {fault.n} ({fault.kind}): recovered after {r} s ({steps}{after})" if r is not None
                      else f"    fault {fault.n} ({fault.kind}): NOT recovered in {args.recovery_cap:.0f} s ({steps})", flush=True)  # fmt: skip

            t = threading.Thread(target=recover, daemon=True)
            t.start()
            recoveries.append(t)
        time.sleep(max(0.0, start + args.duration - time.time()))  # the run's full length under faults
        print(f"\nfaults done after {time.time() - start:.0f} s; settling", flush=True)
        for t in recoveries:
            t.join(timeout=args.recovery_cap + 200)
        run.stop_load.set()
        loader.join(timeout=60)
        for name in list(stack.procs):
            if not stack.alive(name) and not any(g["name"] == name and g["dead"] for g in groups):
                print(f"  {name} was not running: started again", flush=True)
                stack.restart(name)
        settled_at = time.time()
        from scheduling.models import Workload, WorkloadState

        live = [h for g in groups if not g["dead"] for h in g["nodes"]]

        from nodes.models import OPEN_COMMAND_STATES, CommandKind, NodeCommand

        def caught_up() -> bool:
            """Every live agent's buffer sent (what the portal knows of it is current)."""
            for g in groups:
                if g["dead"]:
                    continue
                try:
                    dump = json.loads(g["dump"].read_text())
                except (OSError, ValueError):
                    return False
                if time.time() - dump["at"] > 10 or any(
                    a.get("unsent", 0) > 1 for a in dump["agents"].values()
                ):
                    return False
            return True

        def settled() -> bool:
            try:
                ok = (
                    Node.objects.filter(hostname__in=live).exclude(state=NodeState.READY).count() == 0
                    and not Workload.objects.filter(
                        state__in=(WorkloadState.PENDING, WorkloadState.QUEUED),
                        pending_reason__in=("", "submitted"),
                    ).exists()
                    # No stop still on its way to a live node (the reaper's included).
                    and not NodeCommand.objects.filter(
                        node__hostname__in=live,
                        kind__in=(CommandKind.STOP_WORKLOAD, CommandKind.PREEMPT_WORKLOAD),
                        state__in=OPEN_COMMAND_STATES,
                    ).exists()
                    and caught_up()
                )
            except Exception:
                ok = False
            connection.close()
            return ok

        if not wait_for(settled, args.settle, 2):
            print(f"  not settled in {args.settle:.0f} s: checking as it is", flush=True)
        time.sleep(15)  # a last reaper round, heartbeat and agent dumps past the settle mark
        settled_at = time.time() - 10
        # A killed invoice run must have run again (redelivered) before the last one here.
        from django.db.models import Max

        from metering.models import Invoice
        from metering.services.invoices import invoice_run
        from metering.services.usage import usage_build

        built = Invoice.objects.filter(period_start=date.today().replace(day=1)).aggregate(m=Max("built_at"))[
            "m"
        ]
        killed = [f for f in run.faults if getattr(f, "task", "").endswith("invoice_run")]
        lost_runs = 0
        if killed and (built is None or built.timestamp() < killed[-1].at):
            lost_runs = 1
        # The last usage and invoice runs here, with beat and the metering worker stopped so that no
        # other run rebuilds an invoice while it is read; allocations still end (the agents report).
        for name in ("beat", "worker-default"):
            stack.kill(name, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                stack.procs[name].wait(timeout=60)
        from scheduling.models import Allocation

        run.must_bill = set(Allocation.objects.filter(ended_at__isnull=False).values_list("pk", flat=True))
        usage_build()
        invoice_run(period_start=date.today().replace(day=1))
        print(
            f"settled in {time.time() - start - args.duration:.0f} s after the faults; checking", flush=True
        )
        found = checks(run, settled_at)
        if lost_runs:
            found["counts"]["tasks_lost"] = lost_runs
            found["notes"].append(
                f"  VIOLATION tasks_lost: the invoice run killed at fault {killed[-1].n} never ran again"
            )
        print("\ninvariants:")
        for line in found["notes"]:
            print(line)
        counts = found["counts"]
        violation_keys = [
            k for k in counts if k not in ("api_errors_in_outages", "api_requests", "submitted")
        ]
        total = sum(counts[k] for k in violation_keys)
        if not total:
            print("  all hold")
        print(f"workloads by state: {found['states']}")
        recoveries_s = [f.recovery_s for f in run.faults]
        not_recovered = sum(1 for r in recoveries_s if r is None)
        by_kind = defaultdict(list)
        for f in run.faults:
            by_kind[f.kind].append(f.recovery_s)
        figures = {
            "faults": len(run.faults),
            "invariant_violations": total + not_recovered,
            "lost_workloads": counts.get("lost_workloads", 0),
            "double_allocations": counts.get("double_allocations", 0),
            "double_charges": counts.get("double_charges", 0),
            "orphans": counts.get("orphans", 0),
            "max_recovery_s": max((r for r in recoveries_s if r is not None), default=0),
            "not_recovered": not_recovered,
            **{
                k: counts[k]
                for k in sorted(counts)
                if k not in ("lost_workloads", "double_allocations", "double_charges", "orphans")
            },
            "faults_by_kind": {k: len(v) for k, v in sorted(by_kind.items())},
            # The longest recovery of each kind (s; a partition's from its heal); None: not recovered.
            "max_recovery_by_kind": {k: None if None in v else max(v) for k, v in sorted(by_kind.items())},
            # Parts that exited without being killed, started again by the supervisor.
            "process_exits": Counter_(name for _, name, _ in stack.exits),
            "seed": args.seed,
            "duration_s": args.duration,
            "nodes": args.nodes,
        }
        print(json.dumps(figures))
        result = 0 if figures["invariant_violations"] == 0 else 1
    finally:
        run.stop_load.set()
        stack.stop_all()
        pg.stop()
        stripe_server.__exit__(None, None, None)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
