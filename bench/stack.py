"""The deployment's process layout on one machine, shared by the benchmarks that run the whole stack
(``bench/scale.py``, ``bench/chaos.py``): the environment every part gets, the seed (tenants with
tokens, regions, a rate card, a fleet's bootstrap tokens), and :class:`Stack`, which starts the web,
the agent ingress, the two Celery workers and beat, each in a session of its own with its log, and
can kill and start each part again (a supervisor's restart, as compose's ``restart:`` or a
Kubernetes Deployment does)."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# The fleet: (catalog model, what the driver reports, GPUs per node, share of the nodes, cpu, ram GiB)
FLEET_MIX = (
    ("NVIDIA H100 SXM 80GB", "NVIDIA H100 80GB HBM3", 8, 0.4, 192, 2048),
    ("NVIDIA A100 SXM 80GB", "NVIDIA A100-SXM4-80GB", 8, 0.3, 128, 1024),
    ("NVIDIA L40S", "NVIDIA L40S", 4, 0.2, 64, 512),
    ("NVIDIA L4", "NVIDIA L4", 2, 0.1, 32, 128),
)
REGIONS = ("us-east-1", "eu-west-1", "ap-northeast-1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# /metrics answers only a scrape that sends the deployment's token, as Prometheus does.
METRICS_TOKEN = secrets.token_urlsafe(24)


def stack_env(db_url: str, redis_url: str, var_dir: Path, pool_size: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "TEST_DB_NAME")}
    env.update(
        DATABASE_URL=db_url,
        REDIS_URL=redis_url,
        DJANGO_SETTINGS_MODULE="portal.settings",
        DEBUG="0",
        SECRET_KEY="bench-only-secret-key-" + "x" * 40,
        SECURE_SSL_REDIRECT="0",
        LOG_LEVEL="WARNING",
        GPUPOOL_VAR_DIR=str(var_dir),
        # Capacity is what is measured here, not the per-token limit or the default quotas.
        API_RATE_LIMIT="1000000/min",
        METRICS_TOKEN=METRICS_TOKEN,
        SCHEDULING_DEFAULT_MAX_GPUS="100000",
        SCHEDULING_DEFAULT_MAX_WORKLOADS="100000",
        PYTHONPATH=str(ROOT),
        EMAIL_URL="dummymail://",
        # Under ASGI every request in flight holds a connection: a pool per process keeps a burst
        # (500 agents registering) within the server's max_connections.
        DB_POOL_MAX_SIZE=str(pool_size),
        # This process's own connections (seeding, counting); start() names each part's.
        DB_APPLICATION_NAME="gpupool-bench",
    )
    return env


def seed(*, tenants: int, nodes: int) -> tuple[list[str], list[dict], dict[str, int]]:
    """Tenants with tokens, regions, a rate card, and the fleet's bootstrap tokens."""
    from datetime import UTC, datetime

    from metering.models import RateCard
    from metering.services.rates import rate_card_version_create
    from nodes.models import GpuModel, Region
    from nodes.services.registration import bootstrap_token_create
    from portal.actors import Actor
    from portal.services.tenants import tenant_create
    from portal.services.tokens import api_token_create
    from scheduling.models import Plan

    system = Actor.system()
    regions = {
        code: Region.objects.get_or_create(code=code, defaults={"name": code, "location": code})[0]
        for code in REGIONS
    }
    models = {m: GpuModel.objects.get(name=m) for m, *_ in FLEET_MIX}
    per_node = {m: count for m, _, count, *_ in FLEET_MIX}
    card = RateCard.objects.create(name="Bench", currency="USD", is_default=True)
    prices = {"on_demand": "2.00", "spot": "0.80", "reserved": "1.50"}
    rate_card_version_create(
        rate_card=card,
        effective_from=datetime(2020, 1, 1, tzinfo=UTC),
        gpu_prices={(m.pk, plan): prices[plan] for m in models.values() for plan in Plan.values},
        allow_past=True,
    )
    tokens = []
    for i in range(tenants):
        tenant = tenant_create(
            slug=f"bench-{i:03d}", name=f"Bench {i}", owner_email=f"owner@bench-{i:03d}.test", actor=system
        )
        tokens.append(
            api_token_create(tenant=tenant, name="bench", scopes=["read", "write", "billing"], actor=system)[
                1
            ]
        )
    fleet = []
    kinds = [k for k in FLEET_MIX for _ in range(round(k[3] * 100))]
    random.Random(1).shuffle(kinds)  # every model in every region, whatever the fleet's size
    for n in range(nodes):
        model, driver, count, _, cpu, ram = kinds[n % len(kinds)]
        region = REGIONS[n % len(REGIONS)]
        hostname = f"scale-{n:04d}"
        token = bootstrap_token_create(region=regions[region], actor=system, intended_hostname=hostname)[1]
        fleet.append(
            {
                "hostname": hostname,
                "region": region,
                "bootstrap_token": token,
                "cpu_cores": cpu,
                "ram_mib": ram * 1024,
                "interconnect": "nvswitch" if count == 8 else "pcie",
                "gpus": [{"model": driver, "count": count, "memory_mib": models[model].memory_gib * 1024}],
            }
        )
    return tokens, fleet, per_node


def role_of(name: str) -> str:
    """The part of the stack a process started here belongs to: ``agents-3`` is ``agents``."""
    return name.rstrip("0123456789").rstrip("-")


