"""End to end: a job that counts with checkpoints is preempted by a higher-priority job, is placed
again on another node, resumes from its checkpoint and ends with the right count.

The real portal (uvicorn in a thread), the real scheduler (cycles run here) and two real agent
processes (``python -m nodes.agent.cli run``, simulated GPUs) with the subprocess runtime: the job
is ``/bin/sh`` on the host, as the workload's unprivileged user. Both agents mount the same volumes
root (a temporary directory standing for the region's shared filesystem), so the second node finds
the checkpoint the first wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodes.models import Gpu, Node, NodeState
from portal.actors import Actor
from portal.services.tenants import tenant_create
from scheduling.models import Allocation, Workload, WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.submission import workload_submit
from scheduling.services.volumes import volume_create
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    H100,
    HEARTBEAT_INTERVAL_S,
    ROOT,
    SAMPLE_INTERVAL_S,
    AgentProcess,
    Portal,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    wait_for,
)

pytestmark = pytest.mark.slow

STEPS = 60
# Counts to STEPS, a step every 0.1 s, keeping its count in the checkpoint directory (written whole:
# to a temporary file, then renamed); on SIGTERM it saves the count and notes whether the
# preemption notice file was there first.
COUNTER = f"""
d="$GPUPOOL_CHECKPOINT_DIR"; n=0
save() {{ echo $n > "$d/count.tmp" && mv "$d/count.tmp" "$d/count"; }}
if [ "$GPUPOOL_RESUME" = 1 ] && [ -f "$d/count" ]; then n=$(cat "$d/count"); fi
echo "start resume=${{GPUPOOL_RESUME:-0}} from=$n" >> "$d/log"
noticed() {{ if [ -f "$GPUPOOL_PREEMPT_NOTICE_FILE" ]; then echo yes; else echo no; fi; }}
trap 'save; echo "term at=$n notice=$(noticed)" >> "$d/log"; exit 143' TERM
while [ $n -lt {STEPS} ]; do n=$((n+1)); save; sleep 0.1; done
echo "done at=$n" >> "$d/log"
"""


class ProcessAgent(AgentProcess):
    """The agent program with the subprocess runtime and a volumes root."""

    def __init__(self, server: Portal, state_dir: Path, hostname: str, work_dir: str, volumes_root: str):
        super().__init__(server, state_dir, hostname, gpus=1)
        with open(self.config, "a") as handle:
            handle.write(
                "single_tenant = true\n"
                f"process_user = {json.dumps('nobody' if os.geteuid() == 0 else '')}\n"
                f"process_work_dir = {json.dumps(work_dir)}\n"
                f"volumes_root = {json.dumps(volumes_root)}\n"
            )

    def start(self) -> ProcessAgent:
        assert self.proc is None
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop())
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GPUPOOL_ALLOW_INSECURE_HTTP": "1"}
        env.pop("DJANGO_SETTINGS_MODULE", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nodes.agent.cli", "run", "--config", str(self.config),
             "--portal-url", self.portal.url, "--bootstrap-token", self.token,
             "--state-dir", str(self.state_dir), "--collector", "simulated", "--runtime", "subprocess",
             "--hostname", self.hostname, "--region", "e2e-1",
             "--sim-gpus", json.dumps([{"model": H100, "count": self.gpus}]),
             "--sample-interval", str(SAMPLE_INTERVAL_S), "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
             "--commands-wait", "2", "--log-level", "INFO"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        return self


@pytest.fixture
def shared_dirs() -> Iterator[tuple[str, str]]:
    """The region's shared volumes root and the workloads' working directories: outside pytest's
    0700 tree, which the workloads' user could not enter."""
    volumes = tempfile.mkdtemp(prefix="gpupool-e2e-volumes-")
    work = tempfile.mkdtemp(prefix="gpupool-e2e-work-")
    os.chmod(volumes, 0o711)
    os.chmod(work, 0o711)
    yield volumes, work
    shutil.rmtree(volumes, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def start_process_agent(running_portal, tmp_path, shared_dirs):  # noqa: F811
    agents: list[ProcessAgent] = []
    volumes, work = shared_dirs

    def start(hostname: str) -> ProcessAgent:
        agent = ProcessAgent(running_portal, tmp_path / hostname, hostname, f"{work}/{hostname}", volumes)
        agents.append(agent.start())
        return agent

    yield start
    for agent in agents:
        agent.kill()


def state(w: Workload) -> str:
    return Workload.objects.get(pk=w.pk).state


def holders(w: Workload) -> set[int]:
    return set(Allocation.objects.filter(workload=w, ended_at__isnull=True).values_list("node_id", flat=True))


def test_a_counting_job_is_preempted_and_resumes_on_another_node_with_the_right_count(
    start_process_agent, shared_dirs, settings
):
    settings.SCHEDULING_PREEMPTION_NOTICE_S = {**settings.SCHEDULING_PREEMPTION_NOTICE_S, "spot": 1}
    begun = time.monotonic()
    volumes_root = Path(shared_dirs[0])
    a = start_process_agent("ckpt-a")
    node_a = registered(a)
    model = Gpu.objects.get(node=node_a).model
    tenant = tenant_create(slug="ckpt", name="Ckpt", owner_email="o@ckpt.test", actor=Actor.system())
    volume = volume_create(tenant=tenant, name="ckpt", region="e2e-1", size_gib=1, actor=Actor.system())

    def submit(plan: str, command: list[str], **spec) -> Workload:
        spec = {
            "image": "ghcr.io/acme/train:1",
            "command": command,
            "gpu_models": [model.name],
            "plan": plan,
            **spec,
        }
        return workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())

    job = submit(
        "spot",
        ["/bin/sh", "-c", COUNTER],
        checkpoint_resume=True,
        volumes=[{"volume": volume.pk, "mount_path": "/ckpt"}],
    )
    checkpoint = volumes_root / f"vol-{volume.pk}" / ".gpupool-checkpoints" / str(job.pk)
    assert scheduling_cycle_run().ran and holders(job) == {node_a.pk}
    wait_for(lambda: state(job) == S.RUNNING, what="the job to run on A")
    wait_for(
        lambda: (checkpoint / "count").exists() and int((checkpoint / "count").read_text()) >= 8,
        30,
        "a count",
    )

    # A higher-priority job needs A's only GPU: the counting job gets its notice, then SIGTERM.
    urgent = submit("on_demand", ["/bin/sh", "-c", "sleep 60"])
    assert scheduling_cycle_run().preempted == [job.pk]
    wait_for(lambda: state(job) == S.QUEUED, 30, "the job to be requeued after its notice")
    saved = int((checkpoint / "count").read_text())
    assert 8 <= saved < STEPS
    assert scheduling_cycle_run().ran and holders(urgent) == {node_a.pk}
    assert holders(job) == set()

    # Another node of the region comes up: the job is placed there and resumes from its checkpoint.
    b = start_process_agent("ckpt-b")
    node_b = registered(b)
    wait_for(lambda: Node.objects.get(pk=node_b.pk).state == NodeState.READY, what="B to be READY")
    assert scheduling_cycle_run().ran and holders(job) == {node_b.pk}
    wait_for(lambda: state(job) == S.SUCCEEDED, 60, "the job to finish on B")

    log = (checkpoint / "log").read_text().splitlines()
    assert log[0] == "start resume=0 from=0"
    assert log[1] == f"term at={saved} notice=yes"  # the notice file was there before SIGTERM
    assert log[2] == f"start resume=1 from={saved}"
    assert log[3] == f"done at={STEPS}" and len(log) == 4
    assert int((checkpoint / "count").read_text()) == STEPS
    ran = list(
        Allocation.objects.filter(workload=job).order_by("started_at").values_list("node_id", flat=True)
    )
    assert ran == [node_a.pk, node_b.pk]
    placed = list(WorkloadEvent.objects.filter(workload=job, to_state=S.SCHEDULED).order_by("at", "id"))
    assert ["resumes from its checkpoint" in e.message for e in placed] == [False, True]
    assert WorkloadEvent.objects.filter(workload=job, to_state=S.QUEUED, reason="preempted").exists()
    # The volume outlived both placements and the agents measured it.
    volume.refresh_from_db()
    wait_for(lambda: type(volume).objects.get(pk=volume.pk).used_bytes, 10, "a measurement of the volume")
    print(
        f"\ncheckpoint e2e: {time.monotonic() - begun:.1f} s; preempted at {saved} of {STEPS}, resumed on B"
    )
