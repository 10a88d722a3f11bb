"""Celery metrics through a real worker and broker: queue depth at scrape time, task latency from
the publish-time header, and task ids in the worker's log lines."""

from __future__ import annotations

import io
import json
import logging
import time
from contextlib import contextmanager

import pytest

from portal.celery import app
from portal.logging import JsonFormatter, LogContextFilter
from scheduling.models import Workload
from tests.conftest import postgres_only
from tests.portal.test_metrics_app import scrape, value
from tests.scheduling.conftest import make_node, regions, submit  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)
LATENCY = "gpupool_celery_task_latency_seconds"


@pytest.fixture(autouse=True)
def _postgres_only():
    postgres_only("a worker thread and the test share the database")


@contextmanager
def json_log():
    """The root logger's records as the production handler formats them (JSON, context filter).
    Added once the worker has started: its start-up sets up logging again."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(LogContextFilter())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        root.removeHandler(handler)


def test_a_message_waiting_in_a_queue_is_counted(client):
    def depth():
        return value(scrape(client), "gpupool_celery_queue_length", queue="metering")

    before = depth()
    app.send_task("metering.tasks.dunning_run", queue="metering")  # no worker is running
    try:
        assert depth() == before + 1
    finally:
        with app.connection_for_read() as conn:
            message = conn.default_channel.basic_get("metering", no_ack=True)
            assert message is not None
    assert depth() == before


def test_a_task_run_by_a_worker_records_its_latency_and_logs_with_its_id(
    client,
    tenant,
    make_node,  # noqa: F811
    submit,  # noqa: F811
    settings,
):
    from celery.contrib.testing.worker import start_worker

    from scheduling.tasks import run_cycle

    settings.SCHEDULING_TRIGGER_CYCLES = False
    make_node(gpus=2)
    w = submit(tenant, gpu_count=2)
    # Cycle requests other tests left on the shared broker would run in this worker too.
    app.control.purge()
    m = scrape(client)
    labels = {"queue": "scheduling", "task": "scheduling.tasks.run_cycle"}
    before = value(m, LATENCY, LATENCY + "_count", **labels) or 0
    # The worker sets the root logger's level to its own: INFO, for the cycle's record read here.
    worker = start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10, loglevel="INFO")
    with worker, json_log() as lines:
        result = run_cycle.delay()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Workload.objects.get(pk=w.pk).state != "scheduled":
            time.sleep(0.2)
    assert Workload.objects.get(pk=w.pk).state == "scheduled"
    m = scrape(client)
    assert value(m, LATENCY, LATENCY + "_count", **labels) == before + 1
    assert 0 <= value(m, LATENCY, LATENCY + "_sum", **labels) < 30
    placed = [r for r in lines() if r["message"].startswith("Scheduling cycle: 1 placed")]
    assert len(placed) == 1, lines()
    assert placed[0]["task_id"] == result.id
    assert placed[0]["task_name"] == "scheduling.tasks.run_cycle"
    assert placed[0]["logger"] == "scheduling.services.cycle"


def test_a_broker_key_prefix_keeps_queues_apart_and_is_counted_under_it():
    """Two installations on one Redis database: a task sent under CELERY_BROKER_KEY_PREFIX waits in
    the prefixed queue, where /metrics' queue length reads it, and not in the unprefixed one."""
    from django.conf import settings

    from tests.conftest import python_run

    if not settings.REDIS_URL:
        pytest.skip("the Redis broker's key prefix needs REDIS_URL")
    prefix = f"prefix-test-{time.monotonic_ns()}:"
    code = (
        "import json, django; django.setup(); "
        "from django_redis import get_redis_connection; "
        "from portal.celery import app; from portal.metrics import celery_queue_lengths; "
        "raw = get_redis_connection('default'); before = raw.llen('metering'); "
        "app.send_task('metering.tasks.dunning_run', queue='metering'); "
        f"print(json.dumps([before, raw.llen('metering'), raw.llen('{prefix}metering'), "
        "celery_queue_lengths()['metering']])); "
        f"raw.delete('{prefix}metering')"
    )
    done = python_run(
        code, DJANGO_SETTINGS_MODULE="portal.settings", DEBUG="1", CELERY_BROKER_KEY_PREFIX=prefix
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before, unprefixed, prefixed, counted = json.loads(done.stdout.strip().splitlines()[-1])
    assert unprefixed == before
    assert prefixed == 1 and counted == 1
