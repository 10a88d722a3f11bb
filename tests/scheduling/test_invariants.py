"""A hypothesis state machine over submit / place / start / exit / stop / node down and up / GPU
failure / reconcile: no GPU capacity is ever allocated twice, a workload holds GPUs exactly while
it is placed, and no workload is lost."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from nodes.models import CommandKind, Gpu, GpuHealth, Node, NodeCommand, NodeState
from portal.actors import Actor
from portal.errors import Conflict, ValidationFailed
from scheduling.models import HOLDING_STATES, Allocation, Quota, Workload, WorkloadState
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.lifecycle import (
    scheduling_reconcile,
    workload_on_command_finished,
    workload_on_exited,
    workload_stop,
    workloads_on_gpu_unhealthy,
    workloads_on_node_down,
)
from scheduling.services.submission import workload_submit

pytestmark = pytest.mark.django_db

SYSTEM = Actor.system()
SHAPES = st.sampled_from(
    [(1, 1000, False), (2, 1000, False), (4, 1000, False), (1, 250, False), (1, 500, False), (8, 1000, True)]
)


class Scheduling(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self._atomic = transaction.atomic()
        self._atomic.__enter__()
        self.submitted: set[int] = set()

    @initialize()
    def fleet(self):
        self.tenant = self._tenant
        Quota.objects.update_or_create(
            tenant=self.tenant, defaults={"max_gpus_total": None, "max_concurrent_workloads": None}
        )
        self.nodes = [self._make_node(4) for _ in range(2)] + [self._make_node(8)]

    def teardown(self):
        transaction.set_rollback(True)
        self._atomic.__exit__(None, None, None)

    @rule(
        shape=SHAPES, kind=st.sampled_from(["job", "instance"]), plan=st.sampled_from(["on_demand", "spot"])
    )
    def submit(self, shape, kind, plan):
        count, milli, gang = shape
        spec = {
            "gpu_models": ["H100"],
            "gpu_count": count,
            "gpu_fraction_milli": milli,
            "gang": gang,
            "plan": plan,
            "image": "img",
            "max_retries": 1,
        }
        if kind == "job":
            spec["command"] = ["run"]
        try:
            self.submitted.add(workload_submit(tenant=self.tenant, kind=kind, spec=spec, actor=SYSTEM).pk)
        except ValidationFailed as e:  # every node that could take it is down or broken
            assert set(e.fields) <= {"gpu_models", "gpu_count"}, e.fields
        assert scheduling_cycle_run().ran  # as the on-commit trigger would

    @rule()
    def cycle(self):
        assert scheduling_cycle_run().ran

    @rule(data=st.data())
    def start(self, data):
        ws = list(Workload.objects.filter(state=WorkloadState.SCHEDULED).order_by("pk"))
        if not ws:
            return
        w = data.draw(st.sampled_from(ws))
        for cmd in NodeCommand.objects.filter(
            kind=CommandKind.START_WORKLOAD, payload__workload_id=str(w.pk), payload__attempt=w.attempt
        ):
            workload_on_command_finished(
                kind=cmd.kind, payload=cmd.payload, node_id=cmd.node_id, state="succeeded", result={}
            )

    @rule(data=st.data(), outcome=st.sampled_from([("exited", 0), ("failed", 1), ("preempted", None)]))
    def exit(self, data, outcome):
        rows = list(
            Allocation.objects.active()
            .values_list("workload_id", "node_id")
            .distinct()
            .order_by("workload_id")
        )
        if not rows:
            return
        wid, node_id = data.draw(st.sampled_from(rows))
        workload_on_exited(node_id=node_id, workload_id=str(wid), state=outcome[0], exit_code=outcome[1])
        assert scheduling_cycle_run().ran

    @rule(data=st.data())
    def stop(self, data):
        ws = list(Workload.objects.exclude(state__in=["stopped", "succeeded", "failed"]).order_by("pk"))
        if not ws:
            return
        with contextlib.suppress(Conflict):
            workload_stop(workload=data.draw(st.sampled_from(ws)), actor=SYSTEM)

    @rule(i=st.integers(0, 2))
    def node_down(self, i):
        node = self.nodes[i]
        Node.objects.filter(pk=node.pk).update(state=NodeState.DOWN)
        workloads_on_node_down(node_id=node.pk)
        assert scheduling_cycle_run().ran

    @rule(i=st.integers(0, 2))
    def node_up(self, i):
        Node.objects.filter(pk=self.nodes[i].pk).update(state=NodeState.READY)

    @rule(data=st.data())
    def gpu_fails(self, data):
        busy = Allocation.objects.active().values_list("gpu_id", flat=True)
        gpus = list(Gpu.objects.filter(health=GpuHealth.HEALTHY, pk__in=busy).order_by("pk"))
        if not gpus:
            return
        gpu = data.draw(st.sampled_from(gpus))
        Gpu.objects.filter(pk=gpu.pk).update(health=GpuHealth.UNHEALTHY, isolated=True)
        workloads_on_gpu_unhealthy(gpu_id=gpu.pk, node_id=gpu.node_id, reason="test")
        assert scheduling_cycle_run().ran

    @rule()
    def repairs(self):
        Gpu.objects.update(health=GpuHealth.HEALTHY, isolated=False)
        Node.objects.update(state=NodeState.READY)
        assert scheduling_cycle_run().ran

    @rule()
    def much_later(self):
        scheduling_reconcile(now=timezone.now() + timedelta(hours=2))

    @invariant()
    def no_gpu_is_allocated_twice(self):
        over = (
            Allocation.objects.active().values("gpu_id").annotate(m=Sum("fraction_milli")).filter(m__gt=1000)
        )
        assert not over.exists()

    @invariant()
    def holding_exactly_while_placed(self):
        holders = set(Allocation.objects.active().values_list("workload_id", flat=True))
        placed = set(Workload.objects.filter(state__in=HOLDING_STATES).values_list("pk", flat=True))
        assert holders == placed

    @invariant()
    def nothing_on_broken_hardware(self):
        assert not Allocation.objects.active().filter(gpu__health=GpuHealth.UNHEALTHY).exists()

    @invariant()
    def no_workload_is_lost(self):
        assert set(Workload.objects.values_list("pk", flat=True)) == self.submitted


def test_scheduling_state_machine(tenant, make_node, settings_override=None):
    Scheduling._tenant = tenant
    Scheduling._make_node = staticmethod(lambda gpus: make_node(gpus=gpus))
    run_state_machine_as_test(
        Scheduling,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
