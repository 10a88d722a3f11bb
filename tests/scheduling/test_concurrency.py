"""Races, on PostgreSQL (SQLite serialises writers, so there is nothing to race there)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from django.db import connection, connections, transaction
from django.test import Client

from nodes.models import CommandKind, NodeCommand
from portal.actors import Actor
from scheduling.locks import try_cycle_lock
from scheduling.models import Allocation, Quota, Workload
from scheduling.models import WorkloadState as S
from scheduling.services.cycle import scheduling_cycle_run
from scheduling.services.submission import workload_submit
from scheduling.services.triggers import cycle_request_clear
from tests.conftest import postgres_only
from tests.races import together

pytestmark = pytest.mark.django_db(transaction=True)

JOB = {"gpu_models": ["H100"], "image": "ghcr.io/acme/train:1", "command": ["python", "t.py"]}


@pytest.fixture(autouse=True)
def _postgres_only():
    postgres_only("row locks, advisory locks, concurrent writers")


def test_parallel_requests_cannot_pass_a_quota(tenant, make_token, make_node):
    make_node()
    Quota.objects.create(tenant=tenant, max_concurrent_workloads=3, max_gpus_total=100)
    token = make_token(tenant)
    n = 10
    codes: list[int] = []

    def post():
        client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
        codes.append(client.post("/api/v1/jobs/", JOB, content_type="application/json").status_code)

    assert together(post, n) == []
    assert sorted(codes) == [201] * 3 + [403] * (n - 3)
    assert Workload.objects.filter(tenant=tenant).count() == 3


def test_parallel_gpu_quota_counts_every_admitted_request(tenant, make_node):
    make_node()
    make_node()
    Quota.objects.create(tenant=tenant, max_gpus_total=10)
    errors = together(
        lambda: workload_submit(
            tenant=tenant, kind="job", spec={**JOB, "gpu_count": 3}, actor=Actor.system()
        ),
        8,
    )
    # Three of eight requests of 3 GPUs fit in 10; the others are refused by the quota.
    assert sorted(type(e).__name__ for e in errors) == ["QuotaExceeded"] * 5
    assert Workload.objects.count() == 3


def test_a_tenants_first_submissions_at_once_make_one_quota_row_with_the_defaults(
    tenant, make_node, settings
):
    make_node()
    settings.SCHEDULING_DEFAULT_QUOTA = {"max_concurrent_workloads": 2}
    assert not Quota.objects.filter(tenant=tenant).exists()
    n = 6
    errors = together(lambda: workload_submit(tenant=tenant, kind="job", spec=JOB, actor=Actor.system()), n)
    # Every submission waited for the one row, and the default limit held across all of them.
    assert sorted(type(e).__name__ for e in errors) == ["QuotaExceeded"] * (n - 2)
    assert Workload.objects.filter(tenant=tenant).count() == 2
    assert list(Quota.objects.filter(tenant=tenant).values_list("max_concurrent_workloads", flat=True)) == [2]


def test_a_second_cycle_does_not_run_while_one_holds_the_lock(tenant, make_node, submit):
    make_node()
    submit(tenant)
    held, release = threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic():
                assert try_cycle_lock()
                held.set()
                release.wait(10)
        finally:
            connections.close_all()

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    try:
        assert scheduling_cycle_run().ran is False
        assert Workload.objects.get().state == S.PENDING
    finally:
        release.set()
        t.join()
    assert scheduling_cycle_run().ran is True


CHILD = """
import django, os, sys
django.setup()
from scheduling.services.cycle import scheduling_cycle_run
placed = 0
for _ in range(int(sys.argv[1])):
    placed += len(scheduling_cycle_run().placed)
print(placed)
"""


def test_two_processes_running_cycles_never_double_allocate(tenant, make_node, submit):
    for _ in range(4):
        make_node(gpus=8)
    ws = [submit(tenant, gpu_count=g) for g in (1, 2, 3, 4, 1, 2, 3, 4, 1, 1, 2)]
    ws += [submit(tenant, gpu_fraction_milli=300) for _ in range(6)]
    db = connection.settings_dict
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "SCHEDULING_TRIGGER_CYCLES": "0",
    }
    env.pop("TEST_DB_NAME", None)
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, "15"], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    placed = sum(int(o.strip().splitlines()[-1]) for o in outs)
    assert placed == len(ws)
    assert all(Workload.objects.get(pk=w.pk).state == S.SCHEDULED for w in ws)
    per_gpu: dict[int, int] = {}
    for gpu_id, milli in Allocation.objects.active().values_list("gpu_id", "fraction_milli"):
        per_gpu[gpu_id] = per_gpu.get(gpu_id, 0) + milli
    assert max(per_gpu.values()) <= 1000
    assert NodeCommand.objects.filter(kind=CommandKind.START_WORKLOAD).count() == len(ws)


KILLED_CHILD = """
import sys, time, django
django.setup()
import scheduling.services.cycle as cycle

