from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from nodes.models import NodeCommand
from nodes.services.commands import (
    command_backoff,
    node_command_enqueue,
    node_commands_deliver_due,
    node_commands_expire,
)
from nodes.signals import command_finished
from portal.errors import ValidationFailed
from tests.conftest import postgres_only

START = {
    "workload_id": "w-1",
    "image": "nvcr.io/nvidia/pytorch:24.08",
    "gpu_uuids": ["GPU-x"],
    "command": ["python"],
}


def events(command) -> list[tuple[str, str, str, int]]:
    return list(command.events.values_list("event", "from_state", "to_state", "attempt"))


def test_command_lifecycle_over_http(agent, capture_signal, django_capture_on_commit_callbacks):
    command = node_command_enqueue(node=agent.node, kind="start_workload", payload=START)
    response = agent.poll(wait=5)
    assert response.status_code == 200
    [wire] = response.json()["commands"]
    assert wire["id"] == str(command.pk) and wire["kind"] == "start_workload" and wire["attempt"] == 1
    assert wire["payload"] == START and wire["deadline"].endswith("Z")
    assert agent.poll(wait=0).json() == {"commands": []}  # delivered: not sent again before its retry time

    assert agent.report(command.pk, "accepted").json() == {"status": "accepted"}
    with capture_signal(command_finished) as calls, django_capture_on_commit_callbacks(execute=True):
        response = agent.report(command.pk, "succeeded", result={"container_id": "abc"})
    assert response.json() == {"status": "succeeded"}
    assert len(calls) == 1 and calls[0]["command"].pk == command.pk and calls[0]["state"] == "succeeded"
    assert calls[0]["result"] == {"container_id": "abc"}

    # Reports are idempotent: a repeat (or a late 'failed') changes nothing and fires nothing.
    with capture_signal(command_finished) as calls, django_capture_on_commit_callbacks(execute=True):
        assert agent.report(command.pk, "succeeded").json() == {"status": "succeeded"}
        assert agent.report(command.pk, "failed").json() == {"status": "succeeded"}
    assert calls == []
    command.refresh_from_db()
    assert command.result == {"container_id": "abc"} and command.finished_at is not None
    assert events(command) == [
        ("created", "", "pending", 0),
        ("delivered", "pending", "delivered", 1),
        ("accepted", "delivered", "accepted", 1),
        ("succeeded", "accepted", "succeeded", 1),
        ("report_ignored", "succeeded", "succeeded", 1),
        ("report_ignored", "succeeded", "succeeded", 1),
    ]


def test_failed_report_finishes_the_command(agent, capture_signal, django_capture_on_commit_callbacks):
    command = node_command_enqueue(node=agent.node, kind="stop_workload", payload={"workload_id": "w"})
    agent.poll()
    with capture_signal(command_finished) as calls, django_capture_on_commit_callbacks(execute=True):
        assert (
            agent.report(command.pk, "failed", result={"error": "no such container"}).json()["status"]
            == "failed"
        )
    assert calls[0]["state"] == "failed"


def test_another_nodes_command_is_404(register_node):
    a, b = register_node(), register_node()
    command = node_command_enqueue(node=a.node, kind="drain", payload={})
    assert b.report(command.pk, "accepted").status_code == 404
    assert b.report("not-a-uuid", "accepted").status_code == 404
    assert b.poll().json() == {"commands": []}
    command.refresh_from_db()
    assert command.state == "pending"


def test_bad_report_status_is_400(agent):
    command = node_command_enqueue(node=agent.node, kind="drain", payload={})
    response = agent.report(command.pk, "done")
    assert response.status_code == 400 and "status" in response.json()["error"]["fields"]


def test_redelivery_with_backoff_then_bounded_attempts(
    agent, capture_signal, django_capture_on_commit_callbacks
):
    t0 = timezone.now()
    command = node_command_enqueue(
        node=agent.node, kind="drain", payload={}, max_attempts=3, deadline=t0 + timedelta(hours=1), now=t0
    )
    delivered, _ = node_commands_deliver_due(node_id=agent.node_id, now=t0)
    assert [c.attempt for c in delivered] == [1]
    # Not acknowledged: nothing before the retry time, then attempt 2, then 3 after a doubled wait.
    first_wait = command_backoff(1)
    delivered, next_due = node_commands_deliver_due(
        node_id=agent.node_id, now=t0 + first_wait - timedelta(seconds=1)
    )
    assert delivered == [] and next_due == t0 + first_wait
    t1 = t0 + first_wait
    assert [c.attempt for c in node_commands_deliver_due(node_id=agent.node_id, now=t1)[0]] == [2]
    assert command_backoff(2) == 2 * first_wait
    assert node_commands_deliver_due(node_id=agent.node_id, now=t1 + first_wait)[0] == []
    t2 = t1 + command_backoff(2)
    assert [c.attempt for c in node_commands_deliver_due(node_id=agent.node_id, now=t2)[0]] == [3]
    # Attempts exhausted: at the next retry time it expires instead of being sent a fourth time.
    with capture_signal(command_finished) as calls, django_capture_on_commit_callbacks(execute=True):
        t3 = t2 + command_backoff(3)
        assert node_commands_deliver_due(node_id=agent.node_id, now=t3)[0] == []
    command.refresh_from_db()
    assert command.state == "expired" and command.attempt == 3
    assert command.result == {"reason": "not acknowledged after all attempts"}
    assert calls[0]["state"] == "expired"
    assert [e[0] for e in events(command)] == [
        "created",
        "delivered",
        "redelivered",
        "redelivered",
        "expired",
    ]


