"""``gpupool logs -f`` on the portal's ASGI server (uvicorn in a thread, as in production): it
reads the event stream, prints the backlog and a line stored while it follows, and returns once
the job has ended and the stream has gone quiet."""

from __future__ import annotations

import json
import threading
import time

import pytest
from django.db import connections

from portal.actors import Actor
from portal.services.tenants import tenant_create
from portal.services.tokens import api_token_create
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.lifecycle import workload_on_exited
from scheduling.services.submission import workload_submit
from tests.client.conftest import Cli
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    agent_views_in_test_thread,
    e2e_database,
    portal,
    running_portal,
    wait_for,
)
from tests.scheduling.logs_fixtures import H100, batch, register_node

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _short_keepalive(settings):
    settings.WORKLOAD_LOG_FOLLOW_KEEPALIVE_S = 0.3


def test_logs_follow_reads_the_stream_until_the_job_ends(running_portal, monkeypatch, tmp_path):  # noqa: F811
    tenant = tenant_create(slug="follow", name="Follow", owner_email="o@follow.test", actor=Actor.system())
    token = api_token_create(tenant=tenant, name="r", scopes=["read"], actor=Actor.system())[1]
    node = register_node()
    spec = {"image": "ghcr.io/acme/train:1", "command": ["python", "t.py"], "gpu_models": [H100]}
    job = workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())
    assert scheduling_cycle_run().ran
    now = time.time()
    assert (
        node.send(batch(1, job, [[now, "stdout", "one"], [now + 0.001, "stderr", "two"]])).status_code == 200
    )

    gp = Cli(running_portal.url, token, monkeypatch, tmp_path / "config")
    result = {}
    follower = threading.Thread(target=lambda: result.update(r=gp("--json", "logs", "-f", job.pk)))
    follower.start()
    time.sleep(1.0)  # the stream is open and has sent the backlog
    assert follower.is_alive()  # following: it does not return while the job runs
    assert node.send(batch(2, job, [[time.time(), "stdout", "three"]])).status_code == 200
    time.sleep(0.5)
    workload_on_exited(node_id=node.node.pk, workload_id=job.pk, state="exited", exit_code=0)
    follower.join(20)
    connections.close_all()
    assert not follower.is_alive()
    lines = [json.loads(x) for x in result["r"].stdout.splitlines()]
    assert [(x["stream"], x["text"]) for x in lines] == [
        ("stdout", "one"),
        ("stderr", "two"),
        ("stdout", "three"),
    ]


def test_the_async_client_follows_the_stream(running_portal, tmp_path):  # noqa: F811
    import asyncio

    from gpupool import AsyncClient

    tenant = tenant_create(slug="afollow", name="Async", owner_email="o@afollow.test", actor=Actor.system())
    token = api_token_create(tenant=tenant, name="r", scopes=["read"], actor=Actor.system())[1]
    node = register_node()
    spec = {"image": "ghcr.io/acme/train:1", "command": ["python", "t.py"], "gpu_models": [H100]}
    job = workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())
    assert scheduling_cycle_run().ran
    assert node.send(batch(1, job, [[time.time(), "stdout", "one"]])).status_code == 200
    got: list[str] = []

    async def follow():
        async with AsyncClient(running_portal.url, token) as c:
            async for line in c.follow_logs("job", job.pk):
                got.append(line["text"])

    follower = threading.Thread(target=lambda: asyncio.run(follow()))
    follower.start()
    wait_for(lambda: got == ["one"], timeout=10)
    assert follower.is_alive()  # following: it does not return while the job runs
    assert node.send(batch(2, job, [[time.time(), "stdout", "two"]])).status_code == 200
    wait_for(lambda: got == ["one", "two"], timeout=10)
    workload_on_exited(node_id=node.node.pk, workload_id=job.pk, state="exited", exit_code=0)
    follower.join(20)
    connections.close_all()
    assert not follower.is_alive() and got == ["one", "two"]
