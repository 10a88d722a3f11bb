"""The app's metrics in /metrics: stored values (written where the work runs, read at scrape time)
and gauges read from the database; each moves when the thing it counts happens."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from portal.metrics import StoredMetric, metrics_store
from portal.models import MetricValue
from scheduling.models import Allocation, Workload
from tests.scheduling.conftest import H100, make_node, regions, submit  # noqa: F401  (fixtures)


def scrape(client) -> dict:
    """name -> (type, {(sample name, labels as sorted tuple): value})."""
    response = client.get("/metrics")
    assert response.status_code == 200
    out = {}
    for family in text_string_to_metric_families(response.content.decode()):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        out[family.name] = (family.type, samples)
    return out


def value(metrics: dict, family: str, sample: str | None = None, **labels) -> float | None:
    return metrics[family][1].get((sample or family, tuple(sorted(labels.items()))))


@pytest.fixture(autouse=True)
def _no_cycle_tasks(settings):
    settings.SCHEDULING_TRIGGER_CYCLES = False


def test_stored_counters_histograms_and_gauges_add_up_in_one_statement(db, client, django_assert_num_queries):
    c = StoredMetric("gpupool_test_things", "Things.", "counter", ("kind",))
    h = StoredMetric("gpupool_test_wait_seconds", "Waits.", "histogram", ("plan",), buckets=(1, 10))
    g = StoredMetric("gpupool_test_last_timestamp_seconds", "Last.", "gauge")
    with django_assert_num_queries(1):
        metrics_store(c.inc("a") + c.inc("a", amount=2) + h.observe(0.5, "spot") + h.observe(50, "spot"))
    metrics_store(c.inc("b") + h.observe(5, "spot") + g.set(100.0))
    metrics_store(g.set(42.0) + c.inc("a"))
    rows = {(r.name, r.labels, r.bucket): r.value for r in MetricValue.objects.all()}
    assert rows[("gpupool_test_things", '["a"]', "")] == 4
    assert rows[("gpupool_test_things", '["b"]', "")] == 1
    assert rows[("gpupool_test_last_timestamp_seconds", "[]", "")] == 42.0  # set, not added
    assert rows[("gpupool_test_wait_seconds", '["spot"]', "1.0")] == 1
    assert rows[("gpupool_test_wait_seconds", '["spot"]', "10.0")] == 1
    assert rows[("gpupool_test_wait_seconds", '["spot"]', "+Inf")] == 1
    assert rows[("gpupool_test_wait_seconds", '["spot"]', "sum")] == 55.5
    with pytest.raises(ValueError, match="labels"):
        c.inc()


def test_every_needed_metric_is_in_metrics_with_its_type_and_labels(db, client):
    from tests.deploy.helpers import exported_series, exposed_name

    text = client.get("/metrics").content.decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    series = exported_series(text)
    expected_labels = {
        "gpupool_scheduling_queue_wait_seconds": {"plan"},
        "gpupool_scheduling_pending_workloads": {"plan"},
        "gpupool_scheduling_cycle_duration_seconds": set(),
        "gpupool_scheduling_cycles_total": {"result"},
        "gpupool_scheduling_last_success_timestamp_seconds": set(),
        "gpupool_gpus_allocated": {"model", "region", "plan"},
        "gpupool_scheduling_fragmentation": {"model", "region"},
        "gpupool_celery_queue_length": {"queue"},
        "gpupool_celery_task_latency_seconds": {"queue", "task"},
        "gpupool_invoice_run_last_success_timestamp_seconds": set(),
        "gpupool_invoice_run_last_failure_timestamp_seconds": set(),
        "gpupool_revenue_month_to_date": {"currency", "plan"},
    }
    kinds = {
        "gpupool_scheduling_queue_wait_seconds": "histogram",
        "gpupool_scheduling_cycle_duration_seconds": "histogram",
        "gpupool_celery_task_latency_seconds": "histogram",
        "gpupool_scheduling_cycles_total": "counter",
    }
    for name, labels in expected_labels.items():
        kind = kinds.get(name, "gauge")
        assert exposed_name(name, kind) & series, name
        family = families[name.removesuffix("_total")]
        assert family.type == kind, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample)
    # Never-seen timestamps read 0; pending workloads are listed for every plan.
    m = scrape(client)
    assert value(m, "gpupool_invoice_run_last_success_timestamp_seconds") == 0
    assert value(m, "gpupool_scheduling_pending_workloads", plan="spot") == 0
    assert {dict(k[1])["queue"] for k in m["gpupool_celery_queue_length"][1]} == {
        "default",
        "scheduling",
        "commands",
        "metering",
    }


def test_a_cycle_moves_the_scheduling_metrics(tenant, client, make_node, submit):  # noqa: F811
    from scheduling.tasks import run_cycle

    node = make_node(gpus=2)
    before = scrape(client)
    ok_before = (
        value(before, "gpupool_scheduling_cycles", "gpupool_scheduling_cycles_total", result="ok") or 0
    )
    w = submit(tenant, gpu_count=2)
    Workload.objects.filter(pk=w.pk).update(submitted_at=timezone.now() - timedelta(seconds=42))
    pending = scrape(client)
    assert value(pending, "gpupool_scheduling_pending_workloads", plan="on_demand") == 1
    run_cycle()
    assert Workload.objects.get(pk=w.pk).state == "scheduled"
    m = scrape(client)
    assert (
        value(m, "gpupool_scheduling_cycles", "gpupool_scheduling_cycles_total", result="ok") == ok_before + 1
    )
    assert (
        value(
            m, "gpupool_scheduling_cycle_duration_seconds", "gpupool_scheduling_cycle_duration_seconds_count"
        )
        >= 1
    )
    last = value(m, "gpupool_scheduling_last_success_timestamp_seconds")
    assert abs(last - timezone.now().timestamp()) < 60
    wait = "gpupool_scheduling_queue_wait_seconds"
    assert value(m, wait, wait + "_count", plan="on_demand") == 1
    assert 42 <= value(m, wait, wait + "_sum", plan="on_demand") < 100
    assert value(m, wait, wait + "_bucket", plan="on_demand", le="30.0") == 0
    assert value(m, wait, wait + "_bucket", plan="on_demand", le="60.0") == 1
    assert value(m, "gpupool_scheduling_pending_workloads", plan="on_demand") == 0
    region = node.region.code
    assert value(m, "gpupool_gpus_allocated", model=H100, region=region, plan="on_demand") == 2
    assert Allocation.objects.active().count() == 2


def test_failed_and_skipped_cycles_are_counted(db, client, monkeypatch):
    import scheduling.tasks as tasks
    from scheduling.services.cycle import CycleResult

    def counts():
        m = scrape(client)
        return {
            r: value(m, "gpupool_scheduling_cycles", "gpupool_scheduling_cycles_total", result=r) or 0
            for r in ("ok", "failed", "skipped")
        }

    before = counts()
    monkeypatch.setattr(tasks, "scheduling_cycle_run", lambda: CycleResult(ran=False))  # the lock was held
    tasks.run_cycle()

    def broken():
        raise RuntimeError("database went away")

    monkeypatch.setattr(tasks, "scheduling_cycle_run", broken)
    with pytest.raises(RuntimeError):
        tasks.run_cycle()
    after = counts()
    assert after == {"ok": before["ok"], "failed": before["failed"] + 1, "skipped": before["skipped"] + 1}
    assert value(scrape(client), "gpupool_scheduling_last_success_timestamp_seconds") == 0


def test_fragmentation_is_the_share_of_free_gpus_the_recent_shapes_cannot_use(tenant, make_node, submit):  # noqa: F811
    from scheduling import metrics
    from scheduling.services.cycle import scheduling_cycle_run

    node = make_node(gpus=2)
    key = (H100, node.region.code)
    submit(tenant, gpu_count=1)
    scheduling_cycle_run()
    # One GPU free; the only shape seen (1 GPU) fits it.
    assert metrics.fleet_fragmentation() == {key: 0.0}
    submit(tenant, gpu_count=2)  # waits: the shapes are now half 1-GPU, half 2-GPU
    assert metrics.fleet_fragmentation() == {key: 0.5}
    # Cached between scrapes (the walk over the fleet is not free).
    metrics._cache.clear()
    assert metrics._cache.get("fragmentation", metrics.fleet_fragmentation) == {key: 0.5}
    submit(tenant, gpu_count=1)
    assert metrics._cache.get("fragmentation", metrics.fleet_fragmentation) == {key: 0.5}


def test_invoice_runs_record_their_last_success_and_failure(db, client, monkeypatch):
    import metering.services.invoices as invoices
    from metering.tasks import invoice_run

    start = timezone.now().timestamp()
    invoice_run()
    m = scrape(client)
    success = value(m, "gpupool_invoice_run_last_success_timestamp_seconds")
    assert success >= math.floor(start)
    assert value(m, "gpupool_invoice_run_last_failure_timestamp_seconds") == 0

    def broken(**kwargs):
        raise RuntimeError("usage could not be built")

    monkeypatch.setattr(invoices, "invoice_run", broken)
    with pytest.raises(RuntimeError):
        invoice_run()
    m = scrape(client)
    assert value(m, "gpupool_invoice_run_last_failure_timestamp_seconds") > success - 1
    assert value(m, "gpupool_invoice_run_last_success_timestamp_seconds") == success
