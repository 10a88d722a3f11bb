"""End to end: the real portal (uvicorn serving ``portal.asgi``), a real database and the real agent
program (``python -m nodes.agent.cli run`` with the simulated collector and runtime).

The portal runs in this process, in a thread, so that receivers connected here see the signals it
sends (``command_finished``, ``workload_exited``, ``gpu_unhealthy``, ``node_down``) exactly as
scheduling's receivers do; stopping it closes its socket and every connection, which is an outage
as far as the agent can tell. Its database is one that every thread can use at once: a SQLite file
(WAL) or a PostgreSQL database of its own, made and migrated for this module and dropped after it
(pytest-django's in-memory SQLite test database cannot be shared by concurrent threads).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from django.conf import settings as django_settings
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connections
from django.db.models import Count, Sum

from nodes.agent.collectors.simulated import SIMULATED_FIRMWARE, simulated_gpu_uuid
from nodes.models import (
    Gpu,
    GpuHealth,
    GpuMinuteRollup,
    GpuSample,
    HeartbeatBatch,
    Node,
    NodeCommand,
    NodeCommandEvent,
    NodeState,
    NodeWorkloadStatus,
    Region,
    SequenceGap,
)
from nodes.services.commands import node_command_enqueue
from nodes.services.health import node_health_reconcile
from nodes.services.registration import bootstrap_token_create
from nodes.signals import command_finished, gpu_unhealthy, node_down, workload_exited
from portal.actors import Actor
from tests.conftest import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"
SAMPLE_INTERVAL_S = 0.1
HEARTBEAT_INTERVAL_S = 0.5


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


# --- the database --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e2e_database(django_db_blocker, tmp_path_factory) -> Iterator[str]:
    """Point the ``default`` database (its settings dict is shared by every thread's connection) at
    one of this module's own, migrate it, and put everything back afterwards. This thread gets a
    new connection object meanwhile: the test database's stays as it is (closing a connection to
    SQLite's in-memory test database would destroy that database)."""
    test_connection = connections["default"]
    settings_dict = test_connection.settings_dict
    saved = settings_dict["NAME"]
    postgres = test_connection.vendor == "postgresql"
    with django_db_blocker.unblock():
        if postgres:
            # After the test database's name (TEST_DB_NAME), so that suites running side by side
            # on one server (each with its own) never drop each other's.
            name = f"{(settings_dict.get('TEST') or {}).get('NAME') or saved}_agent_e2e"[:63]
            with test_connection._nodb_cursor() as cursor:
                cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                cursor.execute(f'CREATE DATABASE "{name}"')
        else:
            name = str(tmp_path_factory.mktemp("e2e") / "portal.sqlite3")
        settings_dict["NAME"] = name
        connections["default"] = connections.create_connection("default")
        ContentType.objects.clear_cache()
        try:
            call_command("migrate", verbosity=0, interactive=False)  # also seeds the GPU catalog
            Region.objects.get_or_create(code="e2e-1", defaults={"name": "E2E", "location": "here"})
            yield name
        finally:
            connections["default"].close()
            connections["default"] = test_connection
            settings_dict["NAME"] = saved
            ContentType.objects.clear_cache()
            if postgres:
                with test_connection._nodb_cursor() as cursor:
                    cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(autouse=True)
def agent_views_in_test_thread(monkeypatch):
    """Overrides the nodes conftest: here the agent views run their database work as in production,
    on the server's shared worker threads."""
    from nodes import agent_views

    monkeypatch.setattr(agent_views, "DB_THREAD_SENSITIVE", False)


@pytest.fixture(autouse=True)
def _no_scheduling_cycles(settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False  # scheduling's receivers run; no Celery task is queued


# --- the portal ----------------------------------------------------------------------------------------


class Portal:
    """uvicorn serving the portal's ASGI application in a thread; ``stop()``/``start()`` on one port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        from portal.asgi import application

        config = uvicorn.Config(
            application,
            host="127.0.0.1",
            port=self.port,
            loop="asyncio",
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="portal", daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 20, "the portal to start")
        assert self.server.started, "the portal did not start"

    def stop(self) -> None:
        if self.server is None or self.thread is None:
            return
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the portal did not stop"
        self.server = self.thread = None

    @property
    def running(self) -> bool:
        return self.server is not None


@pytest.fixture(scope="module")
def portal(e2e_database) -> Iterator[Portal]:
    server = Portal(free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def running_portal(portal: Portal) -> Portal:
    if not portal.running:  # a failed outage test must not take the others down with it
        portal.start()
    return portal


# --- the agent program ---------------------------------------------------------------------------------


class AgentProcess:
    """``python -m nodes.agent.cli run`` for one simulated node, with short intervals."""

    def __init__(
        self, portal: Portal, state_dir: Path, hostname: str, gpus: int, runtime: str = "simulated",
        extra_args: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.runtime = runtime
        self.extra_args = extra_args
        self.portal = portal
        self.state_dir = state_dir
        self.hostname = hostname
        self.gpus = gpus
        self.uuids = [simulated_gpu_uuid(hostname, i) for i in range(gpus)]
        self.token = bootstrap_token_create(region=Region.objects.get(code="e2e-1"), actor=Actor.system())[1]
        self.config = state_dir.parent / f"{hostname}.toml"
        self.config.write_text(
            "backoff_initial_s = 0.05\nbackoff_max_s = 0.5\nrequest_timeout_s = 5.0\n"
            "shutdown_flush_s = 2.0\nstop_grace_s = 1.0\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = state_dir.parent / f"{hostname}.log"
        self._log: Any = None

    def start(self) -> AgentProcess:
        assert self.proc is None
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop())
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GPUPOOL_ALLOW_INSECURE_HTTP": "1"}  # loopback
        env.pop("DJANGO_SETTINGS_MODULE", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nodes.agent.cli", "run", "--config", str(self.config),
             "--portal-url", self.portal.url, "--bootstrap-token", self.token,
             "--state-dir", str(self.state_dir), "--collector", "simulated", "--runtime", self.runtime,
             "--hostname", self.hostname, "--region", "e2e-1",
             "--sim-gpus", json.dumps([{"model": H100, "count": self.gpus}]),
             "--sample-interval", str(SAMPLE_INTERVAL_S), "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
             "--commands-wait", "2", "--log-level", "INFO", *self.extra_args],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        return self

    def stop(self) -> int:
        """SIGTERM, as systemd stops it; returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        self._log.close()
        return code

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self._log is not None:
            self._log.close()

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def node(self) -> Node | None:
        return Node.objects.filter(hostname=self.hostname).first()

    def credential(self) -> tuple[int, str]:
        data = json.loads((self.state_dir / "credential.json").read_text())
        return int(data["node_id"]), data["credential"]

    def _buffer(self, sql: str) -> Any:
        path = self.state_dir / "agent.sqlite3"
        if not path.exists():
            return None
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
            return db.execute(sql).fetchone()

    def buffered_heartbeats(self) -> int:
        row = self._buffer("SELECT count(*) FROM outbox WHERE kind = 'heartbeat'")
        return row[0] if row else 0

    def last_seq_built(self) -> int:
        row = self._buffer("SELECT value FROM kv WHERE key = 'seq'")
        return int(row[0]) if row else 0

    def a_buffered_batch(self) -> dict:
        row = self._buffer("SELECT body FROM outbox WHERE kind = 'heartbeat' ORDER BY id LIMIT 1")
        return json.loads(row[0])


@pytest.fixture
def start_agent(running_portal: Portal, tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    agents: list[AgentProcess] = []

    def start(hostname: str, gpus: int = 2, **options: Any) -> AgentProcess:
        agent = AgentProcess(running_portal, tmp_path / hostname, hostname, gpus, **options).start()
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.kill()


@pytest.fixture
def signals() -> Iterator[dict[str, list[dict]]]:
    """What the portal announced, as receivers connected the way scheduling connects them see it."""
    seen: dict[str, list[dict]] = {}
    receivers = []
    lock = threading.Lock()
    for name, sig in (
        ("command_finished", command_finished),
        ("workload_exited", workload_exited),
        ("gpu_unhealthy", gpu_unhealthy),
        ("node_down", node_down),
    ):
        seen[name] = []

        def receiver(sender, _name=name, **kwargs):
            with lock:
                seen[_name].append(kwargs)

        sig.connect(receiver, weak=False)
        receivers.append((sig, receiver))
    yield seen
    for sig, receiver in receivers:
        sig.disconnect(receiver)


# --- checks --------------------------------------------------------------------------------------------


def registered(agent: AgentProcess) -> Node:
    return wait_for(lambda: agent.node, what=f"{agent.hostname} to register")


def seqs(node: Node) -> list[int]:
    return list(HeartbeatBatch.objects.filter(node=node).order_by("seq").values_list("seq", flat=True))


def assert_stored_once_and_complete(node: Node, gpus: int) -> int:
    """Every batch 1..n is there once, no gap is open, and every reading of every batch is stored
    once (the rollups count each once too). Returns n."""
    stored = seqs(node)
    assert stored == list(range(1, len(stored) + 1)), f"batches not contiguous: {stored}"
    assert not SequenceGap.objects.filter(node=node).exists()
    sent = HeartbeatBatch.objects.filter(node=node).aggregate(n=Sum("sample_count"))["n"]
    samples = GpuSample.objects.filter(gpu__node=node)
    assert samples.count() == sent
    assert samples.values("gpu_id", "ts").annotate(n=Count("id")).filter(n__gt=1).count() == 0
    assert (
        samples.count()
        == GpuMinuteRollup.objects.filter(gpu__node=node).aggregate(n=Sum("sample_count"))["n"]
    )
    per_gpu = samples.values("gpu_id").annotate(n=Count("id")).values_list("n", flat=True)
    assert len(per_gpu) == gpus and len(set(per_gpu)) == 1, "every reading covers every GPU"
    return len(stored)


# --- the scenarios -------------------------------------------------------------------------------------


def test_register_heartbeats_and_a_command_end_to_end(start_agent, signals):
    agent = start_agent("e2e-basic", gpus=2)
    node = registered(agent)
    gpus = list(Gpu.objects.filter(node=node).order_by("index"))
    assert [g.uuid for g in gpus] == agent.uuids
    assert all(g.model is not None and g.model.name.startswith("NVIDIA H100") for g in gpus)
    assert node.region.code == "e2e-1" and node.simulated is False and node.state == NodeState.READY

    wait_for(lambda: len(seqs(node)) >= 3, what="three heartbeats")
    first = HeartbeatBatch.objects.get(node=node, seq=2)
    readings = first.sample_count // 2
    assert 3 <= readings <= 7, f"about {HEARTBEAT_INTERVAL_S / SAMPLE_INTERVAL_S:g} readings per batch"

    payload = {
        "workload_id": "900001",
        "image": "ghcr.io/acme/train:1",
        "command": ["python", "train.py"],
        "env": {"GPUPOOL_SIM_DURATION_S": "1.5", "GPUPOOL_SIM_EXIT_CODE": "3"},
        "gpu_uuids": [agent.uuids[0]],
        "gpu_fraction_milli": 1000,
    }
    enqueued = time.monotonic()
    command = node_command_enqueue(node=node, kind="start_workload", payload=payload)
    wait_for(
        lambda: NodeCommand.objects.get(pk=command.pk).state == "succeeded", what="the command to succeed"
    )
    assert time.monotonic() - enqueued < 5
    command.refresh_from_db()
    assert command.attempt == 1 and command.accepted_at is not None
    assert command.result == {"workload_id": "900001", "ref": "timer:900001"}
    history = list(NodeCommandEvent.objects.filter(command=command).values_list("event", "to_state"))
    assert history == [
        ("created", "pending"),
        ("delivered", "delivered"),
        ("accepted", "accepted"),
        ("succeeded", "succeeded"),
    ]
    wait_for(lambda: signals["command_finished"], what="command_finished")
    (finished,) = signals["command_finished"]
    assert finished["command"].pk == command.pk and finished["state"] == "succeeded"

    # The simulated workload runs on GPU 0 (its telemetry follows it), then exits with code 3.
    wait_for(lambda: signals["workload_exited"], what="workload_exited")
    (exited,) = signals["workload_exited"]
    assert exited["node"].pk == node.pk and exited["workload_id"] == "900001"
    assert (exited["state"], exited["exit_code"]) == ("failed", 3)
    status = NodeWorkloadStatus.objects.get(node=node, workload_id="900001")
    assert (status.state, status.exit_code) == ("failed", 3)
    busy = GpuSample.objects.filter(gpu=gpus[0], util_pct__gt=80)
    assert busy.exists() and busy.first().processes[0]["workload_id"] == "900001"
    assert not GpuSample.objects.filter(gpu=gpus[1], util_pct__gt=80).exists()

    # It is reported in a few more batches; the event fired once, the command ran once.
    last = max(seqs(node))
    wait_for(lambda: max(seqs(node)) >= last + 4, what="more heartbeats")
    assert len(signals["workload_exited"]) == 1 and len(signals["command_finished"]) == 1
    assert agent.log.count(f"command {command.pk}: start_workload") == 1
    assert agent.stop() == 0
    assert_stored_once_and_complete(node, gpus=2)
    assert Node.objects.get(pk=node.pk).last_seq == agent.last_seq_built()


def test_portal_outage_and_agent_restart_lose_nothing_and_double_nothing(start_agent, portal):
    agent = start_agent("e2e-outage", gpus=2)
    node = registered(agent)
    wait_for(lambda: len(seqs(node)) >= 3, what="heartbeats before the outage")

    portal.stop()
    wait_for(lambda: agent.buffered_heartbeats() >= 4, what="batches buffered on disk during the outage")
    replayed = agent.a_buffered_batch()  # sent again after the outage: must be a duplicate then
    # The agent restarts in the middle of the outage: its buffer survives.
    assert agent.stop() == 0
    kept = agent.buffered_heartbeats()
    assert kept >= 4 and kept == agent.last_seq_built() - seqs(node)[-1]  # all not stored is kept
    assert "kept in the buffer" in agent.log
    agent.start()
    wait_for(lambda: agent.buffered_heartbeats() >= kept + 3, what="more batches after the restart")
    assert seqs(node)[-1] < agent.last_seq_built()

    portal.start()
    wait_for(lambda: agent.buffered_heartbeats() == 0, what="the buffer to drain")
    wait_for(lambda: len(seqs(node)) >= agent.last_seq_built(), what="every batch")
    assert agent.stop() == 0
    n = assert_stored_once_and_complete(node, gpus=2)
    assert n == agent.last_seq_built() == Node.objects.get(pk=node.pk).last_seq
    # They arrived in order (the buffer sends oldest first), none taken for a late batch.
    arrival = list(
        HeartbeatBatch.objects.filter(node=node).order_by("received_at", "id").values_list("seq", flat=True)
    )
    assert arrival == sorted(arrival)
    assert not HeartbeatBatch.objects.filter(node=node, out_of_order=True).exists()
    assert Node.objects.get(pk=node.pk).state == NodeState.READY

    # The exact batch the agent had buffered, sent again over HTTP: a duplicate that writes nothing.
    node_id, credential = agent.credential()
    samples_before = GpuSample.objects.filter(gpu__node=node).count()
    response = httpx.post(
        f"{portal.url}/agent/v1/nodes/{node_id}/heartbeat",
        json=replayed,
        headers={"Authorization": f"Node {credential}"},
    )
    assert response.status_code == 200 and response.json()["status"] == "duplicate"
    assert GpuSample.objects.filter(gpu__node=node).count() == samples_before
    assert len(seqs(node)) == n


def test_duplicate_and_out_of_order_batches_over_http(start_agent, running_portal):
    agent = start_agent("e2e-order", gpus=2)
    node = registered(agent)
    wait_for(lambda: len(seqs(node)) >= 2, what="heartbeats")
    assert agent.stop() == 0
    node.refresh_from_db()
    n = node.last_seq
    node_id, credential = agent.credential()
    now = datetime.now(UTC)

    def batch(seq: int, ts: datetime, util: float) -> dict:
        stamp = ts.isoformat().replace("+00:00", "Z")
        samples = [
            {
                "gpu_uuid": u,
                "ts": stamp,
                "util_pct": util,
                "mem_used_mib": 1024,
                "power_w": 200.0,
                "temp_c": 55,
            }
            for u in agent.uuids
        ]
        return {"seq": seq, "sent_at": stamp, "status": {"agent_version": "e2e"}, "samples": samples}

    with httpx.Client(base_url=running_portal.url, headers={"Authorization": f"Node {credential}"}) as http:

        def post(body: dict) -> dict:
            response = http.post(f"/agent/v1/nodes/{node_id}/heartbeat", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        def counts() -> tuple[int, int, int]:
            return (
                HeartbeatBatch.objects.filter(node=node).count(),
                GpuSample.objects.filter(gpu__node=node).count(),
                GpuMinuteRollup.objects.filter(gpu__node=node).aggregate(n=Sum("sample_count"))["n"],
            )

        before = counts()
        assert post(batch(n, now, 11.0))["status"] == "duplicate"  # a seq the agent sent already
        assert counts() == before

        ahead = post(batch(n + 2, now, 90.0))  # n + 1 has not come (yet)
        assert (ahead["status"], ahead["gap"]) == ("accepted", [n + 1, n + 1])
        assert list(SequenceGap.objects.filter(node=node).values_list("first_seq", "last_seq")) == [
            (n + 1, n + 1)
        ]
        assert post(batch(n + 2, now, 90.0))["status"] == "duplicate"

        late = post(batch(n + 1, now - timedelta(seconds=1), 5.0))
        assert (late["status"], late["gap"]) == ("accepted", None)
        assert not SequenceGap.objects.filter(node=node).exists()  # the gap is filled
        assert HeartbeatBatch.objects.get(node=node, seq=n + 1).out_of_order
        assert counts() == (before[0] + 2, before[1] + 4, before[2] + 4)
        node.refresh_from_db()
        assert node.last_seq == n + 2
        assert Gpu.objects.get(uuid=agent.uuids[0]).last_util_pct == 90.0  # the late batch is older

        wrong = http.post(
            f"/agent/v1/nodes/{node_id}/heartbeat",
            json=batch(n + 3, now, 1.0),
            headers={"Authorization": f"Node {credential[:-2]}xx"},
        )
        assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"].startswith("Node")
    assert seqs(node) == list(range(1, n + 3))


def test_gpu_faults_isolate_the_gpu_and_are_announced(start_agent, signals):
    agent = start_agent("e2e-faults", gpus=4)
    node = registered(agent)
    wait_for(lambda: len(seqs(node)) >= 2, what="heartbeats")
    faults = [
        {"gpu": 0, "kind": "dbe"},
        {"gpu": 1, "kind": "xid", "xid": 48},
        {"gpu": 2, "kind": "fell_off_bus"},
    ]
    (agent.state_dir / "faults.json").write_text(json.dumps(faults))  # read by the next sample

    wait_for(lambda: len(signals["gpu_unhealthy"]) >= 3, what="three gpu_unhealthy signals")
    gpus = {g.index: g for g in Gpu.objects.filter(node=node)}
    for index in (0, 1, 2):
        assert gpus[index].health == GpuHealth.UNHEALTHY and gpus[index].isolated, index
        assert not gpus[index].schedulable
    assert gpus[3].health == GpuHealth.HEALTHY and not gpus[3].isolated
    assert "double-bit ECC" in gpus[0].health_reason and gpus[0].ecc_dbe_total == 1
    assert gpus[1].health_reason.startswith("XID 48") and gpus[1].last_xid == 48
    assert "XID 79" in gpus[2].health_reason  # what NVML reports for a GPU lost from the bus
    announced = {s["gpu"].index: s for s in signals["gpu_unhealthy"]}
    assert sorted(announced) == [0, 1, 2] and all(s["node"].pk == node.pk for s in announced.values())
    # The lost GPU's gauges are unknown, stored as NULL (not 0) and left out of the rollups.
    lost = GpuSample.objects.filter(
        gpu=gpus[2], util_pct__isnull=True, power_w__isnull=True, temp_c__isnull=True
    )
    assert lost.exists()
    assert gpus[2].last_util_pct is None and gpus[2].last_power_w is None
    assert len(signals["gpu_unhealthy"]) == 3  # once each, though every later sample shows it
    assert agent.stop() == 0


def test_missed_heartbeats_make_a_node_suspect_then_down(start_agent, signals, settings):
    settings.NODE_MASS_SILENCE_MIN_NODES = 10_000  # the other tests' silent nodes: no mass-silence guard
    agent = start_agent("e2e-silent", gpus=1)
    node = registered(agent)
    wait_for(lambda: len(seqs(node)) >= 2, what="heartbeats")
    assert agent.stop() == 0
    node.refresh_from_db()
    last = node.last_heartbeat_at
    assert last is not None and node.state == NodeState.READY

    early = node_health_reconcile(now=last + timedelta(seconds=settings.NODE_SUSPECT_AFTER_S - 1))
    assert node.pk not in early.suspect + early.down
    suspect = node_health_reconcile(now=last + timedelta(seconds=settings.NODE_SUSPECT_AFTER_S + 1))
    assert node.pk in suspect.suspect
    assert Node.objects.get(pk=node.pk).state == NodeState.SUSPECT
    assert signals["node_down"] == []
    down = node_health_reconcile(now=last + timedelta(seconds=settings.NODE_DOWN_AFTER_S + 1))
    assert node.pk in down.down
    node.refresh_from_db()
    assert node.state == NodeState.DOWN and "No heartbeat since" in node.state_reason
    mine = [s for s in signals["node_down"] if s["node"].pk == node.pk]
    assert len(mine) == 1 and mine[0]["last_heartbeat_at"] == last

    # The agent comes back: its next heartbeat makes the node READY again.
    agent.start()
    wait_for(lambda: Node.objects.get(pk=node.pk).state == NodeState.READY, what="the node to be READY")
    assert Node.objects.get(pk=node.pk).state_reason == "Heartbeats resumed."
    assert agent.stop() == 0
    assert_stored_once_and_complete(node, gpus=1)
    assert django_settings.NODE_DOWN_AFTER_S > django_settings.NODE_SUSPECT_AFTER_S


def test_heartbeats_keep_the_driver_versions_current(start_agent):
    """The versions the node held (an old registration's, before a driver upgrade) are replaced by
    what the real agent's heartbeats carry, GPU firmware included."""
    agent = start_agent("e2e-versions", gpus=2)
    node = registered(agent)
    wait_for(lambda: len(seqs(node)) >= 1, what="a heartbeat")
    Node.objects.filter(pk=node.pk).update(driver_version="535.0", cuda_version="12.2", versions_digest="")
    Gpu.objects.filter(node=node).update(firmware_version="old")

    def current() -> bool:
        n = Node.objects.get(pk=node.pk)
        firmware = set(Gpu.objects.filter(node=node).values_list("firmware_version", flat=True))
        return (n.driver_version, n.cuda_version, firmware) == ("560.35.03", "12.6", {SIMULATED_FIRMWARE})

    wait_for(current, what="the heartbeat's versions")
    assert agent.stop() == 0
