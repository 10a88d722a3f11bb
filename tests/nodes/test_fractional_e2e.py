"""End to end: MIG through the real portal and the real agent program (simulated collector, which
keeps the hardware's MIG rules, and the simulated runtime). Staff set a GPU's MIG mode and layout;
the agent makes the layout's instances; the real scheduler places a MIG job on one of them at its
start; the job runs on that instance, its telemetry lands on the GPU, and when it exits the layout's
instance stays (and MIG mode stays on). A job of a profile the layout lacks waits. Staff turning MIG
off while the job runs drain the GPU: the change goes to the agent when the job's end is reported,
and the agent leaves MIG mode. The harness
(portal in a thread, agent process, own database) is the one of ``test_e2e_agent``."""

from __future__ import annotations

import pytest

from nodes.models import CommandKind, Gpu, GpuSample, Node, NodeCommand, NodeState
from nodes.services.mig import gpu_mig_configure
from portal.actors import Actor
from portal.errors import Conflict
from portal.models import AuditEvent
from portal.services.tenants import tenant_create
from scheduling.models import Allocation, Workload
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.submission import workload_submit
from tests.nodes.test_e2e_agent import (  # noqa: F401  (fixtures)
    _no_scheduling_cycles,
    agent_views_in_test_thread,
    e2e_database,
    portal,
    registered,
    running_portal,
    signals,
    start_agent,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_staff_set_a_mig_layout_and_a_mig_job_lands_on_it(start_agent, signals):  # noqa: F811
    agent = start_agent("e2e-mig", gpus=2)
    node = registered(agent)
    wait_for(lambda: Node.objects.get(pk=node.pk).state == NodeState.READY, what="a READY node")
    try:
        gpu0 = Gpu.objects.select_related("node", "model").get(node=node, index=0)
        assert gpu0.mig_mode is False

        command = gpu_mig_configure(
            gpu=gpu0, enable=True, profiles=["3g.40gb", "3g.40gb"], actor=Actor.system(), reason="inference"
        )
        assert Gpu.objects.get(pk=gpu0.pk).mig_configuring is True  # no placements meanwhile
        with pytest.raises(Conflict, match="being reconfigured"):
            gpu_mig_configure(gpu=gpu0, enable=False, profiles=[], actor=Actor.system())
        wait_for(lambda: NodeCommand.objects.get(pk=command.pk).state == "succeeded", what="the MIG change")
        command.refresh_from_db()
        made = {c["start"]: c["mig_uuid"] for c in command.result["created"]}
        assert sorted(made) == [0, 4]
        gpu0 = wait_for(
            lambda: (
                Gpu.objects.select_related("node", "model").filter(pk=gpu0.pk, mig_configuring=False).first()
            ),
            what="the GPU's new MIG state",
        )
        assert gpu0.mig_mode is True
        assert gpu0.mig_layout == [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]
        assert AuditEvent.objects.filter(action="gpu.mig_configure", target_id=str(gpu0.pk)).exists()

        tenant = tenant_create(slug="mig", name="Mig", owner_email="o@mig.test", actor=Actor.system())
        spec = {
            "image": "ghcr.io/acme/infer:1",
            "gpu_model": gpu0.model.name,
            "command": ["serve"],
            "mig_profile": "3g.40gb",
            "env": {"GPUPOOL_SIM_DURATION_S": "2"},
        }
        job = workload_submit(tenant=tenant, kind="job", spec=spec, actor=Actor.system())
        small = workload_submit(
            tenant=tenant, kind="job", spec={**spec, "mig_profile": "1g.10gb"}, actor=Actor.system()
        )
        assert scheduling_cycle_run().placed == [job.pk]
        allocation = Allocation.objects.get(workload=job)
        assert allocation.gpu_id == gpu0.pk and allocation.mig_start in made
        assert Workload.objects.get(pk=small.pk).state == S.QUEUED  # the layout has no 1g.10gb
        start = NodeCommand.objects.get(kind=CommandKind.START_WORKLOAD, payload__workload_id=str(job.pk))
        assert start.payload["mig_start"] == allocation.mig_start
        wait_for(lambda: NodeCommand.objects.get(pk=start.pk).state == "succeeded", what="the start")
        start.refresh_from_db()
        assert start.result["mig_uuid"] == made[allocation.mig_start]  # the layout's instance
        assert f"took the layout's MIG instance {start.result['mig_uuid']}" in agent.log

        # While it runs, GPU 0 is in MIG mode (no utilisation counter) and runs the job's process.
        wait_for(
            lambda: GpuSample.objects.filter(
                gpu=gpu0, util_pct__isnull=True, processes__0__workload_id=str(job.pk)
            ).exists(),
            what="a sample of the job on its instance",
        )
        # Staff turn MIG off under it: the GPU drains (the job runs on, nothing is sent yet).
        assert gpu_mig_configure(gpu=gpu0, enable=False, profiles=[], actor=Actor.system()) is None
        assert not NodeCommand.objects.filter(kind=CommandKind.CONFIGURE_MIG).exclude(pk=command.pk).exists()
        assert Workload.objects.get(pk=job.pk).state in (S.SCHEDULED, S.RUNNING)
        wait_for(lambda: Workload.objects.get(pk=job.pk).state == S.SUCCEEDED, what="the job's end")
        assert f"gave back the layout's MIG instance {start.result['mig_uuid']}" in agent.log
        assert "destroyed MIG instance" not in agent.log  # the layout stays until the change
        # The job's end (the node's report) sends the change; the agent leaves MIG mode.
        off = wait_for(
            lambda: NodeCommand.objects.filter(kind=CommandKind.CONFIGURE_MIG).exclude(pk=command.pk).first(),
            what="the MIG change sent when the GPU drained",
        )
        assert off.payload["enable"] is False
        wait_for(lambda: NodeCommand.objects.get(pk=off.pk).state == "succeeded", what="MIG mode off")
        gpu0 = wait_for(
            lambda: Gpu.objects.filter(pk=gpu0.pk, mig_configuring=False).first(),
            what="the GPU back in service",
        )
        assert (gpu0.mig_mode, gpu0.mig_layout, gpu0.mig_pending) == (False, [], None)
        assert AuditEvent.objects.filter(action="gpu.mig_send", target_id=str(gpu0.pk)).count() == 2
        assert agent.stop() == 0
    finally:
        # The module's database outlives the test: later tests must not place work here.
        Node.objects.filter(pk=node.pk).update(state=NodeState.DOWN)
