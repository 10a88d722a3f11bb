"""Enqueuing many commands at once (``node_commands_enqueue_many``): what the scheduling cycle uses."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings

from nodes.models import NodeCommand, NodeCommandEvent
from nodes.services import commands as commands_service
from nodes.services import wakeup
from nodes.services.commands import CommandRequest, node_command_enqueue, node_commands_enqueue_many
from portal.errors import ValidationFailed


def start(workload_id: str) -> dict:
    return {"workload_id": workload_id, "image": "nvcr.io/nvidia/pytorch:24.08", "gpu_uuids": ["GPU-x"]}


def test_many_commands_are_stored_with_their_history_and_delivered(register_node):
    a, b = register_node(), register_node()
    made = node_commands_enqueue_many(
        commands=[
            CommandRequest(
                node_id=a.node_id, kind="start_workload", payload=start("1"), idempotency_key="s1"
            ),
            CommandRequest(node_id=b.node_id, kind="start_workload", payload=start("2")),
            CommandRequest(node_id=a.node_id, kind="drain", payload={}),
        ]
    )
    assert [c.kind for c in made] == ["start_workload", "start_workload", "drain"]
    assert NodeCommand.objects.count() == 3
    for command in made:
        stored = NodeCommand.objects.get(pk=command.pk)
        assert (stored.node_id, stored.state, stored.attempt) == (command.node_id, "pending", 0)
        assert list(stored.events.values_list("event", "from_state", "to_state")) == [
            ("created", "", "pending")
        ]
    assert NodeCommand.objects.get(pk=made[0].pk).idempotency_key == "s1"
    # The agents' long polls get them, each node its own (one enqueue time: no order among them).
    got_a = {c["id"]: c for c in a.poll().json()["commands"]}
    assert {i: c["kind"] for i, c in got_a.items()} == {
        str(made[0].pk): "start_workload",
        str(made[2].pk): "drain",
    }
    assert got_a[str(made[0].pk)]["payload"]["workload_id"] == "1"
    assert [c["id"] for c in b.poll().json()["commands"]] == [str(made[1].pk)]


def test_idempotency_keys_are_honoured(register_node):
    a, b = register_node(), register_node()
    first = node_command_enqueue(node=a.node, kind="start_workload", payload=start("1"), idempotency_key="k1")
    made = node_commands_enqueue_many(
        commands=[
            CommandRequest(
                node_id=a.node_id, kind="start_workload", payload=start("1"), idempotency_key="k1"
            ),
            CommandRequest(
                node_id=a.node_id, kind="start_workload", payload=start("2"), idempotency_key="k2"
            ),
            CommandRequest(
                node_id=a.node_id, kind="start_workload", payload=start("2"), idempotency_key="k2"
            ),
            # The same key on another node is another command.
            CommandRequest(
                node_id=b.node_id, kind="start_workload", payload=start("1"), idempotency_key="k1"
            ),
        ]
    )
    assert made[0].pk == first.pk
    assert made[1].pk == made[2].pk != first.pk
    assert made[3].pk not in (first.pk, made[1].pk) and made[3].node_id == b.node_id
    assert NodeCommand.objects.count() == 3
    assert NodeCommandEvent.objects.filter(event="created").count() == 3
    # Again: nothing new.
    again = node_commands_enqueue_many(
        commands=[
            CommandRequest(node_id=b.node_id, kind="start_workload", payload=start("1"), idempotency_key="k1")
        ]
    )
    assert again[0].pk == made[3].pk and NodeCommand.objects.count() == 3


def test_one_invalid_command_refuses_the_lot(agent):
    with pytest.raises(ValidationFailed) as exc:
        node_commands_enqueue_many(
            commands=[
                CommandRequest(node_id=agent.node_id, kind="start_workload", payload=start("1")),
                CommandRequest(node_id=agent.node_id, kind="start_workload", payload={"workload_id": "2"}),
            ]
        )
    assert "payload" in exc.value.fields
    with pytest.raises(ValidationFailed) as exc:
        node_commands_enqueue_many(
            commands=[CommandRequest(node_id=agent.node_id, kind="reboot", payload={})]
        )
    assert "kind" in exc.value.fields
    assert NodeCommand.objects.count() == 0 and NodeCommandEvent.objects.count() == 0
    assert node_commands_enqueue_many(commands=[]) == []


def test_each_node_is_woken_once_after_commit(register_node, monkeypatch, django_capture_on_commit_callbacks):
    a, b = register_node(), register_node()
    woken: list[list[int]] = []
    monkeypatch.setattr(
        commands_service, "node_commands_notify_many", lambda *, node_ids: woken.append(node_ids)
    )
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        node_commands_enqueue_many(
            commands=[
                CommandRequest(node_id=n, kind="start_workload", payload=start(str(i)))
                for i, n in enumerate([b.node_id, a.node_id, b.node_id, a.node_id, b.node_id])
            ]
        )
    assert woken == []  # not before the commit
    for callback in callbacks:
        callback()
    assert woken == [sorted([a.node_id, b.node_id])]


@pytest.mark.skipif(not settings.REDIS_URL, reason="needs Redis (REDIS_URL)")
def test_notify_many_publishes_on_each_nodes_channel():
    client = redis.Redis.from_url(settings.REDIS_URL)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(wakeup.channel_for(910001), wakeup.channel_for(910002))
    try:
        pubsub.get_message(timeout=1)  # the subscription confirmations
        wakeup.node_commands_notify_many(node_ids=[910001, 910002])
        got = set()
        for _ in range(20):
            message = pubsub.get_message(timeout=0.5)
            if message is not None:
                got.add(message["channel"].decode())
            if len(got) == 2:
                break
        assert got == {wakeup.channel_for(910001), wakeup.channel_for(910002)}
    finally:
        pubsub.close()
        client.close()
