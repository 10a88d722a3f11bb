from __future__ import annotations

import itertools
import json
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from asgiref.sync import async_to_sync
from django.core.handlers.asgi import ASGIHandler
from django.utils import timezone

from nodes.agent_views import AgentProtocolHandler
from nodes.models import Gpu, GpuModel, Node, Region
from nodes.services.registration import bootstrap_token_create
from portal.actors import Actor
from tests.conftest import keeping_the_test_connection
from tests.slurm_cluster import slurm_cluster  # noqa: F401  (the real Slurm, for Slurm regions)

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


def django_handler_in_test():
    """Django's ASGI handler, leaving the test's database connection open (``keeping_the_test_connection``)."""
    handler = ASGIHandler()

    async def app(scope, receive, send):
        with keeping_the_test_connection():
            await handler(scope, receive, send)

    return app


async def agent_arequest(
    method: str, path: str, *, content: bytes | str | None = None, params=None, headers=None
) -> httpx.Response:
    """One request to the agent protocol's route as portal/asgi.py makes it: ``AgentProtocolHandler``
    in front of Django's ASGI handler (built per request, so that it reads the test's settings)."""
    transport = httpx.ASGITransport(app=AgentProtocolHandler(fallback=django_handler_in_test()))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        return await client.request(method, path, content=content, params=params, headers=headers)


def agent_request(method: str, path: str, **kwargs) -> httpx.Response:
    """``agent_arequest`` from sync code: through async_to_sync, so the views' thread-sensitive
    database work (``DB_THREAD_SENSITIVE``) runs in the calling thread, on its connection."""
    return async_to_sync(agent_arequest)(method, path, **kwargs)


class Agent:
    """A node's side of the protocol, over the agent protocol's real route (``agent_request``)."""

    def __init__(self, node_id: int, credential: str, uuids: list[str]):
        self.node_id = node_id
        self.credential = credential
        self.uuids = uuids
        self.seq = 0

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Node {self.credential}", "Content-Type": "application/json"}

    def request(self, method: str, path: str, content: bytes | str | None = None, params=None):
        return agent_request(method, path, content=content, params=params, headers=self.headers())

    async def arequest(self, method: str, path: str, content: bytes | str | None = None, params=None):
        return await agent_arequest(method, path, content=content, params=params, headers=self.headers())

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
        content = raw if raw is not None else json.dumps(body)
        return self.request("POST", self.url("heartbeat", node_id), content)

    def poll(self, wait: float = 0, node_id: int | None = None):
        return self.request("GET", self.url("commands", node_id), params={"wait": wait})

    def report(self, command_id, status: str, result=None, node_id: int | None = None):
        body = {"status": status, "result": result or {}, "message": "", "at": iso(datetime.now(UTC))}
        return self.request("POST", self.url(f"commands/{command_id}/report", node_id), json.dumps(body))


def agent_register(body: dict) -> Agent:
    """Registers over the agent protocol's route (Django's handler, behind AgentProtocolHandler)."""
    response = agent_request(
        "POST", "/agent/v1/register", content=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 201, response.content
    data = response.json()
    return Agent(data["node_id"], data["credential"], [gpu["uuid"] for gpu in body["gpus"]])


@pytest.fixture
def register_node(make_bootstrap_token):
    def register(hostname: str | None = None, *, gpus: int = 2, name: str = "NVIDIA H100 80GB HBM3") -> Agent:
        hostname = hostname or f"gpu-{next(_counter):04d}"
        token = make_bootstrap_token()
        return agent_register(registration_body(token, hostname, gpus=gpus, name=name))

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
    """Agent requests must use the test's database connection (its transaction): the views'
    database work runs in the test's thread."""
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


@pytest.fixture
def make_nodes(db):
    """``make_nodes(n, region=, model=, labels=)``: READY nodes with one catalog GPU each."""

    def make(
        count: int, *, region: str = "us-east-1", model: str = "NVIDIA H100 SXM 80GB", labels=None
    ) -> list[Node]:
        r, _ = Region.objects.get_or_create(code=region, defaults={"name": region})
        gm = GpuModel.objects.get(name=model)
        nodes = []
        for _ in range(count):
            node = Node.objects.create(
                hostname=f"node-{next(_counter):04d}", region=r, labels=labels or {},
                last_heartbeat_at=timezone.now(),
            )  # fmt: skip
            Gpu.objects.create(
                node=node, index=0, uuid=f"GPU-{uuid.uuid4()}", model=gm, reported_name=gm.name
            )
            nodes.append(node)
        return nodes

    return make
