"""End to end: a work-queue array renders 100 frames over 4 workers of different speeds, and a
retried task placed again on the same node runs afresh.

The real portal (uvicorn in a thread), the real scheduler (cycles run here) and real agent processes
(``python -m nodes.agent.cli run``, simulated GPUs, the subprocess runtime): each worker is a Python
process on the host, as the workloads' unprivileged user, that pulls frame ranges from the portal's
work endpoint with its own token until none is left.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodes.models import CommandKind, Gpu, NodeCommand
from portal.actors import Actor
from portal.services.tenants import tenant_create
from scheduling.models import TERMINAL_STATES, WorkItem, WorkItemState, Workload
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.submission import workload_submit
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    wait_for,
)
from tests.scheduling.test_checkpoint_e2e import ProcessAgent, shared_dirs  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

PYTHON = "/usr/bin/python3"
# Pulls items until the portal says every one is done; worker i takes (i + 1) x 20 ms a frame.
# Worker 3 dies holding its first item on its first attempt (its item must go to another).
WORKER = """
import json, os, time, urllib.request
url, token = os.environ["GPUPOOL_WORK_URL"], os.environ["GPUPOOL_WORK_TOKEN"]
index, out = int(os.environ["GPUPOOL_ARRAY_INDEX"]), os.environ["OUT"]
delay = 0.02 * (index + 1)
def post(path):
    req = urllib.request.Request(url + path, data=b"", method="POST", headers={"Authorization": "Bearer " + token})
    with urllib.request.urlopen(req, timeout=10) as answer:
        return json.load(answer)
while True:
    answer = post("next/")
    item = answer["item"]
    if item is None:
        if answer["done"]:
            break
        time.sleep(answer["retry_after_s"])
        continue
    if index == 3 and not os.path.exists(out + "/died"):
        with open(out + "/died", "w") as f:
            f.write(str(item["index"]))
        os._exit(1)
    for frame in range(item["first"], item["last"] + 1):
        time.sleep(delay)
        with open(out + "/frames.log", "a") as f:
            f.write(f"{frame} {index}\\n")
    post("items/%d/done/" % item["index"])
print("worker", index, "finished")
"""


@pytest.fixture
def out_dir() -> Iterator[Path]:
    path = tempfile.mkdtemp(prefix="gpupool-e2e-frames-")
    os.chmod(path, 0o777)  # the workloads' user writes here
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_agent(running_portal, tmp_path, shared_dirs):  # noqa: F811
    agents: list[ProcessAgent] = []
    volumes, work = shared_dirs

    def start(hostname: str, gpus: int) -> ProcessAgent:
        agent = ProcessAgent(running_portal, tmp_path / hostname, hostname, f"{work}/{hostname}", volumes)
        agent.gpus = gpus
        agents.append(agent.start())
        return agent

    yield start
    for agent in agents:
        agent.kill()


def run_until(predicate, timeout: float, what: str):
    """Scheduling cycles (every 0.2 s) until ``predicate`` holds."""

    def step():
        scheduling_cycle_run()
        time.sleep(0.2)
        return predicate()

    return wait_for(step, timeout, what)


def test_100_frames_over_4_workers_of_different_speeds_each_done_once(
    start_agent,
    running_portal,  # noqa: F811
    out_dir,
    settings,
):
    settings.SITE_URL = running_portal.url
    begun = time.monotonic()
    nodes = [registered(start_agent(f"render-{i}", gpus=2)) for i in range(2)]
    model = Gpu.objects.filter(node=nodes[0]).first().model
    tenant = tenant_create(slug="render", name="Render", owner_email="o@render.test", actor=Actor.system())
    job = workload_submit(
        tenant=tenant,
        kind="job",
        spec={
            "name": "film",
            "image": "ghcr.io/acme/render:1",
            "command": [PYTHON, "-c", WORKER],
            "env": {"OUT": str(out_dir)},
            "gpu_models": [model.name],
            "max_retries": 1,
            "array": {"parallelism": 4, "work": {"first": 1, "last": 100, "chunk": 5, "lease_s": 60}},
        },
        actor=Actor.system(),
    )
    run_until(
        lambda: Workload.objects.get(pk=job.pk).state in TERMINAL_STATES, 120, "the film to be rendered"
    )
    job = Workload.objects.get(pk=job.pk)
    tasks = list(Workload.objects.filter(array_parent=job).order_by("array_index"))
    assert job.state == S.SUCCEEDED, (job.state_reason, [(t.state, t.state_reason) for t in tasks])

    frames = [line.split() for line in (out_dir / "frames.log").read_text().splitlines()]
    rendered = Counter(int(frame) for frame, _ in frames)
    assert sorted(rendered) == list(range(1, 101)) and set(rendered.values()) == {1}  # each frame once
    by_worker = Counter(int(worker) for _, worker in frames)
    assert by_worker[0] > by_worker[2] and by_worker[0] >= 25, by_worker  # the fastest took the most
    items = list(WorkItem.objects.filter(job=job).order_by("index"))
    assert len(items) == 20 and {i.state for i in items} == {WorkItemState.DONE}
    # The dead worker's item was leased again; it ran again itself (its retry) and ended well.
    died_holding = int((out_dir / "died").read_text())
    assert items[died_holding].leases == 2 and sum(i.leases for i in items) == 21
    assert [t.state for t in tasks] == [S.SUCCEEDED] * 4 and tasks[3].retries == 1
    print(
        f"\nwork queue e2e: {time.monotonic() - begun:.1f} s; frames per worker {dict(sorted(by_worker.items()))}"
    )


def test_a_retried_task_placed_again_on_the_same_node_runs_afresh(
    start_agent,
    running_portal,  # noqa: F811
    out_dir,
    settings,
):
    """The agent's record of the first, ended attempt is still there when the retry's start comes
    (it is forgotten only after a few heartbeats): the retry must start a new process, not be
    answered with the ended one's handle."""
    settings.SITE_URL = running_portal.url
    node = registered(start_agent("retry-a", gpus=1))
    model = Gpu.objects.filter(node=node).first().model
    tenant = tenant_create(slug="retry", name="Retry", owner_email="o@retry.test", actor=Actor.system())
    # Fails on its first run, succeeds on its second; each run notes its process id.
    script = f'echo "$$ $GPUPOOL_ARRAY_INDEX" >> {out_dir}/runs; [ $(wc -l < {out_dir}/runs) -ge 2 ]'
    job = workload_submit(
        tenant=tenant,
        kind="job",
        spec={
            "image": "ghcr.io/acme/x:1",
            "command": ["/bin/sh", "-c", script],
            "gpu_models": [model.name],
            "max_retries": 1,
            "array": {"count": 1},
        },
        actor=Actor.system(),
    )
    run_until(lambda: Workload.objects.get(pk=job.pk).state in TERMINAL_STATES, 60, "the job to end")
    task = Workload.objects.get(array_parent=job)
    assert Workload.objects.get(pk=job.pk).state == S.SUCCEEDED, task.state_reason
    assert task.state == S.SUCCEEDED and task.retries == 1 and task.attempt == 2
    runs = (out_dir / "runs").read_text().splitlines()
    assert (
        len(runs) == 2 and runs[0].split()[0] != runs[1].split()[0] and {r.split()[1] for r in runs} == {"0"}
    )
    starts = NodeCommand.objects.filter(
        node=node, kind=CommandKind.START_WORKLOAD, payload__workload_id=str(task.pk)
    )
    refs = [c.result.get("ref") for c in starts.order_by("created_at")]
    assert len(refs) == 2 and refs[0] != refs[1], refs  # a fresh handle, not the ended run's