def session_nice(pid: int, nice: int) -> None:
    """Put a session's processes (a process started with ``start_new_session``) at ``nice`` against
    the machine's other sessions, as a container's CPU shares put it against the other containers.
    With the kernel's autogroups on (``/proc/sys/kernel/sched_autogroup_enabled``, as on this
    machine and by default in most distributions' kernels), each session is one group: a
    process's own nice orders it only against the other processes of its session, and every
    group gets an equal share of a contended CPU whatever its processes' nice. Without
    autogroups, the process's own nice (``nice -n``) does it."""
    with contextlib.suppress(FileNotFoundError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def uvicorn_command(port: int, workers: int) -> list[str]:
    return [PY, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1", "--port", str(port),
            "--workers", str(workers), "--http", "httptools", "--loop", "uvloop", "--log-level", "warning",
            "--no-access-log", "--lifespan", "off", "--timeout-keep-alive", "75",
            "--timeout-graceful-shutdown", "10"]  # fmt: skip


CELERY = [PY, "-m", "celery", "-A", "portal"]


class Stack:
    """The processes of the deployment, by name (``web``, ``agent-web``, ``worker-scheduling``,
    ``worker-default``, ``beat``, and whatever else is started through :meth:`start`). Each runs in a
    session of its own (the teardown reaches its children), appends to ``<work>/<name>.log``, and
    names its database connections ``gpupool-<role>`` as deploy/'s services do."""

    def __init__(self, env: dict[str, str], work: Path) -> None:
        self.env = env
        self.work = work
        self.procs: dict[str, subprocess.Popen] = {}
        self._how: dict[str, tuple[list[str], int, dict[str, str]]] = {}
        self._lock = threading.RLock()
        self._held: set[str] = set()  # killed on purpose: not the supervisor's to start again
        self._supervising = threading.Event()
        self.exits: list[tuple[float, str, int]] = []  # (when, part, status): exits nobody asked for

    def start(self, name: str, cmd: list[str], nice: int = 0, env: dict[str, str] | None = None) -> None:
        with self._lock:
            self._held.discard(name)
            self._start(name, cmd, nice, env)

    def _start(self, name: str, cmd: list[str], nice: int, env: dict[str, str] | None) -> None:
        self._how[name] = (cmd, nice, env or {})
        role_env = {**self.env, "DB_APPLICATION_NAME": f"gpupool-{role_of(name)}", **(env or {})}
        log = open(self.work / f"{name}.log", "a")  # noqa: SIM115  (the child keeps it)
        full = ["nice", "-n", str(nice), *cmd] if nice else cmd
        try:
            self.procs[name] = subprocess.Popen(
                full, cwd=ROOT, env=role_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        if nice:
            session_nice(self.procs[name].pid, nice)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the part's whole session (``kill -9`` by default), and reap it. The supervisor
        leaves it down until :meth:`restart` or :meth:`start`."""
        with self._lock:
            self._held.add(name)
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def restart(self, name: str) -> None:
        """Start the part again as it was first started (its earlier process must be gone)."""
        cmd, nice, env = self._how[name]
        self.start(name, cmd, nice, env)

    def supervise(self, every: float = 1.0) -> None:
        """Start again, within ``every`` seconds, any part that exits without :meth:`kill`, as the
        deployment's supervisor does (compose's ``restart: unless-stopped``, a Deployment); each
        such exit is kept in :attr:`exits` and printed."""

        def loop() -> None:
            while not self._supervising.wait(every):
                with self._lock:
                    for name, proc in list(self.procs.items()):
                        if name in self._held or proc.poll() is None:
                            continue
                        self.exits.append((time.time(), name, proc.returncode))
                        print(f"    [{name} exited with status {proc.returncode}: started again]", flush=True)
                        self.restart(name)

        threading.Thread(target=loop, name="supervisor", daemon=True).start()

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def start_layout(self, *, port: int, agent_port: int | None, agent_web_workers: int, web_workers: int,
                     background: int, beat_schedule: Path) -> None:  # fmt: skip
        """The web (``web_workers`` uvicorn processes for pages and the API), the agent ingress
        (the same ASGI app in processes of its own, as deploy/'s ``agent-web``), the scheduling
        worker (queues scheduling and commands), the default worker (default and metering) and beat;
        everything but the web at nice ``background``."""
        self.start("web", uvicorn_command(port, web_workers))
        if agent_web_workers and agent_port:
            self.start("agent-web", uvicorn_command(agent_port, agent_web_workers), background)
        self.start("worker-scheduling", [*CELERY, "worker", "-Q", "scheduling,commands", "-n", "scheduling@%h",
                                         "--pool", "threads", "-c", "2", "--loglevel", "WARNING"], background)  # fmt: skip
        self.start("worker-default", [*CELERY, "worker", "-Q", "default,metering", "-n", "default@%h",
                                      "--pool", "threads", "-c", "2", "--loglevel", "WARNING"], background)  # fmt: skip
        self.start(
            "beat", [*CELERY, "beat", "--schedule", str(beat_schedule), "--loglevel", "WARNING"], background
        )

    def stop_all(self) -> None:
        self._supervising.set()
        with self._lock:
            self._held.update(self.procs)
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=20)
            # Whatever is left of its group: a uvicorn worker outlived its supervisor when the
            # supervisor was killed, and went on holding its connections.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


def wait_for(predicate, timeout: float, every: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
