from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from nodes.models import (
    Gpu,
    GpuMinuteRollup,
    GpuSample,
    HeartbeatBatch,
    Node,
    NodeWorkloadStatus,
    SequenceGap,
)
from nodes.signals import workload_exited
from tests.conftest import postgres_only
from tests.nodes.conftest import iso


def send_accepted(agent, count: int) -> datetime:
    """``count`` heartbeats, 10 s apart from five minutes ago, each accepted; the first one's time."""
    t0 = datetime.now(UTC) - timedelta(minutes=5)
    for k in range(count):
        r = agent.heartbeat(agent.batch(ts=t0 + timedelta(seconds=10 * k)))
        assert r.status_code == 200 and r.json()["status"] == "accepted", r.content
    return t0


def written(node_id: int) -> tuple[int, int, int]:
    return (
        HeartbeatBatch.objects.filter(node_id=node_id).count(),
        GpuSample.objects.filter(gpu__node_id=node_id).count(),
        GpuMinuteRollup.objects.filter(gpu__node_id=node_id).count(),
    )


def test_heartbeat_happy_path_stores_samples_rollups_and_latest(agent):
    t0 = datetime(2026, 12, 2, 12, 0, 10, tzinfo=UTC)
    samples = []
    for k in range(3):  # three readings per GPU, in one minute
        ts = t0 + timedelta(seconds=10 * k)
        samples += [
            agent.sample(u, ts, util_pct=10.0 * (k + 1), mem_used_mib=1000 * (k + 1), temp_c=50 + k)
            for u in agent.uuids
        ]
    response = agent.heartbeat(agent.batch(samples=samples))
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "accepted" and body["gap"] is None and body["server_time"].endswith("Z")
    assert written(agent.node_id) == (1, 6, 2)
    gpu = Gpu.objects.get(uuid=agent.uuids[0])
    rollup = GpuMinuteRollup.objects.get(gpu=gpu)
    assert rollup.minute == datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    assert rollup.sample_count == 3 and rollup.util_avg == pytest.approx(20.0) and rollup.util_max == 30.0
    assert rollup.mem_used_avg_mib == pytest.approx(2000) and rollup.temp_max == 52
    assert gpu.last_util_pct == 30.0 and gpu.last_mem_used_mib == 3000 and gpu.last_sm_clock_mhz == 1980
    sample = GpuSample.objects.filter(gpu=gpu).order_by("ts").first()
    assert (
        sample.processes == [{"pid": 42, "used_mib": 900, "workload_id": "w1"}] and sample.xid_errors is None
    )
    node = agent.node
    assert node.last_seq == 1 and node.last_heartbeat_at is not None and node.status["uptime_s"] == 100


def test_rollups_add_up_across_batches_in_the_same_minute(agent):
    t0 = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)
    u = agent.uuids[0]
    agent.heartbeat(agent.batch(samples=[agent.sample(u, t0, util_pct=10.0, power_w=100.0)]))
    agent.heartbeat(
        agent.batch(samples=[agent.sample(u, t0 + timedelta(seconds=30), util_pct=50.0, power_w=300.0)])
    )
    rollup = GpuMinuteRollup.objects.get(gpu__uuid=u)
    assert rollup.sample_count == 2 and rollup.util_avg == pytest.approx(30.0) and rollup.power_avg_w == 200.0


def test_duplicate_seq_is_answered_duplicate_and_writes_nothing(agent):
    body = agent.batch()
    assert agent.heartbeat(body).json()["status"] == "accepted"
    before = written(agent.node_id)
    response = agent.heartbeat(body)
    assert response.status_code == 200 and response.json()["status"] == "duplicate"
    assert written(agent.node_id) == before
    assert (
        GpuMinuteRollup.objects.filter(gpu__node_id=agent.node_id).values_list("sample_count", flat=True)[0]
        == 1
    )


def test_gaps_are_recorded_and_late_batches_fill_them(agent):
    assert agent.heartbeat(agent.batch(1)).json()["gap"] is None
    response = agent.heartbeat(agent.batch(5))
    assert response.json() == {**response.json(), "status": "accepted", "gap": [2, 4]}
    gap = SequenceGap.objects.get(node_id=agent.node_id)
    assert (gap.first_seq, gap.last_seq, gap.missing) == (2, 4, 3)
    # Out of order: 3 arrives late, splitting the gap into 2..2 and 4..4.
    assert agent.heartbeat(agent.batch(3)).json()["status"] == "accepted"
    assert list(SequenceGap.objects.filter(node_id=agent.node_id).values_list("first_seq", "last_seq")) == [
        (2, 2),
        (4, 4),
    ]
    assert HeartbeatBatch.objects.get(node_id=agent.node_id, seq=3).out_of_order
    agent.heartbeat(agent.batch(2))
    agent.heartbeat(agent.batch(4))
    assert not SequenceGap.objects.filter(node_id=agent.node_id).exists()
    assert agent.node.last_seq == 5  # a late batch does not move the high-water mark
    assert agent.heartbeat(agent.batch(3)).json()["status"] == "duplicate"
    assert HeartbeatBatch.objects.filter(node_id=agent.node_id).count() == 5


