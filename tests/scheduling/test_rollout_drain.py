"""A rolling upgrade drains a node that runs work (``scheduling.services.drain``, the hooks nodes asks):
instances are told at once, with the time left to the deadline; a job may finish, and one still
running at the deadline is preempted (and requeues); the node is upgraded only once it is empty."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import CommandKind, NodeCommand, RolloutStep, RolloutStepState
from nodes.services import rollouts
from portal.actors import Actor
from portal.models import User
from scheduling.models import Allocation, WorkloadEvent
from scheduling.models import WorkloadState as S
from scheduling.services.lifecycle import workload_on_command_finished, workload_on_exited
from tests.scheduling.conftest import reload

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_advance_tasks(settings):
    settings.ROLLOUT_ADVANCE_ON_COMMIT = False


def _started(w):
    for cmd in NodeCommand.objects.filter(kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk)):
        workload_on_command_finished(
            kind=cmd.kind, payload=cmd.payload, node_id=cmd.node_id, state="succeeded", result={}
        )


def _preempts(w) -> list[NodeCommand]:
    return list(NodeCommand.objects.filter(kind=CommandKind.PREEMPT_WORKLOAD, payload__workload_id=str(w.pk)))


def test_instances_get_notice_jobs_may_finish_and_the_rest_is_preempted_at_the_deadline(
    tenant, make_node, submit, cycle
):
    node = make_node(gpus=8)
    instance = submit(tenant, kind="instance", gpu_count=2)
    job = submit(tenant, gpu_count=2, requeue_on_preemption=True)
    late_job = submit(tenant, gpu_count=2, requeue_on_preemption=True)
    cycle()
    for w in (instance, job, late_job):
        _started(w)
        assert reload(w).state == S.RUNNING
    staff = Actor(user=User.objects.create_user(email="ops@gpupool.example", password="x", is_staff=True))
    campaign = rollouts.rollout_start(
        data={
            "name": "driver",
            "upgrade": "driver-560",
            "region": "us-east-1",
            "batch_size": 1,
            "max_region_share": "1",
            "drain_deadline_s": 900,
        },
        actor=staff,
    )
    rollouts.rollout_advance()
    (step,) = RolloutStep.objects.filter(campaign=campaign)
    assert step.state == RolloutStepState.DRAINING and step.node_id == node.pk

    # The instance has its notice, to stop by the drain deadline; the jobs run on.
    assert reload(instance).state == S.PREEMPTED
    (notice,) = _preempts(instance)
    assert 890 <= notice.payload["notice_s"] <= 900
    event = WorkloadEvent.objects.filter(workload=instance, to_state=S.PREEMPTED).latest("at")
    assert event.reason == "node_upgrade"
    assert reload(job).state == S.RUNNING and not _preempts(job)

    # One job finishes, the instance stops after its notice; the late job is still there.
    workload_on_exited(node_id=node.pk, workload_id=job.pk, state="exited", exit_code=0)
    workload_on_exited(node_id=node.pk, workload_id=instance.pk, state="preempted", exit_code=None)
    rollouts.rollout_advance()
    step.refresh_from_db()
    assert step.state == RolloutStepState.DRAINING and step.message == "Draining: 1 workload(s) left."

    # At the deadline the late job is preempted with its plan's notice, and requeues.
    rollouts.rollout_advance(now=timezone.now() + timedelta(seconds=901))
    assert reload(late_job).state == S.PREEMPTED and len(_preempts(late_job)) == 1
    workload_on_exited(node_id=node.pk, workload_id=late_job.pk, state="preempted", exit_code=None)
    assert reload(late_job).state == S.QUEUED  # back in the queue, for another node
    assert not Allocation.objects.active().filter(node_id=node.pk).exists()

    rollouts.rollout_advance(now=timezone.now() + timedelta(seconds=902))
    step.refresh_from_db()
    assert step.state == RolloutStepState.UPGRADING
    assert NodeCommand.objects.get(pk=step.command_id).kind == CommandKind.UPGRADE
