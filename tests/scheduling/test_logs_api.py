"""Workload logs: the agent's ingest endpoint (``POST /agent/v1/nodes/<id>/logs``), the API
(``GET /api/v1/{jobs|instances}/<id>/logs/``) and the retention purge, through the real views,
database and scheduling cycle."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client

from portal.models import Tenant
from scheduling.models import WorkloadLogBatch, WorkloadLogLine
from scheduling.services.logs import workload_logs_purge
from tests.scheduling.logs_fixtures import batch, place_job, register_node

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _in_test_thread(monkeypatch):
    from nodes import agent_views

    monkeypatch.setattr(agent_views, "DB_THREAD_SENSITIVE", True)  # the test's transaction


@pytest.fixture
def placed(tenant, submit, cycle):
    return place_job(tenant, submit, cycle)


def texts(job) -> list[str]:
    return list(WorkloadLogLine.objects.filter(workload=job).order_by("id").values_list("text", flat=True))


# --- ingest ----------------------------------------------------------------------------------------


def test_ingest_stores_lines_and_a_repeated_batch_changes_nothing(placed):
    node, job = placed
    now = time.time()
    body = batch(1, job, [[now, "stdout", "epoch 1"], [now + 0.001, "stderr", "warn: lr high"]])
    first = node.send(body)
    assert first.status_code == 200, first.content
    assert first.json() == {"status": "accepted", "lines": 2}
    again = node.send(body)
    assert again.status_code == 200
    assert again.json()["status"] == "duplicate"
    assert texts(job) == ["epoch 1", "warn: lr high"]
    line = WorkloadLogLine.objects.filter(workload=job).order_by("id").last()
    assert line.stream == "stderr"
    assert line.at.tzinfo is not None and abs(line.at.timestamp() - (now + 0.001)) < 1e-3
    # The next seq is a new batch.
    assert node.send(batch(2, job, [[now, "stdout", "epoch 2"]])).json()["status"] == "accepted"
    assert texts(job)[-1] == "epoch 2"


def test_ingest_needs_the_nodes_own_credential(placed):
    node, job = placed
    body = batch(1, job, [[time.time(), "stdout", "x"]])
    assert node.send(body, client=Client()).status_code == 401
    assert node.send(body, client=Client(HTTP_AUTHORIZATION="Node gpn_1_wrong")).status_code == 401
    other = register_node()
    # Another node's credential on this node's URL: 404 (as heartbeats).
    assert other.send(body, node_id=node.node.pk).status_code == 404
    assert texts(job) == []
    assert node.send(body).status_code == 200  # positive control


def test_lines_of_a_workload_not_placed_on_the_node_are_refused(placed, tenant, submit):
    node, job = placed
    stranger = register_node()
    response = stranger.send(batch(1, job, [[time.time(), "stdout", "injected"]]))
    assert response.status_code == 200
    assert response.json()["refused"] == {str(job.pk): "not placed on this node"}
    assert response.json()["lines"] == 0
    unknown = node.send(batch(1, "999999999", [[time.time(), "stdout", "nobody's"]]))
    assert unknown.json()["refused"] == {"999999999": "not placed on this node"}
    assert texts(job) == []
    assert not WorkloadLogLine.objects.filter(text__in=["injected", "nobody's"]).exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"seq": 0, "workloads": []}, "seq"),
        ({"seq": "1", "workloads": []}, "seq"),
        ({"seq": 1, "workloads": {}}, "workloads"),
        ({"seq": 1, "workloads": [{"workload_id": "abc", "lines": []}]}, "workloads[0].workload_id"),
        ({"seq": 1, "workloads": [{"workload_id": "1", "lines": "x"}]}, "workloads[0].lines"),
        ({"seq": 1, "workloads": [{"workload_id": "1", "lines": [[1.0, "stdout"]]}]}, "workloads[0].lines[0]"),
        ({"seq": 1, "workloads": [{"workload_id": "1", "lines": [["now", "stdout", "x"]]}]}, "workloads[0].lines[0].at"),
        ({"seq": 1, "workloads": [{"workload_id": "1", "lines": [[1.0, "stdin", "x"]]}]}, "workloads[0].lines[0].stream"),
        # A stream that cannot be hashed was a 500 (``[] in frozenset``).
        ({"seq": 1, "workloads": [{"workload_id": "1", "lines": [[1.0, ["stdout"], "x"]]}]}, "workloads[0].lines[0].stream"),
        ({"seq": 1, "workloads": [{"workload_id": "1", "lines": [[1.0, {"a": 1}, "x"]]}]}, "workloads[0].lines[0].stream"),
        ({"seq": 1, "workloads": [{"workload_id": "1", "lines": [[1.0, "stdout", 5]]}]}, "workloads[0].lines[0].text"),
        ({"seq": 1, "workloads": [{"workload_id": "1", "lines": [[1.0, "stdout", "a\x00b"]]}]}, "workloads[0].lines[0].text"),
        ({"seq": 1, "workloads": [{"workload_id": "1", "lines": [[1.0, "stdout", "x" * 4097]]}]}, "workloads[0].lines[0].text"),
    ],
)  # fmt: skip
def test_bad_batches_are_400_naming_the_field_and_store_nothing(placed, body, field):
    node, _ = placed
    response = node.send(body)
    assert response.status_code == 400, response.content
    assert field in response.json()["error"]["fields"]
    assert not WorkloadLogBatch.objects.exists()
    assert node.send(raw=b"{not json", body=None).status_code == 400


def test_too_many_lines_in_one_batch_is_400(placed, settings):
    node, job = placed
    settings.WORKLOAD_LOG_BATCH_MAX_LINES = 3
    response = node.send(batch(1, job, [[1.0, "stdout", str(i)] for i in range(4)]))
    assert response.status_code == 400
    assert "workloads" in response.json()["error"]["fields"]


def test_a_time_ahead_of_the_portal_is_stored_as_the_portals(placed):
    node, job = placed
    node.send(batch(1, job, [[time.time() + 86400 * 365, "stdout", "from the future"]]))
    stored = WorkloadLogLine.objects.get(workload=job)
    assert stored.at <= datetime.now(UTC)


# --- the API ---------------------------------------------------------------------------------------


def fill(node, job, count: int, seq: int = 1) -> None:
    now = time.time()
    response = node.send(batch(seq, job, [[now + i / 1000, "stdout", f"line {i}"] for i in range(count)]))
    assert response.json()["lines"] == count


def test_api_tail_and_since(placed, tenant, make_token, api):
    node, job = placed
    fill(node, job, 10)
    client = api(make_token(tenant, scopes=["read"]))
    url = f"/api/v1/jobs/{job.pk}/logs/"
    tail = client.get(url, {"tail": 3}).json()
    assert [line["text"] for line in tail["lines"]] == ["line 7", "line 8", "line 9"]
    assert set(tail["lines"][0]) == {"at", "stream", "text"}
    assert tail["lines"][0]["stream"] == "stdout" and tail["lines"][0]["at"].endswith("Z")
    # Nothing after the end yet; then new lines come after that cursor.
    end = tail["next"]
    assert client.get(url, {"since": end}).json() == {"lines": [], "next": end}
    fill(node, job, 2, seq=2)
    after = client.get(url, {"since": end}).json()
    assert [line["text"] for line in after["lines"]] == ["line 0", "line 1"]
    # Paging forward from the start, two at a time.
    page = client.get(url, {"since": 0, "tail": 4}).json()
    assert [line["text"] for line in page["lines"]] == ["line 0", "line 1", "line 2", "line 3"]
    page = client.get(url, {"since": page["next"], "tail": 4}).json()
    assert [line["text"] for line in page["lines"]] == ["line 4", "line 5", "line 6", "line 7"]
    # Instances have the same action.
    assert client.get(f"/api/v1/instances/{job.pk}/logs/").status_code == 404  # a job is not an instance


@pytest.mark.parametrize(
    ("params", "field"),
    [({"tail": 0}, "tail"), ({"tail": "x"}, "tail"), ({"tail": 10_001}, "tail"), ({"since": -1}, "since"),
     ({"since": "abc"}, "since"), ({"follow": "maybe"}, "follow")],
)  # fmt: skip
def test_api_bad_parameters_are_400_naming_the_field(placed, tenant, make_token, api, params, field):
    _, job = placed
    client = api(make_token(tenant, scopes=["read"]))
    response = client.get(f"/api/v1/jobs/{job.pk}/logs/", params)
    assert response.status_code == 400
    assert field in response.json()["error"]["fields"]


def test_api_another_tenant_gets_404(placed, tenant, make_tenant, make_token, api):
    node, job = placed
    fill(node, job, 1)
    assert api(make_token(tenant, scopes=["read"])).get(f"/api/v1/jobs/{job.pk}/logs/").status_code == 200
    other = make_tenant("other")
    assert api(make_token(other)).get(f"/api/v1/jobs/{job.pk}/logs/").status_code == 404


def test_api_needs_the_read_scope(placed, tenant, make_token, api):
    _, job = placed
    assert api(make_token(tenant, scopes=["billing"])).get(f"/api/v1/jobs/{job.pk}/logs/").status_code == 403


def test_instances_have_logs_too(tenant, submit, cycle, make_token, api):
    node = register_node()
    instance = submit(tenant, kind="instance", gpu_models=["NVIDIA H100 SXM 80GB"])
    cycle()
    node.send(batch(1, instance, [[time.time(), "stderr", "jupyter up"]]))
    body = api(make_token(tenant, scopes=["read"])).get(f"/api/v1/instances/{instance.pk}/logs/").json()
    assert [(line["stream"], line["text"]) for line in body["lines"]] == [("stderr", "jupyter up")]


# --- retention -------------------------------------------------------------------------------------


def test_purge_keeps_each_plans_retention(placed, tenant, settings):
    node, job = placed
    settings.WORKLOAD_LOG_RETENTION_DAYS = {"standard": 7, "pro": 30, "enterprise": 90}
    now = time.time()
    day = 86400
    node.send(batch(1, job, [[now - 10 * day, "stdout", "old"], [now - 1 * day, "stdout", "recent"]]))
    purged = workload_logs_purge()
    assert purged["lines"] == 1
    assert texts(job) == ["recent"]
    # On the pro plan a ten-day-old line stays; past thirty days it goes.
    Tenant.objects.filter(pk=tenant.pk).update(service_plan=Tenant.ServicePlan.PRO)
    node.send(batch(2, job, [[now - 10 * day, "stdout", "pro old"], [now - 31 * day, "stdout", "too old"]]))
    workload_logs_purge()
    assert texts(job) == ["recent", "pro old"]
    # Batch receipts go after the longest retention; running twice changes nothing more.
    later = datetime.now(UTC) + timedelta(days=91)
    assert workload_logs_purge(now=later)["batches"] == 2
    assert workload_logs_purge(now=later) == {"lines": 0, "batches": 0}