def test_late_batch_does_not_overwrite_latest_values(agent):
    now = datetime.now(UTC)
    u = agent.uuids[0]
    agent.heartbeat(agent.batch(2, samples=[agent.sample(u, now, util_pct=90.0)]))
    agent.heartbeat(agent.batch(1, samples=[agent.sample(u, now - timedelta(seconds=5), util_pct=5.0)]))
    assert Gpu.objects.get(uuid=u).last_util_pct == 90.0
    assert GpuSample.objects.filter(gpu__uuid=u).count() == 2


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b.pop("seq"), "seq"),
        (lambda b: b.update(seq=0), "seq"),
        (lambda b: b.update(seq="7"), "seq"),
        (lambda b: b.update(samples={}), "samples"),
        (lambda b: b["samples"][1].update(util_pct=101), "samples[1].util_pct"),
        (lambda b: b["samples"][1].update(util_pct="high"), "samples[1].util_pct"),
        (lambda b: b["samples"][0].update(mem_used_mib=-1), "samples[0].mem_used_mib"),
        (lambda b: b["samples"][0].update(ts="yesterday"), "samples[0].ts"),
        (lambda b: b["samples"][0].update(ts="2026-12-02T12:00:00"), "samples[0].ts"),
        (lambda b: b["samples"][0].pop("gpu_uuid"), "samples[0].gpu_uuid"),
        (lambda b: b["samples"][0].update(xid_errors=["79"]), "samples[0].xid_errors"),
        (lambda b: b["samples"][0].update(fell_off_bus="yes"), "samples[0].fell_off_bus"),
        (lambda b: b["samples"][0].update(processes=[{"pid": "x"}]), "samples[0].processes[0]"),
        (lambda b: b.update(status=[]), "status"),
        (lambda b: b.update(workloads=[{"workload_id": "w", "state": "sleeping"}]), "workloads[0].state"),
    ],
)
def test_malformed_batch_is_400_naming_the_field_and_writes_nothing(agent, mutate, field):
    body = agent.batch()
    mutate(body)
    response = agent.heartbeat(body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid" and field in error["fields"] and error["message"].startswith(field)
    assert written(agent.node_id) == (0, 0, 0)
    assert agent.node.last_heartbeat_at is None


def test_not_json_is_400(agent):
    response = agent.heartbeat(None, raw=b"{not json")
    assert response.status_code == 400 and "body" in response.json()["error"]["fields"]


def test_too_many_samples_is_400(agent, settings):
    settings.NODE_HEARTBEAT_MAX_SAMPLES = 10
    now = datetime.now(UTC)
    body = agent.batch(samples=[agent.sample(agent.uuids[0], now - timedelta(seconds=i)) for i in range(11)])
    response = agent.heartbeat(body)
    assert response.status_code == 400 and "samples" in response.json()["error"]["fields"]
    assert written(agent.node_id) == (0, 0, 0)


def test_oversized_body_is_400(agent, settings):
    settings.NODE_HEARTBEAT_MAX_BYTES = 2000
    body = agent.batch()
    body["status"]["padding"] = "x" * 3000
    response = agent.heartbeat(body)
    assert response.status_code == 400 and "body" in response.json()["error"]["fields"]
    assert written(agent.node_id) == (0, 0, 0)


def test_body_over_the_upload_limit_is_413(agent, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = agent.batch()
    body["status"]["padding"] = "x" * 2000
    assert agent.heartbeat(body).status_code == 413
    assert written(agent.node_id) == (0, 0, 0)


def test_samples_for_unregistered_gpus_are_counted_not_stored(agent):
    now = datetime.now(UTC)
    body = agent.batch(samples=[agent.sample(agent.uuids[0], now), agent.sample("GPU-stranger", now)])
    response = agent.heartbeat(body)
    assert response.json()["status"] == "accepted" and response.json()["ignored_samples"] == 1
    assert written(agent.node_id) == (1, 1, 1)


def test_samples_are_not_checked_against_the_gpu_table_but_go_with_their_gpu(agent):
    """Raw samples carry their GPU's id without a database constraint (one look-up per sample at
    commit, a tenth of PostgreSQL's CPU under bench/scale.py); the minute rollups keep theirs, and
    deleting a GPU still deletes its samples."""
    postgres_only("the constraints are read from PostgreSQL's catalog")
    now = datetime.now(UTC)
    assert (
        agent.heartbeat(agent.batch(samples=[agent.sample(u, now) for u in agent.uuids])).status_code == 200
    )

    def gpu_constraints(table: str) -> int:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT COUNT(*) FROM pg_constraint WHERE contype = 'f' AND conrelid = %s::regclass"
                " AND confrelid = %s::regclass",
                [table, Gpu._meta.db_table],
            )
            return cur.fetchone()[0]

    assert gpu_constraints(GpuSample._meta.db_table) == 0
    assert gpu_constraints(GpuMinuteRollup._meta.db_table) == 1
    gpu = Gpu.objects.get(uuid=agent.uuids[0])
    assert GpuSample.objects.filter(gpu=gpu).count() == 1
    gpu.delete()
    assert not GpuSample.objects.filter(gpu_id=gpu.pk).exists()
    assert GpuSample.objects.count() == len(agent.uuids) - 1


def test_a_heartbeat_updates_its_node_in_place(agent):
    """Nothing a heartbeat writes on the node is indexed and its pages keep room, so PostgreSQL
    updates the row in place (HOT: no new index entries), 10 s apart for every node of the fleet."""
    postgres_only("HOT updates are PostgreSQL's")

    def counts() -> tuple[int, int, list[str]]:
        # PostgreSQL 15+ counts into the "xact" figures whatever this backend has not yet reported
        # (it reports at most once a second, between transactions): an earlier test's updates may
        # be in them. Within this test's transaction nothing is reported, so the difference is ours.
        with connection.cursor() as c:
            c.execute(
                "SELECT pg_stat_get_xact_tuples_updated(%s::regclass),"
                " pg_stat_get_xact_tuples_hot_updated(%s::regclass),"
                " (SELECT reloptions FROM pg_class WHERE oid = %s::regclass)",
                [Node._meta.db_table] * 3,
            )
            return c.fetchone()

    updated_before, hot_before, _ = counts()
    send_accepted(agent, 3)
    updated, hot, options = counts()
    updated, hot = updated - updated_before, hot - hot_before
    assert updated >= 3 and hot == updated, (updated, hot)
    assert "fillfactor=70" in options
    assert agent.node.last_seq == 3


def test_future_timestamps_are_refused(agent):
    future = datetime.now(UTC) + timedelta(hours=1)
    response = agent.heartbeat(agent.batch(samples=[agent.sample(agent.uuids[0], future)]))
    assert response.status_code == 400 and "samples[0].ts" in response.json()["error"]["fields"]


def test_workload_exited_fires_once_with_exit_code(agent, capture_signal, django_capture_on_commit_callbacks):
    running = [
        {"workload_id": "123", "state": "running", "exit_code": None, "started_at": iso(datetime.now(UTC))}
    ]
    exited = [
        {
            "workload_id": "123",
            "state": "exited",
            "exit_code": 3,
            "finished_at": iso(datetime.now(UTC)),
            "message": "bye",
        }
    ]
    with capture_signal(workload_exited) as calls, django_capture_on_commit_callbacks(execute=True):
        agent.heartbeat(agent.batch(workloads=running))
        assert calls == []
        agent.heartbeat(agent.batch(workloads=exited))
        agent.heartbeat(agent.batch(workloads=exited))  # reported again: no second event
    assert len(calls) == 1
    call = calls[0]
    assert call["workload_id"] == "123" and call["exit_code"] == 3 and call["state"] == "exited"
    assert call["node"].pk == agent.node_id and call["message"] == "bye"
    assert NodeWorkloadStatus.objects.get(node_id=agent.node_id, workload_id="123").exit_code == 3


def test_heartbeat_brings_a_suspect_node_back_to_its_state(agent):
    Node.objects.filter(pk=agent.node_id).update(state="suspect", resume_state="cordoned")
    agent.heartbeat(agent.batch())
    node = agent.node
    assert node.state == "cordoned" and node.state_reason == "Heartbeats resumed."


@pytest.mark.django_db(transaction=True)
def test_the_ingest_leaves_its_commit_to_djangos_atomic_block(register_node):
    """The ingest sends no COMMIT or ROLLBACK of its own, also when its atomic block is the
    outermost one: Django's block ends the transaction, so Django's view of it stays true."""
    from nodes.services.heartbeat_parse import heartbeat_parse
    from nodes.services.ingest import heartbeat_ingest

    agent = register_node()
    t0 = datetime.now(UTC)
    body = agent.batch(samples=[agent.sample(u, t0) for u in agent.uuids])
    batch = heartbeat_parse(json.dumps(body).encode())
    statements: list[str] = []

    def capture(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    assert not connection.in_atomic_block
    with connection.execute_wrapper(capture):
        result = heartbeat_ingest(node_id=agent.node_id, credential=agent.credential, batch=batch)
    assert result.status == "accepted"
    assert any(f"INSERT INTO {GpuSample._meta.db_table}" in s for s in statements)  # the writes were seen
    assert [s for s in statements if s.strip().upper() in ("COMMIT", "ROLLBACK")] == []
    assert written(agent.node_id)[1] == len(agent.uuids)


@pytest.mark.django_db(transaction=True)
def test_concurrent_duplicate_heartbeats_insert_once(register_node):
    """Two threads send the same (node, seq) at once, many times: each batch is stored exactly once."""
    agent = register_node(gpus=8)
    bodies = [agent.batch() for _ in range(15)]
    results: list[str] = []
    errors: list[BaseException] = []
    retries: list[int] = []
    barrier = threading.Barrier(2)

    def send():
        try:
            for body in bodies:
                barrier.wait(timeout=10)
                for _ in range(200):
                    r = agent.heartbeat(body)
                    if r.status_code != 500:
                        break
                    # Only SQLite's in-memory shared-cache test database answers "table is locked"
                    # (no busy wait there); the agent resends a failed batch, as here.
                    retries.append(1)
                    time.sleep(0.005)
                results.append(r.json()["status"] if r.status_code == 200 else f"HTTP {r.status_code}")
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    if connection.vendor == "postgresql":
        assert retries == []  # row locks and ON CONFLICT: no request fails
    assert sorted(results) == ["accepted"] * 15 + ["duplicate"] * 15
    assert written(agent.node_id) == (15, 15 * 8, 8)
    assert (
        sum(GpuMinuteRollup.objects.filter(gpu__node_id=agent.node_id).values_list("sample_count", flat=True))
        == 120
    )


def test_gauges_a_gpu_cannot_report_are_null_and_rollups_leave_them_out(agent):
    """A GPU in MIG mode reports no utilisation: null on the wire, NULL in the database, and the
    minute's utilisation average is over the readings that had one."""
    t0 = datetime(2026, 12, 2, 12, 5, 0, tzinfo=UTC)
    u = agent.uuids[0]
    samples = [
        agent.sample(u, t0, util_pct=40.0, mem_used_mib=1000, power_w=100.0, temp_c=50),
        agent.sample(
            u, t0 + timedelta(seconds=10), util_pct=None, mem_used_mib=3000, power_w=None, temp_c=70
        ),
        agent.sample(
            u,
            t0 + timedelta(seconds=20),
            util_pct=None,
            processes=[{"pid": 7, "used_mib": None, "workload_id": "w1"}],
        ),
    ]
    response = agent.heartbeat(agent.batch(samples=samples))
    assert response.status_code == 200, response.content
    stored = list(GpuSample.objects.filter(gpu__uuid=u).order_by("ts").values_list("util_pct", "power_w"))
    assert stored == [(40.0, 100.0), (None, None), (None, 300.5)]
    assert GpuSample.objects.filter(gpu__uuid=u).order_by("ts").last().processes == [
        {"pid": 7, "used_mib": None, "workload_id": "w1"}
    ]
    rollup = GpuMinuteRollup.objects.get(gpu__uuid=u)
    assert (rollup.sample_count, rollup.util_count, rollup.power_count, rollup.mem_used_count) == (3, 1, 2, 3)
    assert rollup.util_avg == 40.0 and rollup.util_max == 40.0  # not dragged down to 13.3 by zeros
    assert rollup.power_avg_w == pytest.approx(200.25) and rollup.temp_max == 70
    gpu = Gpu.objects.get(uuid=u)
    assert gpu.last_util_pct is None and gpu.last_power_w == 300.5 and gpu.last_mem_used_mib == 1000


def test_a_minute_without_any_reading_of_a_gauge_has_no_max_or_average(agent):
    t0 = datetime(2026, 12, 2, 12, 7, 0, tzinfo=UTC)
    u = agent.uuids[0]
    blank = {"util_pct": None, "mem_used_mib": None, "power_w": None, "temp_c": None}
    agent.heartbeat(agent.batch(samples=[agent.sample(u, t0, **blank)]))
    rollup = GpuMinuteRollup.objects.get(gpu__uuid=u)
    assert (rollup.sample_count, rollup.util_max, rollup.mem_used_max, rollup.temp_max) == (
        1,
        None,
        None,
        None,
    )
    assert (rollup.util_avg, rollup.mem_used_avg_mib, rollup.power_avg_w) == (None, None, None)
    # A later reading in the same minute fills them in; the NULL one still counts nowhere.
    agent.heartbeat(
        agent.batch(samples=[agent.sample(u, t0 + timedelta(seconds=30), util_pct=80.0, temp_c=65)])
    )
    rollup.refresh_from_db()
    assert (rollup.sample_count, rollup.util_count, rollup.util_max, rollup.util_avg) == (2, 1, 80.0, 80.0)
    assert rollup.temp_max == 65 and rollup.mem_used_max == 1000


@pytest.mark.parametrize("gauge", ["util_pct", "mem_used_mib", "power_w", "temp_c"])
def test_a_gauge_must_be_sent_even_when_null(agent, gauge):
    body = agent.batch()
    body["samples"][0].pop(gauge)
    response = agent.heartbeat(body)
    assert response.status_code == 400 and f"samples[0].{gauge}" in response.json()["error"]["fields"]
    assert written(agent.node_id) == (0, 0, 0)


def test_the_agents_wire_form_for_unreportable_gauges_is_accepted(agent):
    """Both sides of the contract: what the agent program sends for a GPU in MIG mode and for one
    that fell off the bus goes through the portal's validation and is stored as NULL."""
    from nodes.agent.types import GpuSample as AgentSample
    from nodes.agent.types import ProcessSample

    now = datetime.now(UTC).timestamp()
    mig = AgentSample(
        gpu_uuid=agent.uuids[0], ts=now, util_pct=None, mem_used_mib=2048, power_w=250.0, temp_c=60,
        processes=[ProcessSample(pid=9, used_mib=None, workload_id="w")],
    )  # fmt: skip
    lost = AgentSample(gpu_uuid=agent.uuids[1], ts=now, fell_off_bus=True, xid_errors=[79])
    response = agent.heartbeat(agent.batch(samples=[mig.to_json(), lost.to_json()]))
    assert response.status_code == 200, response.content
    rows = dict(GpuSample.objects.filter(gpu__node_id=agent.node_id).values_list("gpu__uuid", "util_pct"))
    assert rows == {agent.uuids[0]: None, agent.uuids[1]: None}
    assert Gpu.objects.get(uuid=agent.uuids[0]).last_mem_used_mib == 2048
    assert Gpu.objects.get(uuid=agent.uuids[1]).isolated


def test_agent_urls_answer_json_whatever_the_method_or_path(agent):
    """The agent protocol's handler serves heartbeats, polls and reports; every other method or path
    takes Django's handler, and all of them answer in the API's error shape."""
    ok = agent.heartbeat(agent.batch())
    assert ok.status_code == 200 and int(ok.headers["Content-Length"]) == len(ok.content)
    wrong_method = agent.request("GET", agent.url("heartbeat"))
    assert wrong_method.status_code == 405 and wrong_method.headers["Allow"] == "POST"
    assert wrong_method.json()["error"]["code"]
    unknown = agent.request("POST", agent.url("heartbeats"), "{}")
    assert unknown.status_code == 404 and "error" in unknown.json()
    report = agent.request("GET", agent.url("commands/not-a-command/report"))
    assert report.status_code == 405 and "error" in report.json()
    assert agent.report("not-a-command", "accepted").status_code == 404


def test_the_ingest_statements_are_prepared_on_postgresql(agent):
    """On PostgreSQL the ingest's statements (constant texts, whatever the batch) are prepared on the
    connection after a few uses (``DB_PREPARED_STATEMENTS``): parsed and planned once, not on every
    heartbeat, also when they go in the pipeline."""
    postgres_only("prepared statements are PostgreSQL's")
    t0 = send_accepted(agent, 7)
    with connection.cursor() as c:
        c.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [row[0] for row in c.fetchall()]
    for statement in (
        "INSERT INTO nodes_heartbeatbatch",
        "INSERT INTO nodes_gpusample",
        "INSERT INTO nodes_gpuminuterollup",
        "UPDATE nodes_gpu AS g",
        "UPDATE nodes_node SET",
    ):
        assert any(statement in s for s in prepared), statement
    assert Gpu.objects.filter(node_id=agent.node_id, last_sample_at=t0 + timedelta(seconds=60)).count() == 2
