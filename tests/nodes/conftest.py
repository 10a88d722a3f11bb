from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client

from nodes.models import Node, Region
from nodes.services.registration import bootstrap_token_create
from portal.actors import Actor

_counter = itertools.count(1)


def iso(dt: datetime) -> str:
    return dt.astimezone(UTC).isoformat().replace("+00:00", "Z")


@pytest.fixture
def region(db) -> Region:
    return Region.objects.get_or_create(
        code="us-east-1", defaults={"name": "US East", "location": "Ashburn"}
    )[0]


@pytest.fixture
def make_bootstrap_token(region):
    def make(**kwargs) -> str:
        kwargs.setdefault("region", region)
        return bootstrap_token_create(actor=Actor.system(), **kwargs)[1]

    return make


def registration_body(
    token: str, hostname: str, *, gpus: int = 2, name: str = "NVIDIA H100 80GB HBM3", **extra
):
    body = {
        "bootstrap_token": token,
        "hostname": hostname,
        "labels": {"rack": "r1"},
        "cpu_cores": 96,
        "ram_mib": 1048576,
        "driver_version": "560.35.03",
        "cuda_version": "12.6",
        "agent_version": "0.1.0",
        "interconnect": "nvswitch",
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{hostname}-{i}",
                "name": name,
                "memory_mib": 81559,
                "pci_bus_id": f"0000:{i:02x}:00.0",
                "nvlink_island": 0,
                "numa_node": i % 2,
                "mig_mode": False,
            }
            for i in range(gpus)
        ],
    }
    body.update(extra)
    return body


class Agent:
    """A node's side of the protocol over the Django test client (the real views and middleware)."""

    def __init__(self, node_id: int, credential: str, uuids: list[str]):
        self.node_id = node_id
        self.credential = credential
        self.uuids = uuids
        self.client = Client(HTTP_AUTHORIZATION=f"Node {credential}")
        self.seq = 0

    @property
    def node(self) -> Node:
        return Node.objects.get(pk=self.node_id)

    def url(self, suffix: str, node_id: int | None = None) -> str:
        return f"/agent/v1/nodes/{node_id or self.node_id}/{suffix}"

    def sample(self, uuid: str, ts: datetime, **overrides):
        s = {
            "gpu_uuid": uuid,
            "ts": iso(ts),
            "util_pct": 50.0,
            "mem_used_mib": 1000,
            "power_w": 300.5,
            "temp_c": 60,
            "sm_clock_mhz": 1980,
            "ecc_sbe": 0,
            "ecc_dbe": 0,
            "xid_errors": [],
            "throttle_reasons": 0,
            "retired_pages_pending": False,
            "row_remap_failure": False,
            "fell_off_bus": False,
            "processes": [{"pid": 42, "used_mib": 900, "workload_id": "w1"}],
        }
        s.update(overrides)
        return s

    def batch(self, seq: int | None = None, *, ts: datetime | None = None, samples=None, workloads=None):
        if seq is None:
            self.seq += 1
            seq = self.seq
        ts = ts or datetime.now(UTC)
        if samples is None:
            samples = [self.sample(u, ts) for u in self.uuids]
        return {
            "seq": seq,
            "sent_at": iso(ts),
            "status": {"uptime_s": 100, "load_1m": 1.5, "agent_version": "0.1.0", "draining": False},
            "samples": samples,
            "workloads": workloads or [],
        }

    def heartbeat(self, body, node_id: int | None = None, raw: bytes | None = None):
        return self.client.post(
            self.url("heartbeat", node_id),
            data=raw if raw is not None else json.dumps(body),
            content_type="application/json",
        )

    def poll(self, wait: float = 0, node_id: int | None = None):
        return self.client.get(self.url("commands", node_id), {"wait": wait})

    def report(self, command_id, status: str, result=None, node_id: int | None = None):
        return self.client.post(
            self.url(f"commands/{command_id}/report", node_id),
            data=json.dumps(
                {"status": status, "result": result or {}, "message": "", "at": iso(datetime.now(UTC))}
            ),
            content_type="application/json",
        )


@pytest.fixture
def register_node(make_bootstrap_token, client):
    def register(hostname: str | None = None, *, gpus: int = 2, name: str = "NVIDIA H100 80GB HBM3") -> Agent:
        hostname = hostname or f"gpu-{next(_counter):04d}"
        token = make_bootstrap_token()
        response = client.post(
            "/agent/v1/register",
            data=json.dumps(registration_body(token, hostname, gpus=gpus, name=name)),
            content_type="application/json",
        )
        assert response.status_code == 201, response.content
        data = response.json()
        return Agent(data["node_id"], data["credential"], [f"GPU-{hostname}-{i}" for i in range(gpus)])

    return register


@pytest.fixture
def agent(register_node) -> Agent:
    return register_node()


@pytest.fixture
def capture_signal():
    """``with capture_signal(sig) as calls:`` records each send's kwargs."""
    from contextlib import contextmanager

    @contextmanager
    def capture(signal):
        calls: list[dict] = []

        def receiver(sender, **kwargs):
            calls.append({"sender": sender, **kwargs})

        signal.connect(receiver, weak=False)
        try:
            yield calls
        finally:
            signal.disconnect(receiver)

    return capture


def minutes_ago(n: float) -> datetime:
    return datetime.now(UTC) - timedelta(minutes=n)


@pytest.fixture(autouse=True)
def agent_views_in_test_thread(monkeypatch):
    """The test client's requests must use the test's database connection (its transaction)."""
    from nodes import agent_views

    monkeypatch.setattr(agent_views, "DB_THREAD_SENSITIVE", True)


@pytest.fixture(autouse=True)
def _no_reaper():
    """These tests drive agents with commands of workloads the portal never placed (the protocol
    alone); scheduling's reaper would stop them. It has its own tests in tests/scheduling."""
    from nodes.signals import workloads_reported
    from scheduling import receivers

    uid = "scheduling.workloads_reported"
    workloads_reported.disconnect(dispatch_uid=uid)
    yield
    workloads_reported.connect(receivers.on_workloads_reported, dispatch_uid=uid)
