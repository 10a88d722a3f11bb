"""End to end: the real agent program (``python -m nodes.agent.cli run``, the process runtime) runs a
job that prints lines; the lines come back through the real portal (uvicorn serving
``portal.asgi`` in a thread): ``GET .../logs/`` and a ``?follow=1`` stream over real HTTP that
receives a line the running job writes after the stream opened. Fixtures from
``tests.nodes.test_e2e_agent``."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from django.conf import settings as django_settings
from django.test import Client

from nodes.models import Gpu
from portal.actors import Actor
from portal.models import Membership
from portal.services.tenants import tenant_create
from portal.services.tokens import api_token_create
from scheduling.models import Workload
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.submission import workload_submit
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    H100,
    ROOT,
    SAMPLE_INTERVAL_S,
    AgentProcess,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    wait_for,
)

pytestmark = pytest.mark.slow


class ProcessAgent(AgentProcess):
    """The agent with the process runtime on a single-tenant node (workloads as ``nobody`` when the
    tests run as root), reading output every 0.1 s."""

    def start(self) -> ProcessAgent:
        work_dir = tempfile.mkdtemp(prefix="gpupool-logs-e2e-")
        self.work_dir = work_dir
        user = "nobody" if os.geteuid() == 0 else ""
        self.config.write_text(
            "backoff_initial_s = 0.05\nbackoff_max_s = 0.5\nrequest_timeout_s = 5.0\n"
            "shutdown_flush_s = 2.0\nstop_grace_s = 1.0\nsingle_tenant = true\n"
            f'process_user = "{user}"\nprocess_work_dir = "{work_dir}"\nworkload_log_interval_s = 0.1\n'
        )
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in kill())
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GPUPOOL_ALLOW_INSECURE_HTTP": "1"}
        env.pop("DJANGO_SETTINGS_MODULE", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nodes.agent.cli", "run", "--config", str(self.config),
             "--portal-url", self.portal.url, "--bootstrap-token", self.token,
             "--state-dir", str(self.state_dir), "--collector", "simulated", "--runtime", "subprocess",
             "--hostname", self.hostname, "--region", "e2e-1",
             "--sim-gpus", json.dumps([{"model": H100, "count": self.gpus}]),
             "--sample-interval", str(SAMPLE_INTERVAL_S), "--heartbeat-interval", "0.5",
             "--commands-wait", "2", "--log-level", "INFO"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        return self


@pytest.fixture
def process_agent(running_portal, tmp_path):  # noqa: F811
    agent = ProcessAgent(running_portal, tmp_path / "logs-node", "logs-node", 1).start()
    yield agent
    agent.kill()
    shutil.rmtree(agent.work_dir, ignore_errors=True)


def state(job: Workload) -> str:
    return Workload.objects.get(pk=job.pk).state


def follow(url: str, token: str, into: queue.Queue, stop: threading.Event) -> None:
    """Read the event stream; put each line's data (and its arrival time) on ``into``; hang up
    at the first event or keepalive after ``stop``."""
    with (
        httpx.Client(timeout=httpx.Timeout(5, read=30)) as client,
        client.stream("GET", url, headers={"Authorization": f"Bearer {token}"}) as response,
    ):
        into.put(("status", response.status_code, response.headers.get("content-type")))
        for raw in response.iter_lines():
            if raw.startswith("data: "):
                into.put(("line", json.loads(raw[6:]), time.monotonic()))
            if stop.is_set():
                return


@pytest.fixture(autouse=True)
def _short_keepalive(settings):
    settings.WORKLOAD_LOG_FOLLOW_KEEPALIVE_S = 0.5


def test_a_jobs_output_comes_back_through_the_api_and_a_follow_stream(process_agent, running_portal):  # noqa: F811
    node = registered(process_agent)
    model = Gpu.objects.get(node=node).model
    wait_for(lambda: node.__class__.objects.get(pk=node.pk).state == "ready", what="the node to be ready")
    tenant = tenant_create(slug="logs", name="Logs", owner_email="o@logs.test", actor=Actor.system())
    reader = api_token_create(tenant=tenant, name="r", scopes=["read"], actor=Actor.system())[1]
    other = tenant_create(slug="other", name="Other", owner_email="o@other.test", actor=Actor.system())
    stranger = api_token_create(tenant=other, name="s", scopes=["read"], actor=Actor.system())[1]

    # It prints three lines and one on stderr, waits for a file the test makes, prints one more.
    script = (
        "for i in 1 2 3; do echo line $i; done; echo warn >&2; "
        'while [ ! -e "$HOME/go" ]; do sleep 0.05; done; echo after the stream opened; sleep 1'
    )
    spec = {"image": "ghcr.io/acme/train:1", "command": ["/bin/sh", "-c", script], "gpu_models": [model.name]}
    job = workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())
    assert scheduling_cycle_run().ran
    wait_for(lambda: state(job) == S.RUNNING, what="the job to run")

    url = f"{running_portal.url}/api/v1/jobs/{job.pk}/logs/"
    auth = {"Authorization": f"Bearer {reader}"}

    def lines():
        response = httpx.get(url, headers=auth, params={"tail": 100})
        assert response.status_code == 200, response.text
        return response.json()["lines"]

    got = wait_for(lambda: len(lines()) == 4 and lines(), what="four lines through GET logs")
    assert sorted((line["stream"], line["text"]) for line in got) == [
        ("stderr", "warn"), ("stdout", "line 1"), ("stdout", "line 2"), ("stdout", "line 3"),
    ]  # fmt: skip
    assert all(line["at"].endswith("Z") for line in got)

    # The follow stream: another tenant's token gets 404 (the owner's 200 is below), none gets 401.
    assert (
        httpx.get(url, params={"follow": 1}, headers={"Authorization": f"Bearer {stranger}"}).status_code
        == 404
    )
    assert httpx.get(url, params={"follow": 1}).status_code == 401
    assert httpx.get(url, params={"follow": 1, "tail": 0}, headers=auth).status_code == 400

    events: queue.Queue = queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(
        target=follow, args=(f"{url}?follow=1&tail=2", reader, events, stop), daemon=True
    )
    thread.start()
    assert events.get(timeout=10) == ("status", 200, "text/event-stream; charset=utf-8")
    backlog = [events.get(timeout=10)[1] for _ in range(2)]
    assert backlog == got[-2:]  # the last two stored lines first
    home = f"{process_agent.work_dir}/{job.pk}/home"
    subprocess.run(["/bin/sh", "-c", f"touch {home}/go"], check=True)
    kind, line, _ = events.get(timeout=15)
    assert kind == "line" and line == {**line, "stream": "stdout", "text": "after the stream opened"}
    stop.set()  # the client hangs up at the next keepalive
    thread.join(10)
    assert not thread.is_alive()

    # A member's browser session follows too (the page's EventSource does).
    owner = Membership.objects.get(tenant=tenant).user
    browser = Client()
    browser.force_login(owner)
    cookie = {django_settings.SESSION_COOKIE_NAME: browser.cookies[django_settings.SESSION_COOKIE_NAME].value}
    with (
        httpx.Client(timeout=httpx.Timeout(5, read=10), cookies=cookie) as session,
        session.stream("GET", url, params={"follow": 1, "tail": 1}) as response,
    ):
        assert response.status_code == 200
        first = next(raw for raw in response.iter_lines() if raw.startswith("data: "))
        assert json.loads(first[6:])["text"] == "after the stream opened"

    # GET logs has it too, and since= the cursor of the first four gives only it.
    wait_for(lambda: state(job) == S.SUCCEEDED, what="the job to end")
    first = httpx.get(url, headers=auth, params={"tail": 4}).json()
    assert [line["text"] for line in first["lines"]][-1] == "after the stream opened"
