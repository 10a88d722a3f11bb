"""End to end: a running elastic job is resized and the process sees it.

The real portal (uvicorn in a thread), the real scheduler (cycles run here) and a real agent process
(``python -m nodes.agent.cli run``, simulated GPUs) with the subprocess runtime: the job is
``/bin/sh`` on the host. In signal mode it logs what ``$GPUPOOL_RESIZE_FILE`` holds each time
SIGUSR1 arrives; in restart mode it logs each start with its ``WORLD_SIZE``, GPUs and
``GPUPOOL_RESUME``, and the job stays RUNNING across the restart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nodes.models import Node, NodeState
from portal.actors import Actor
from portal.services.tenants import tenant_create
from scheduling.models import Allocation, Workload, WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.elastic import workload_resize
from scheduling.services.submission import workload_submit
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    H100,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    wait_for,
)
from tests.scheduling.test_checkpoint_e2e import ProcessAgent, shared_dirs  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

JOB = """
log="$HOME/log"
echo "start world=$WORLD_SIZE gpus=$CUDA_VISIBLE_DEVICES resume=${GPUPOOL_RESUME:-0}" >> "$log"
trap 'echo "usr1 $(cat "$GPUPOOL_RESIZE_FILE")" >> "$log"' USR1
trap 'exit 143' TERM
while true; do sleep 0.1; done
"""


class ElasticAgent(ProcessAgent):
    def __init__(self, *args, gpus: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.gpus = gpus
        from nodes.agent.collectors.simulated import simulated_gpu_uuid

        self.uuids = [simulated_gpu_uuid(self.hostname, i) for i in range(gpus)]


@pytest.fixture
def agent(running_portal, tmp_path, shared_dirs):  # noqa: F811
    volumes, work = shared_dirs
    made = []

    def start(hostname: str, gpus: int) -> tuple[ElasticAgent, Path]:
        a = ElasticAgent(
            running_portal, tmp_path / hostname, hostname, f"{work}/{hostname}", volumes, gpus=gpus
        )
        made.append(a.start())
        return a, Path(work) / hostname

    yield start
    for a in made:
        a.kill()


def _lines(work: Path, w: Workload) -> list[str]:
    path = work / str(w.pk) / "home" / "log"
    return path.read_text().splitlines() if path.exists() else []


def _uuids(w: Workload) -> list[str]:
    return sorted(Allocation.objects.active().filter(workload=w).values_list("gpu__uuid", flat=True))


def _only(node: Node) -> None:
    """Nodes of earlier tests in this database (their agents are gone) take no work here."""
    Node.objects.exclude(pk=node.pk).update(state=NodeState.DOWN)


def _submit(tenant, model: str, **elastic) -> Workload:
    spec = {
        "image": "ghcr.io/acme/train:1",
        "command": ["/bin/sh", "-c", JOB],
        "gpu_models": [model],
        "elastic": elastic,
    }
    return workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())


def _state(w: Workload) -> str:
    return Workload.objects.get(pk=w.pk).state


def test_signal_mode_the_process_reads_its_new_gpus_after_sigusr1(agent):
    a, work = agent("elastic-sig", 4)
    node = registered(a)
    wait_for(lambda: Node.objects.get(pk=node.pk).state == NodeState.READY, what="the node to be READY")
    _only(node)
    tenant = tenant_create(slug="el", name="El", owner_email="o@el.test", actor=Actor.system())
    job = _submit(tenant, H100, min_gpus=1, max_gpus=4)
    assert scheduling_cycle_run().placed == [job.pk]
    wait_for(lambda: _state(job) == S.RUNNING, timeout=60, what="the job to run")
    wait_for(lambda: _lines(work, job), what="the job's first line")
    assert _lines(work, job)[0] == f"start world=1 gpus={_uuids(job)[0]} resume=0"

    # Three idle GPUs: the next cycle grows it, and the process is told.
    assert scheduling_cycle_run().resized == [job.pk]
    assert len(_uuids(job)) == 4
    wait_for(lambda: any(x.startswith("usr1 ") for x in _lines(work, job)), what="SIGUSR1 after the growth")
    told = json.loads(next(x for x in _lines(work, job) if x.startswith("usr1 "))[5:])
    assert sorted(told["gpu_uuids"]) == _uuids(job) and told["world_size"] == 4 and told["gpu_count"] == 4

    # The tenant shrinks it to 2: at once, and the process hears of it.
    workload_resize(workload=Workload.objects.get(pk=job.pk), gpu_count=2, actor=Actor.system())
    wait_for(
        lambda: sum(x.startswith("usr1 ") for x in _lines(work, job)) == 2, what="SIGUSR1 after the shrink"
    )
    told = json.loads([x for x in _lines(work, job) if x.startswith("usr1 ")][-1][5:])
    assert sorted(told["gpu_uuids"]) == _uuids(job) and told["world_size"] == 2
    assert _state(job) == S.RUNNING
    assert not [x for x in _lines(work, job) if x.startswith("start")][1:]  # never restarted
    assert os.stat(work / str(job.pk) / "resize").st_mode & 0o044  # readable by the job's user


def test_restart_mode_restarts_with_the_new_world_size_and_stays_running(agent):
    a, work = agent("elastic-rst", 2)
    node = registered(a)
    wait_for(lambda: Node.objects.get(pk=node.pk).state == NodeState.READY, what="the node to be READY")
    _only(node)
    tenant = tenant_create(slug="elr", name="Elr", owner_email="o@elr.test", actor=Actor.system())
    job = _submit(tenant, H100, min_gpus=1, max_gpus=2, on_resize="restart")
    assert scheduling_cycle_run().placed == [job.pk]
    wait_for(lambda: _state(job) == S.RUNNING, timeout=60, what="the job to run")
    wait_for(lambda: _lines(work, job), what="the job's first line")
    assert scheduling_cycle_run().resized == [job.pk]
    wait_for(lambda: len(_lines(work, job)) >= 2, what="the restart")
    first, second = _lines(work, job)[:2]
    assert first.startswith("start world=1 ") and first.endswith("resume=0")
    assert second == f"start world=2 gpus={','.join(_uuids(job))} resume=1" or (
        second.startswith("start world=2 ")
        and second.endswith("resume=1")
        and sorted(second.split("gpus=")[1].split(" ")[0].split(",")) == _uuids(job)
    )
    # The job never left RUNNING: its only events are its way there.
    assert _state(job) == S.RUNNING
    assert (
        list(
            WorkloadEvent.objects.filter(workload=job).values_list("to_state", flat=True).order_by("at", "id")
        )[-1]
        == S.RUNNING
    )
    # A few heartbeats later it still runs (no end was reported between the stop and the restart).
    import time

    time.sleep(2)
    assert _state(job) == S.RUNNING
