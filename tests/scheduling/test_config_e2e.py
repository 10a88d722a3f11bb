"""End to end through the real portal (uvicorn, in a thread) and the real agent program (a process,
with the subprocess runtime): a job launched from a tenant's template with a secret in its env
prints its env, and the tenant reads it back in the job's reported output. The secret's value
travels only in the start command's delivery over HTTP; the rows keep the reference."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.test import Client

from nodes.models import CommandKind, NodeCommand, NodeState
from portal.actors import Actor
from portal.services.secrets import secret_create
from portal.services.tenants import tenant_create
from portal.services.tokens import api_token_create
from scheduling.models import Workload, WorkloadState
from scheduling.services.cycle import scheduling_cycle_run
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    H100,
    ROOT,
    AgentProcess,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    running_portal,
    wait_for,
)

pytestmark = pytest.mark.slow

SECRET = "s3cret value;$(id)"  # byte for byte, never through a shell
SCRIPT = 'printf "<%s>" "$PLAIN" "$TOKEN" "$FROM_TEMPLATE"; exit 3'


class ProcessAgent(AgentProcess):
    """The agent program on a single-tenant node: workloads are host processes (as ``nobody``
    when the tests run as root), in a working directory ``nobody`` can enter."""

    def start(self) -> ProcessAgent:
        assert self.proc is None
        self.work_dir = tempfile.mkdtemp(prefix="gpupool-e2e-process-")
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop())
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "GPUPOOL_ALLOW_INSECURE_HTTP": "1",  # loopback
            "GPUPOOL_SINGLE_TENANT": "1",
            "GPUPOOL_PROCESS_USER": "nobody" if os.geteuid() == 0 else "",
            "GPUPOOL_PROCESS_WORK_DIR": self.work_dir,
        }
        env.pop("DJANGO_SETTINGS_MODULE", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nodes.agent.cli", "run", "--config", str(self.config),
             "--portal-url", self.portal.url, "--bootstrap-token", self.token,
             "--state-dir", str(self.state_dir), "--collector", "simulated", "--runtime", "subprocess",
             "--hostname", self.hostname, "--region", "e2e-1",
             "--sim-gpus", json.dumps([{"model": H100, "count": self.gpus}]),
             "--sample-interval", "0.1", "--heartbeat-interval", "0.3",
             "--commands-wait", "2", "--log-level", "INFO"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        return self


@pytest.fixture
def agent(running_portal, tmp_path: Path) -> Iterator[ProcessAgent]:  # noqa: F811
    made = ProcessAgent(running_portal, tmp_path / "cfg-node", "cfg-node", 1).start()
    yield made
    made.kill()
    shutil.rmtree(made.work_dir, ignore_errors=True)


def test_a_secret_in_a_templated_jobs_env_reaches_its_process(agent, settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False
    node = wait_for(
        lambda: (n := agent.node) is not None and n.state == NodeState.READY and n, 30, "the node"
    )
    system = Actor.system()
    tenant = tenant_create(slug="cfg-e2e", name="Config E2E", owner_email="o@cfg.test", actor=system)
    _, token = api_token_create(tenant=tenant, name="e2e", scopes=["read", "write"], actor=system)
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    secret_create(tenant=tenant, name="token", value=SECRET, actor=system)
    r = api.post(
        "/api/v1/templates/",
        {"name": "printer", "image": "ghcr.io/acme/printer:1", "command": ["/bin/sh", "-c", SCRIPT],
         "env": {"FROM_TEMPLATE": "t"}},
        content_type="application/json",
    )  # fmt: skip
    assert r.status_code == 201, r.content
    r = api.post(
        "/api/v1/jobs/",
        {"gpu_models": [H100], "template": "printer", "env": {"PLAIN": "a b", "TOKEN": {"secret": "token"}}},
        content_type="application/json",
    )
    assert r.status_code == 201, r.content
    job_id = r.json()["id"]

    assert scheduling_cycle_run().placed == [job_id]
    job = wait_for(
        lambda: (
            (w := Workload.objects.get(pk=job_id)).state in (WorkloadState.FAILED, WorkloadState.SUCCEEDED)
            and w
        ),
        60,
        "the job to end",
    )
    assert (job.state, job.exit_code) == (WorkloadState.FAILED, 3), agent.log[-3000:]
    assert job.log_tail == f"<a b><{SECRET}><t>"  # the agent's last message: the job's output
    lines = wait_for(
        lambda: api.get(f"/api/v1/jobs/{job_id}/logs/").json()["lines"], 30, "the job's output in its logs"
    )
    assert [line["text"] for line in lines] == [f"<a b><{SECRET}><t>"]
    # Stored: the reference, in the job and in its start command.
    assert job.env == {"FROM_TEMPLATE": "t", "PLAIN": "a b", "TOKEN": {"secret": "token"}}
    start = NodeCommand.objects.get(node=node, kind=CommandKind.START_WORKLOAD)
    assert start.payload["env"]["TOKEN"] == {"secret": "token"} and SECRET not in str(start.payload)
