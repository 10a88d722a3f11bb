"""The reconciler task run by a real Celery worker, on PostgreSQL."""

from __future__ import annotations

import time

import pytest

from nodes.models import CommandKind, NodeCommand
from scheduling.models import Allocation, Workload
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.triggers import cycle_request_clear
from tests.conftest import postgres_only

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _postgres_only():
    postgres_only("the worker runs in its own connection")


def _wait(check, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_a_worker_moves_a_workload_its_node_never_started_to_another_node(
    tenant, make_node, submit, settings
):
    from celery.contrib.testing.worker import start_worker

    from portal.celery import app
    from scheduling.tasks import reconcile

    small = make_node(gpus=2)  # the engine's first choice
    big = make_node(gpus=8)
    w = submit(tenant, gpu_count=2)
    assert scheduling_cycle_run().placed == [w.pk]
    assert set(Allocation.objects.active().filter(workload=w).values_list("node_id", flat=True)) == {small.pk}
    # Nothing reports the start; with a zero timeout the reconciler finds it late at once, and the
    # cycle it asks for runs on the worker too.
    settings.SCHEDULING_START_TIMEOUT_S = 0
    settings.SCHEDULING_TRIGGER_CYCLES = True
    settings.SCHEDULING_CYCLE_DEBOUNCE_S = 0.1
    cycle_request_clear()
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        reconcile.delay()
        assert _wait(lambda: Workload.objects.get(pk=w.pk).attempt == 2)
    w = Workload.objects.get(pk=w.pk)
    assert w.avoid_nodes == [small.pk] and w.state == S.SCHEDULED
    assert set(Allocation.objects.active().filter(workload=w).values_list("node_id", flat=True)) == {big.pk}
    assert NodeCommand.objects.filter(node=small, kind=CommandKind.STOP_WORKLOAD).exists()
