"""End to end through the real portal (uvicorn, in a thread) and the real agent program (a process,
with the subprocess runtime): an instance launched through the API with a command of its own runs
that command on the node, and the tenant reads its output through the logs API."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.test import Client

from nodes.models import NodeState
from portal.actors import Actor
from portal.services.tenants import tenant_create
from portal.services.tokens import api_token_create
from scheduling.models import Workload, WorkloadState
from scheduling.services.cycle import scheduling_cycle_run
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    H100,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    running_portal,
    wait_for,
)
from tests.scheduling.test_config_e2e import ProcessAgent

pytestmark = pytest.mark.slow


@pytest.fixture
def agent(running_portal, tmp_path: Path) -> Iterator[ProcessAgent]:  # noqa: F811
    made = ProcessAgent(running_portal, tmp_path / "cmd-node", "cmd-node", 1).start()
    yield made
    made.kill()
    shutil.rmtree(made.work_dir, ignore_errors=True)


def test_an_instances_own_command_runs_on_the_node(agent, settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False
    wait_for(lambda: (n := agent.node) is not None and n.state == NodeState.READY and n, 30, "the node")
    tenant = tenant_create(slug="cmd-e2e", name="Cmd E2E", owner_email="o@cmd.test", actor=Actor.system())
    _, token = api_token_create(tenant=tenant, name="e2e", scopes=["read", "write"], actor=Actor.system())
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    marker = "instance says: $(not a shell) 'quoted'"
    r = api.post(
        "/api/v1/instances/",
        {
            "gpu_models": [H100],
            "image": "ghcr.io/acme/host:1",
            # It prints its argument, then stays up as an instance does.
            "command": ["/bin/sh", "-c", 'printf "%s\\n" "$1"; exec sleep 600', "sh", marker],
        },
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    wid = r.json()["id"]
    assert scheduling_cycle_run().placed == [wid]
    wait_for(lambda: Workload.objects.get(pk=wid).state == WorkloadState.RUNNING, 60, "the instance to run")
    lines = wait_for(
        lambda: api.get(f"/api/v1/instances/{wid}/logs/").json()["lines"], 30, "the instance's output"
    )
    assert [line["text"] for line in lines] == [marker], agent.log[-2000:]
    assert api.post(f"/api/v1/instances/{wid}/stop/").status_code in (200, 202)
    wait_for(
        lambda: Workload.objects.get(pk=wid).state in (WorkloadState.STOPPED, WorkloadState.SUCCEEDED),
        60,
        "the instance to stop",
    )