def test_redelivered_command_is_acknowledged_by_either_attempt(agent):
    t0 = timezone.now()
    command = node_command_enqueue(node=agent.node, kind="drain", payload={}, now=t0)
    node_commands_deliver_due(node_id=agent.node_id, now=t0)
    node_commands_deliver_due(node_id=agent.node_id, now=t0 + command_backoff(1))
    assert agent.report(command.pk, "accepted").json()["status"] == "accepted"
    # Accepted: never redelivered again.
    assert node_commands_deliver_due(node_id=agent.node_id, now=t0 + timedelta(days=1))[0] == []


def test_expiry_at_deadline_by_the_beat_task(agent, capture_signal, django_capture_on_commit_callbacks):
    t0 = timezone.now()
    deadline = t0 + timedelta(seconds=30)
    command = node_command_enqueue(node=agent.node, kind="drain", payload={}, deadline=deadline, now=t0)
    assert node_commands_expire(now=deadline - timedelta(seconds=1)) == 0
    with capture_signal(command_finished) as calls, django_capture_on_commit_callbacks(execute=True):
        assert node_commands_expire(now=deadline) == 1
        assert node_commands_expire(now=deadline) == 0  # safe to run twice
    command.refresh_from_db()
    assert command.state == "expired" and command.result == {"reason": "deadline passed"}
    assert len(calls) == 1
    assert agent.poll().json() == {"commands": []}
    assert agent.report(command.pk, "succeeded").json() == {"status": "expired"}


def test_expired_command_is_not_delivered_by_the_long_poll(agent):
    t0 = timezone.now()
    command = node_command_enqueue(
        node=agent.node, kind="drain", payload={}, deadline=t0 + timedelta(seconds=5), now=t0
    )
    assert node_commands_deliver_due(node_id=agent.node_id, now=t0 + timedelta(seconds=6))[0] == []
    command.refresh_from_db()
    assert command.state == "expired"


def test_enqueue_validates_and_is_idempotent_by_key(agent):
    with pytest.raises(ValidationFailed) as exc:
        node_command_enqueue(node=agent.node, kind="reboot", payload={})
    assert "kind" in exc.value.fields
    with pytest.raises(ValidationFailed) as exc:
        node_command_enqueue(node=agent.node, kind="start_workload", payload={"workload_id": "w"})
    assert "payload" in exc.value.fields
    a = node_command_enqueue(node=agent.node, kind="drain", payload={}, idempotency_key="alloc-7-start")
    b = node_command_enqueue(node=agent.node, kind="drain", payload={}, idempotency_key="alloc-7-start")
    assert a.pk == b.pk and NodeCommand.objects.count() == 1


def test_long_poll_waits_and_returns_empty(agent):
    started = time.monotonic()
    assert agent.poll(wait=0.4).json() == {"commands": []}
    assert 0.35 <= time.monotonic() - started < 3


def test_long_poll_wait_is_validated(agent):
    response = agent.poll(wait=31)
    assert response.status_code == 400 and "wait" in response.json()["error"]["fields"]


@pytest.mark.django_db(transaction=True)
def test_long_poll_answers_soon_after_a_command_is_enqueued(register_node):
    # SQLite's in-memory test database locks a table between connections: the thread's INSERT and
    # the poll's SELECT failed with "database table is locked" in 3 of 10 runs (a file database, as
    # `make run` has, waits for the lock instead).
    postgres_only("a thread writes while the long poll reads")
    agent = register_node()
    node = agent.node

    def enqueue_later():
        time.sleep(0.3)
        try:
            node_command_enqueue(node=node, kind="drain", payload={})
        finally:
            connection.close()

    thread = threading.Thread(target=enqueue_later)
    started = time.monotonic()
    thread.start()
    response = agent.poll(wait=10)
    elapsed = time.monotonic() - started
    thread.join()
    assert [c["kind"] for c in response.json()["commands"]] == ["drain"]
    assert 0.3 <= elapsed < 1.5