def stall(**kwargs):
    print("MID-CYCLE", flush=True)
    time.sleep(600)

cycle.node_commands_enqueue_many = stall
cycle.scheduling_cycle_run()
"""


def test_a_worker_killed_mid_cycle_leaves_nothing_half_written(tenant, make_node, submit):
    make_node()
    ws = [submit(tenant, gpu_count=2) for _ in range(3)]
    db = connection.settings_dict
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "SCHEDULING_TRIGGER_CYCLES": "0",
    }
    env.pop("TEST_DB_NAME", None)
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "MID-CYCLE"  # allocations written, not committed
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
    assert not Allocation.objects.exists()
    assert not NodeCommand.objects.exists()
    assert {w.state for w in Workload.objects.all()} == {S.PENDING}
    # The lock died with the connection: the next cycle runs and finishes the work.
    deadline = time.monotonic() + 10
    result = scheduling_cycle_run()
    while not result.ran and time.monotonic() < deadline:
        time.sleep(0.2)
        result = scheduling_cycle_run()
    assert sorted(result.placed) == sorted(w.pk for w in ws)


def test_a_real_celery_worker_runs_the_cycle_a_submission_asks_for(tenant, make_node, submit, settings):
    from celery.contrib.testing.worker import start_worker

    from portal.celery import app

    settings.SCHEDULING_TRIGGER_CYCLES = True
    settings.SCHEDULING_CYCLE_DEBOUNCE_S = 0.1
    cycle_request_clear()
    make_node()
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        w = submit(tenant, gpu_count=2)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Workload.objects.get(pk=w.pk).state != S.SCHEDULED:
            time.sleep(0.2)
    assert Workload.objects.get(pk=w.pk).state == S.SCHEDULED
    assert Allocation.objects.active().filter(workload=w).count() == 2


def test_parallel_workers_never_lease_one_work_item_twice(tenant, make_node):
    """Workers racing for the next item: one that finds the row it wants just leased by another
    must pass over it (its re-check sees the new holder), so every lease goes to one worker."""
    from django.utils import timezone

    from scheduling.models import WorkItem
    from scheduling.services.work import work_done, work_next

    make_node()
    parent = workload_submit(
        tenant=tenant,
        kind="job",
        spec={**JOB, "array": {"parallelism": 6, "work": {"first": 1, "last": 240, "chunk": 2}}},
        actor=Actor.system(),
    )
    scheduling_cycle_run()
    tasks = list(Workload.objects.filter(array_parent=parent))
    assert len(tasks) == 6 and {t.state for t in tasks} == {S.SCHEDULED}
    mine: dict[int, list[int]] = {t.pk: [] for t in tasks}
    queue = list(tasks)

    def worker():
        task = queue.pop()
        while True:
            item, done = work_next(task=task, now=timezone.now())
            if item is None:
                if done:
                    return
                time.sleep(0.01)  # the rest are leased to others for now
                continue
            mine[task.pk].append(item.index)
            work_done(task=task, index=item.index, now=timezone.now())  # a 409 here: leased twice

    assert together(worker, 6) == []
    taken = sorted(i for indices in mine.values() for i in indices)
    assert taken == list(range(120))
    assert set(WorkItem.objects.filter(job=parent).values_list("leases", flat=True)) == {1}


def test_parallel_workers_never_take_a_dead_workers_item_twice(tenant, make_node):
    """Every item leased to a worker whose attempt is over: the others take each of them back once
    (the holder is re-checked on the row as the winner left it, not as the loser first read it)."""
    from django.utils import timezone

    from scheduling.models import WorkItem
    from scheduling.services.work import work_done, work_next

    make_node()
    parent = workload_submit(
        tenant=tenant,
        kind="job",
        spec={**JOB, "array": {"parallelism": 6, "work": {"first": 1, "last": 60}}},
        actor=Actor.system(),
    )
    scheduling_cycle_run()
    tasks = list(Workload.objects.filter(array_parent=parent).order_by("pk"))
    dead, rest = tasks[0], tasks[1:]
    while work_next(task=dead, now=timezone.now())[0] is not None:
        pass
    Workload.objects.filter(pk=dead.pk).update(attempt=dead.attempt + 1)  # its attempt is over
    mine: dict[int, list[int]] = {t.pk: [] for t in rest}
    queue = list(rest)

    def worker():
        task = queue.pop()
        while True:
            item, done = work_next(task=task, now=timezone.now())
            if item is None:
                if done:
                    return
                time.sleep(0.01)
                continue
            mine[task.pk].append(item.index)
            work_done(task=task, index=item.index, now=timezone.now())

    assert together(worker, 5) == []
    assert sorted(i for indices in mine.values() for i in indices) == list(range(60))
    assert set(WorkItem.objects.filter(job=parent).values_list("leases", flat=True)) == {2}
